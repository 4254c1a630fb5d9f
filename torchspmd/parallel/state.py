"""Gradient clipping and full state dicts over sharded (and plain) parameters."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from torchspmd import engines

__all__ = ["clip_grad_norm_", "full_state_dict", "load_full_state_dict"]


def _params(model_or_params) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        return [model_or_params]
    return list(model_or_params)


def clip_grad_norm_(model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``max_norm``; return the
    global norm (a plain tensor, the same on every process) before clipping.

    Works on sharded (DTensor) and plain gradients alike, also mixed: each group of
    gradients laid out alike is reduced with one collective."""
    engine = engines.current("clip_grad_norm_")
    return engine.clip_grad_norm_(_params(model_or_params), max_norm, float(norm_type), error_if_nonfinite)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The model's whole state as plain tensors, keyed like the unwrapped module, loadable
    into it with ``load_state_dict``. Every process must call it (it gathers); with
    ``rank0_only`` the other processes get an empty dict."""
    return engines.current("full_state_dict").full_state_dict(model, rank0_only, cpu)


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
    """Load whole (unsharded) tensors into a sharded model: the counterpart of
    ``full_state_dict``. Every process passes the same values (read from the same file);
    each keeps its own block, so nothing is communicated. A tied parameter may be given
    under either of its names. Returns the model's keys that got no value (an error with
    ``strict``)."""
    return engines.current("load_full_state_dict").load_full_state_dict(model, state_dict, strict)
