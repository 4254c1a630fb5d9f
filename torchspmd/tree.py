"""The tensors of nested values: model outputs and batches (dicts, transformers'
``ModelOutput``, named tuples, dataclasses, lists and tuples)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch

__all__ = ["map_tensors", "walk_tensors"]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] | None = None) -> Any:
    """``obj`` with ``fn`` applied to its tensors, through dicts (``ModelOutput`` too),
    named tuples, dataclasses, lists and tuples; ``other``, when given, sees every other
    leaf (and returns what replaces it)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: map_tensors(v, fn, other) for k, v in obj.items()}
        new = copy.copy(obj)  # OrderedDict, transformers' ModelOutput: keep the class
        for k, v in obj.items():
            new[k] = map_tensors(v, fn, other)
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn, other) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn, other) for f in dataclasses.fields(obj)
                                           if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, other) for v in obj)
    return other(obj) if other is not None else obj


def walk_tensors(obj: Any, fn: Callable[[torch.Tensor], None]) -> None:
    map_tensors(obj, lambda t: fn(t) or t)
