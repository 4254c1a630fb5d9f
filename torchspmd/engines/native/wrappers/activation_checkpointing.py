"""The native engine's ``checkpoint_module``: activation checkpointing of one module's forward
(non-reentrant ``torch.utils.checkpoint``)."""

from __future__ import annotations

import functools

import torch.nn as nn
import torch.utils.checkpoint

from torchspmd.engines.native.start import global_mode
from torchspmd.engines.native.start import rng as _rng

_CLASSES: dict[type, type] = {}


def _run_forward(module: nn.Module, cls: type, global_view: bool, *args, **kwargs):
    """The checkpointed module's own forward (run in forward, and again in backward, with the
    global view's mode as it was in forward: on global DTensors it lifts plain tensors in the
    recomputation too). Its outermost recomputation forgets a tensor-parallel pair's random
    stream left open by the recomputation of another module (stopped once backward had what it
    needs, maybe before the pair's partner ran): ``_rng.recomputing``."""
    with _rng.recomputing(), global_mode.as_it_was(global_view):
        return super(cls, module).forward(*args, **kwargs)


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:

        def forward(self, *args, **kwargs):
            return torch.utils.checkpoint.checkpoint(
                functools.partial(_run_forward, self, new_cls, global_mode.active()), *args, use_reentrant=False,
                **kwargs
            )

        new_cls = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_torchspmd_checkpointed": True})
        _CLASSES[cls] = new_cls
    return _CLASSES[cls]


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s activations in backward (arguments checked by
    ``torchspmd.checkpoint_module``). Returns the same module, its class made a subclass
    whose forward runs under ``torch.utils.checkpoint``."""
    if getattr(module, "_torchspmd_checkpointed", False):
        return module
    module.__class__ = _checkpointed_class(type(module))
    return module
