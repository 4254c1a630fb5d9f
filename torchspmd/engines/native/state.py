"""The native engine's gradient clipping and full state dicts over sharded (and plain) parameters."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchspmd.checkpoint_format.keys import match

__all__ = ["clip_grad_norm_", "full_state_dict", "load_full_state_dict", "quiet_gathers"]


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``max_norm``; return the
    global norm (a plain tensor, the same on every process) before clipping.

    Works on sharded (DTensor) and plain gradients alike, also mixed: each group of
    gradients laid out alike is reduced with one collective."""
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite=False)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float().cpu())
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped.")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))
    return total


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The model's whole state as plain tensors, keyed like the unwrapped module, loadable
    into it with ``load_state_dict``. Every process must call it (it gathers); with
    ``rank0_only`` the other processes get an empty dict."""
    out: dict[str, torch.Tensor] = {}
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    with quiet_gathers():
        for key, value in model.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if keep:
                value = value.detach()
                out[key] = value.cpu() if cpu else value.clone()
    return out


@contextlib.contextmanager
def quiet_gathers():
    """Gathering a weight split over 'model' and, within that, over 'fsdp' (FSDP2's strided
    split) takes DTensor two all-gathers, and it logs a warning on every process that they
    cannot be merged. Gathering whole weights once (a save, an export) is not a hot path:
    the warning is held back here."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
    """Load whole (unsharded) tensors into a sharded model: the counterpart of
    ``full_state_dict``. Every process passes the same values (read from the same file);
    each keeps its own block, so nothing is communicated. A tied parameter may be given
    under either of its names. Returns the model's keys that got no value (an error with
    ``strict``)."""
    new: dict[str, torch.Tensor] = {}
    pairs, missing = match(model, model.state_dict(), state_dict, strict)
    for key, cur, src in pairs:
        local_device = cur.to_local().device if isinstance(cur, DTensor) else cur.device
        src = src.to(device=local_device, dtype=cur.dtype)
        if isinstance(cur, DTensor):
            src = distribute_tensor(src, cur.device_mesh, cur.placements, src_data_rank=None)
        new[key] = src
    model.load_state_dict(new, strict=False)
    return missing
