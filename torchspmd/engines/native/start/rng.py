"""One random state for the program, and a stream of its own for each shard.

torch_xla runs one process, so a program has one random stream: a model built without a
seed is one model, and ``torch.randn`` data is one data set. Here each device is a
process, and each process's generator starts from its own nondeterministic seed.
``synchronize()`` (called by ``use_spmd()``) gives every process rank 0's state of
torch's CPU generator, of the current CUDA device's generator, of Python's ``random``
and of NumPy's global ``RandomState``: every process then draws what rank 0 draws.

Random operations on *sharded* values must not repeat one shard's numbers on the
others (a dropout mask drawn for rank 0's rows, reused for rank 1's). ``local_stream``
takes one number from the shared stream (so every process's shared state advances
alike) and, from it and the shard's index, seeds a stream for this shard alone while
the shard's random operations run.

Inside a tensor-parallel pair (FSDPv2 x 'model': from a column-parallel linear's output to
its row-parallel partner's input) each process along the split axis holds its own features
or heads of the same rows: ``enter_split_stream`` / ``exit_split_stream`` do the same there,
one level down (one number from the rows' stream, and the index along the split axis).
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from torchspmd import accelerators

# Distinct shards get seeds a large odd step apart (the golden-ratio increment of
# splitmix64), so that their streams are unrelated.
_STEP = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def _accelerator_index(device_type: str) -> int | None:
    """This process's device index of an accelerator's type (None for the CPU, or where absent)."""
    return accelerators.current_index(device_type)


def synchronize(device_type: str) -> None:
    """Give every process of the default group rank 0's random state (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    state = [None]
    if dist.get_rank() == 0:
        state[0] = {
            "torch": torch.get_rng_state(),
            "device": accelerators.rng_state(device_type),  # the accelerator's generator (None on the CPU)
            "random": random.getstate(),
            "numpy": np.random.get_state(),
        }
    dist.broadcast_object_list(state, src=0)
    s = state[0]
    torch.set_rng_state(s["torch"])
    if s["device"] is not None:
        accelerators.set_rng_state(device_type, s["device"])  # this process's device (use_spmd set it)
    random.setstate(s["random"])
    np.random.set_state(s["numpy"])


def shard_seed(index: int) -> int:
    """A seed for shard ``index``, from one draw of the shared stream."""
    base = int(torch.empty((), dtype=torch.int64).random_())
    return (base + _STEP * (index + 1)) & _MASK


@contextlib.contextmanager
def local_stream(index: int, device_type: str = "cpu") -> Iterator[None]:
    """Run the block with a random stream of its own for shard ``index`` (the same on the
    processes that hold the same shard), leaving the shared stream as one draw advanced it."""
    seed = shard_seed(index)
    index = _accelerator_index(device_type)
    with torch.random.fork_rng(devices=[index] if index is not None else [],
                               device_type=device_type if index is not None else accelerators.CPU):
        torch.default_generator.manual_seed(seed)
        if index is not None:
            accelerators.manual_seed(device_type, seed)
        yield


def shard_index(coordinate: list[int], sizes: list[int], dims: list[int]) -> int:
    """The index of this process's shard along mesh ``dims`` (row-major over them)."""
    index = 0
    for d in dims:
        index = index * sizes[d] + coordinate[d]
    return index


_SPLIT = threading.local()


def enter_split_stream(index: int, device_type: str = "cpu", key: object = None) -> None:
    """From here to :func:`exit_split_stream`, random operations draw from a stream of
    split ``index`` alone (one number from the current stream, so the processes holding the
    same rows advance it alike). ``key`` names the pair: entering again for the same pair
    does nothing (a pair's q, k and v each enter); a split stream of another pair still open
    (its partner never ran, or a checkpointed recomputation stopped before it) is closed
    first (:func:`close_split_stream`)."""
    if getattr(_SPLIT, "saved", None) is not None:
        if _SPLIT.key == key:
            return
        close_split_stream()
    seed = shard_seed(index)
    index = _accelerator_index(device_type)
    _SPLIT.saved = (torch.get_rng_state(), device_type, index,
                    accelerators.rng_state(device_type, index) if index is not None else None)
    _SPLIT.key = key
    torch.default_generator.manual_seed(seed)
    if index is not None:
        accelerators.manual_seed(device_type, seed)


def exit_split_stream(key: object = None) -> None:
    """Back to the stream :func:`enter_split_stream` left, as its one draw left it (nothing
    when not in a split stream, or, given ``key``, in another pair's)."""
    saved = getattr(_SPLIT, "saved", None)
    if saved is None or (key is not None and _SPLIT.key != key):
        return
    _SPLIT.saved = _SPLIT.key = None
    torch.set_rng_state(saved[0])
    if saved[2] is not None:
        accelerators.set_rng_state(saved[1], saved[3], saved[2])


def close_split_stream() -> None:
    """End a split stream left open. In a forward: back to the stream it left (as
    :func:`exit_split_stream`). In backward (autograd running: a checkpointed module's
    recomputation, which ``torch.utils.checkpoint`` stops once it has what backward needs,
    maybe before a pair's partner ran): forgotten, not restored — the random state it saved
    is another recomputation's, and ``torch.utils.checkpoint`` sets and restores the state
    around each recomputation itself."""
    if getattr(_SPLIT, "saved", None) is None:
        return
    if torch._C._current_graph_task_id() != -1:
        _SPLIT.saved = _SPLIT.key = None
    else:
        exit_split_stream()


def discard_split_stream() -> None:
    """Forget a split stream left open by a recomputation in an earlier backward (on the
    CPU backward runs on this thread): a root forward, or the outermost recomputation of a
    checkpointed module, starts from the random state as it is."""
    _SPLIT.saved = _SPLIT.key = None


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Around a checkpointed module's forward: when it is the outermost one recomputed in
    backward, a split stream still open is another recomputation's (stopped early) and is
    forgotten first. In a forward, and nested, nothing changes (a module between a pair's
    linears draws from the pair's split stream, in its forward as in its recomputation)."""
    depth = getattr(_SPLIT, "depth", 0)
    if depth == 0 and torch._C._current_graph_task_id() != -1:
        discard_split_stream()
    _SPLIT.depth = depth + 1
    try:
        yield
    finally:
        _SPLIT.depth = depth
