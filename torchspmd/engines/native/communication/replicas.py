"""Replicated values that agree on every process.

A replicated parameter is one value: every process must hold the same bits. ``agree``
checks that cheaply (a 62-bit digest of each tensor's bytes, compared with one small
all-reduce) and, where some process differs, copies rank 0's value to every process, as
DDP does at construction. Programs that build their model after ``use_spmd()`` (one
random state everywhere) pass the check without copying anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from torchspmd import accelerators
from torchspmd.engines.native.communication import cpu_shortcuts

_CHUNK = 1 << 20  # bytes digested at a time (bounds the temporary memory: about 16 MB)
_PRIME = 1_000_003


def digest(t: torch.Tensor) -> int:
    """A 62-bit digest of the tensor's bytes (its bits: NaNs and signed zeros count as
    theirs), the same on every process for the same bytes on the same kind of device.

    A CPU tensor's bytes are hashed in place with SHA-256 (no copy; 7x the throughput of the
    kernel form below on a core with SHA instructions: bench/startup.py). Other devices get a
    position-weighted sum of the bytes computed there (exact integer arithmetic), so the
    tensor does not travel to the host."""
    data = t.detach().contiguous().reshape(-1)
    if data.numel() == 0:
        return 0
    raw = data.resolve_conj().resolve_neg().view(torch.uint8)
    if raw.device.type == accelerators.CPU and cpu_shortcuts.allowed():
        # read through a ctypes view of the bytes: ``numpy()`` would mark the storage as not
        # resizable, and FSDP2 frees a gathered parameter's storage by resizing it
        view = (ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())
        return int.from_bytes(hashlib.sha256(view).digest()[:8], "little") >> 2
    return _weighted_byte_sum(raw) % (1 << 62)


def _weighted_byte_sum(raw: torch.Tensor) -> int:
    """Sum of byte ``i`` times ``i % _PRIME + 1`` over the 1-D uint8 tensor ``raw``, computed
    where it lives, in chunks of :data:`_CHUNK`."""
    total = 0
    for start in range(0, raw.numel(), _CHUNK):
        part = raw[start:start + _CHUNK].to(torch.int32)  # products stay below 2**31: 255 * _PRIME
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device) % _PRIME + 1
        total += int((part * weights.to(torch.int32)).sum(dtype=torch.int64))
    return total


def _group_root(group) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def agree(tensors: Sequence[torch.Tensor], group=None) -> list[int]:
    """Make ``tensors`` (the same list on every process of ``group``) equal to the group's
    first rank's values; return the indices of those that differed somewhere. A collective:
    every process of the group must call it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not tensors:
        return []
    tensors = [t for t in tensors]
    device = tensors[0].device if tensors[0].device.type != "meta" else torch.device("cpu")
    backend = str(dist.get_backend(group))
    accelerator = accelerators.current()
    if device.type == accelerators.CPU and accelerator is not None and "gloo" not in backend:
        # a group of the accelerator's backend alone (no gloo for CPU tensors): the digests go on the device
        device = accelerators.device_of(accelerator, accelerators.current_index(accelerator))
    values = torch.tensor([digest(t) for t in tensors], dtype=torch.int64)
    both = torch.cat([values, -values]).to(device)  # max and -min in one reduction
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    both = both.cpu()
    n = len(tensors)
    differ = [i for i in range(n) if int(both[i]) != -int(both[n + i])]
    root = _group_root(group)
    for i in differ:
        t = tensors[i]
        with torch.no_grad():
            buf = t.detach().clone()
            dist.broadcast(buf, src=root, group=group)
            if dist.get_rank() != root:
                t.detach().copy_(buf)
    return differ


# Tensors already checked (each is checked once: at its first use as a replicated value),
# by id, with a weak reference telling a live tensor from a new one at a reused id.
_AGREED: dict[int, weakref.ref] = {}


def agreed(t: torch.Tensor) -> bool:
    if _TRUSTED[0]:
        return True
    ref = _AGREED.get(id(t))
    return ref is not None and ref() is t


_TRUSTED = [0]  # > 0: inside trusted(): every plain tensor counts as checked


@contextlib.contextmanager
def trusted():
    """A region whose plain tensors agree by construction (a pipeline stage's inputs, sent
    by identical senders, and its parameters, checked when the stage was made): nothing in
    it is checked over every process, which would wait for processes running other stages."""
    _TRUSTED[0] += 1
    try:
        yield
    finally:
        _TRUSTED[0] -= 1


def agree_once(tensors: Sequence[torch.Tensor], group=None) -> list[int]:
    """``agree`` on those of ``tensors`` not checked before (plain, non-meta ones), over
    ``group`` (default: every process): afterwards they count as checked."""
    todo = [t for t in tensors if t.device.type != "meta" and not agreed(t)]
    fixed = agree(todo, group)
    for t in todo:
        _AGREED[id(t)] = weakref.ref(t, lambda _, key=id(t): _AGREED.pop(key, None))
    return fixed
