"""Which modules hold a parameter or buffer: what makes ``mark_sharding`` work in place.

torch_xla annotates a tensor in place: ``xs.mark_sharding(model.fc1.weight, mesh, spec)``
shards the module's weight even when the result is not used. A torch tensor cannot turn
into a DTensor in place, so ``mark_sharding`` puts the sharded parameter in every module
slot that held the old one. The slots are recorded as they are filled, through
``nn.Module``'s global registration hooks (``torchspmd.patches.torch``, applied when the
native engine starts); a tensor registered before that is found by asking the garbage collector who refers to it.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

from torchspmd.patches import torch as torch_patches

# id(tensor) -> [(weakref to module, slot name, "_parameters"|"_buffers")]. No reference to the
# tensor itself, not even a weak one: torch.utils.swap_tensors (which Module._apply uses for
# DTensor parameters: model.cpu(), model.to(device)) refuses a tensor with a weakref. A slot
# counts only while the module still holds that very tensor there, so an id reused by a new
# tensor finds nothing it should not; entries whose modules are gone are pruned as they pile up.
_SLOTS: dict[int, list[tuple[weakref.ref, str, str]]] = {}
_PRUNE_EVERY = 4096
_records = 0


def _record(module: nn.Module, name: str, t, kind: str) -> None:
    global _records
    if t is None:
        return
    _SLOTS.setdefault(id(t), []).append((weakref.ref(module), name, kind))
    _records += 1
    if _records % _PRUNE_EVERY == 0:
        _prune()


def _prune() -> None:
    for tid in list(_SLOTS):
        alive = [(ref, name, kind) for ref, name, kind in _SLOTS[tid] if ref() is not None]
        if alive:
            _SLOTS[tid] = alive
        else:
            del _SLOTS[tid]


def install() -> None:
    """Record parameter and buffer registrations from now on (the engine's start does it)."""
    torch_patches.record_registrations(lambda m, n, p: _record(m, n, p, "_parameters"),
                                       lambda m, n, b: _record(m, n, b, "_buffers"))


def live_slots(t: torch.Tensor) -> list[tuple[nn.Module, str, str]]:
    found = []
    for ref, name, kind in _SLOTS.get(id(t), ()):
        m = ref()
        if m is not None and getattr(m, kind).get(name) is t and (m, name, kind) not in found:
            found.append((m, name, kind))
    return found


def _slots_from_gc(t: torch.Tensor) -> list[tuple[nn.Module, str, str]]:
    """Slots of a tensor registered before the hooks were installed."""
    found = []
    for d in gc.get_referrers(t):
        if not isinstance(d, dict):
            continue
        for owner in gc.get_referrers(d):
            if isinstance(owner, nn.Module):
                for kind in ("_parameters", "_buffers"):
                    if owner.__dict__.get(kind) is d:
                        found.extend((owner, n, kind) for n, v in d.items() if v is t)
    return found


def slots(t: torch.Tensor) -> list[tuple[nn.Module, str, str]]:
    """Every (module, name, kind) slot holding ``t`` now. Only a parameter is looked for
    through the garbage collector (a batch tensor is marked on every step: it must cost
    nothing)."""
    found = live_slots(t)
    if not found and isinstance(t, nn.Parameter):
        found = _slots_from_gc(t)
    return found


def replace(old: torch.Tensor, new: torch.Tensor) -> int:
    """Put ``new`` in every module slot holding ``old``; returns how many were replaced."""
    held = slots(old)
    for m, name, kind in held:
        getattr(m, kind)[name] = new
        _record(m, name, new, kind)
    return len(held)
