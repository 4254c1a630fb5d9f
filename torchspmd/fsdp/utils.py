"""Gradient clipping and full state dicts over sharded (and plain) parameters."""

from __future__ import annotations

import contextlib
import logging

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchspmd._delegate import on_xla
from torchspmd._errors import SpmdError

__all__ = ["clip_grad_norm_", "full_state_dict", "load_full_state_dict"]


def _params(model_or_params) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        return [model_or_params]
    return list(model_or_params)


@on_xla
@torch.no_grad()
def clip_grad_norm_(model_or_params: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``max_norm``; return the
    global norm (a plain tensor, the same on every process) before clipping.

    Works on sharded (DTensor) and plain gradients alike, also mixed: each group of
    gradients laid out alike is reduced with one collective."""
    grads = [p.grad for p in _params(model_or_params) if p.grad is not None]
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


@on_xla
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


def _aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters: each extra name of a shared parameter -> its first name."""
    from torchspmd.fsdp.fsdpv2 import _clean

    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = _clean(name)
        if id(p) in first and first[id(p)] != name:
            out[name] = first[id(p)]
        else:
            first.setdefault(id(p), name)
    return out


@on_xla
@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
    """Load whole (unsharded) tensors into a sharded model: the counterpart of
    ``full_state_dict``. Every process passes the same values (read from the same file);
    each keeps its own block, so nothing is communicated. A tied parameter may be given
    under either of its names. Returns the model's keys that got no value (an error with
    ``strict``)."""
    new: dict[str, torch.Tensor] = {}
    pairs, missing = _match(model, model.state_dict(), state_dict, strict)
    for key, cur, src in pairs:
        local_device = cur.to_local().device if isinstance(cur, DTensor) else cur.device
        src = src.to(device=local_device, dtype=cur.dtype)
        if isinstance(cur, DTensor):
            src = distribute_tensor(src, cur.device_mesh, cur.placements, src_data_rank=None)
        new[key] = src
    model.load_state_dict(new, strict=False)
    return missing


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """When the state dict's names are the model's with a prefix added or taken away
    (``module.``, ``_orig_mod.``, ``model.``), say which."""
    for extra, short, verb in ((unexpected, missing, "strip the prefix {!r} from"),
                               (missing, unexpected, "add the prefix {!r} to")):
        prefixes = {long[: -len(k)] for long in extra for k in short if long.endswith("." + k)}
        if len(prefixes) == 1:
            prefix, known = prefixes.pop(), set(short)
            renamed = sum(long.startswith(prefix) and long[len(prefix):] in known for long in extra)
            if renamed == min(len(extra), len(short)):
                return "the names differ by a prefix: " + verb.format(prefix) + " the state dict's keys"
    return ""


def _match(model: nn.Module, current: dict, state_dict: dict, strict: bool):
    """Pair each of the model's entries with its value in ``state_dict`` (a tied parameter
    under any of its names): ``[(key, current, value)]`` and the keys without one. Values
    must be tensors of the model's shapes; with ``strict`` no key may be missing or left
    over. Nothing is loaded when a check fails; each error names every key at fault."""
    aliases = _aliases(model)
    pairs, missing, wrong = [], [], []
    for key, cur in current.items():
        names = [key, aliases.get(key)] + [other for other, first in aliases.items() if first == key]
        name = next((n for n in names if n is not None and n in state_dict), None)
        if name is None:
            missing.append(key)
            continue
        src = state_dict[name]
        if not isinstance(src, torch.Tensor):
            raise SpmdError(f"load_full_state_dict: the value of {name!r} is a {type(src).__name__}, not a tensor; "
                            f"give tensors (torch.as_tensor(value))")
        if tuple(src.shape) != tuple(cur.shape):
            wrong.append(f"{name!r} has shape {tuple(src.shape)} in the state dict and {tuple(cur.shape)} in the model")
        pairs.append((key, cur, src))
    if wrong:
        raise SpmdError(f"load_full_state_dict: {', '.join(wrong)}; the state dict comes from a model of another "
                        f"shape: build the model with the same configuration")
    unexpected = sorted(set(state_dict) - set(current) - set(aliases)) if strict else []
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"the state dict has no value for {len(missing)} of the model's keys: {_names(missing)}")
        if unexpected:
            parts.append(f"{'and it' if missing else 'the state dict'} has {len(unexpected)} keys the model lacks: "
                         f"{_names(unexpected)}")
        if missing and unexpected:
            fix = _prefix_hint(missing, unexpected) or (
                "pass strict=False to keep the model's own values for the first and ignore the others")
        elif missing:
            fix = "pass strict=False to keep the model's own values for them"
        else:
            fix = "pass strict=False to ignore them"
        raise SpmdError(f"load_full_state_dict: {'; '.join(parts)}; {fix}")
    return pairs, missing
