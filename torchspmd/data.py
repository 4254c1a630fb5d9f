"""``MpDeviceLoader`` and ``shard_batch``: global batches, split over the data axes.

The wrapped loader describes the *global* batch (``batch_size`` is the global batch size).
On the native engine each process loads only the rows it holds under ``input_sharding``,
moves them to its device (for a GPU, ahead, in a background thread; on the CPU at
``next()``), and yields DTensors of the global shape;
on the torch_xla engine this is torch_xla's ``MpDeviceLoader``.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from torchspmd import engines, runtime
from torchspmd.errors import SpmdError
from torchspmd.sharding import ShardingSpec

__all__ = ["MpDeviceLoader", "shard_batch"]


def _specs(input_sharding) -> list:
    if isinstance(input_sharding, dict):
        return list(input_sharding.values())
    return [] if input_sharding is None else [input_sharding]


def _check_input_sharding(input_sharding, api: str, required: bool) -> None:
    if required and (input_sharding is None or (isinstance(input_sharding, dict)
                                                 and any(v is None for v in input_sharding.values()))):
        raise SpmdError(f"{api}(input_sharding=...): give a ShardingSpec, or a dict of them (no None values)")
    if input_sharding is not None and not isinstance(input_sharding, (ShardingSpec, dict)):
        raise SpmdError(f"{api}(input_sharding=...): expected a ShardingSpec, a dict of them, or None; got "
                        f"{type(input_sharding).__name__}")
    for s in _specs(input_sharding):
        if s is not None and not isinstance(s, ShardingSpec):
            raise SpmdError(f"{api}(input_sharding=...): expected a ShardingSpec or a dict of them, got "
                            f"{type(s).__name__}")


class MpDeviceLoader(abc.ABC):
    """Wrap a loader of global batches; iterate to get sharded global batches (torch_xla's
    ``MpDeviceLoader`` on the torch_xla engine, given the same arguments).

    Args:
        loader: yields global batches (tensors, or tuples/lists/dicts of them). A
            ``torch.utils.data.DataLoader`` over a map-style dataset is read per process:
            each process fetches only its rows. Any other iterable is read whole by
            every process, which keeps its block.
        device: where the local blocks go (``torchspmd.device()``).
        input_sharding: a ``ShardingSpec`` for every tensor, or a dict of them keyed like
            the batch's dict (every key needs one). ``None``: the batch is replicated. A
            tensor whose rank does not fit the spec is split on its batch dim like the
            others (same global value, rows kept where they are used).
        loader_prefetch_size, device_prefetch_size: batches read ahead / kept ready. On the
            native engine only ``device_prefetch_size`` is used (the batches the background
            thread of a device other than the CPU keeps ready; on the CPU batches are read at
            ``next()``); ``loader_prefetch_size`` goes to torch_xla's loader on the torch_xla
            engine; ``host_to_device_transfer_threads`` is accepted for torch_xla's signature
            and used by neither engine.
        batchdim: the batch dim of the loader's tensors (per-process reading needs 0).
        fixed_batch_size: stop at the first batch whose size differs from the first one
            (drops an odd last batch).

    The object built is the engine's loader (``isinstance(loader, MpDeviceLoader)`` holds).
    """

    def __new__(cls, loader, device, *, input_sharding: ShardingSpec | dict | None = None,
                loader_prefetch_size: int = 8, device_prefetch_size: int = 4, batchdim: int = 0,
                fixed_batch_size: bool = False, host_to_device_transfer_threads: int = 1):
        engine = engines.current("MpDeviceLoader")
        _check_input_sharding(input_sharding, "MpDeviceLoader", required=False)
        if type(batchdim) is not int:
            raise SpmdError(f"MpDeviceLoader(batchdim={batchdim!r}): give the batch dim as an int (0: the first)")
        return engine.loader(loader, device, input_sharding, loader_prefetch_size=loader_prefetch_size,
                             device_prefetch_size=device_prefetch_size, batchdim=batchdim,
                             fixed_batch_size=fixed_batch_size,
                             host_to_device_transfer_threads=host_to_device_transfer_threads)


engines.counts_as(MpDeviceLoader, "MpDeviceLoader")


def shard_batch(batch: Any, input_sharding: ShardingSpec | dict, device=None) -> Any:
    """A whole global batch that every process holds alike (read and collated by each),
    as global tensors laid out by ``input_sharding`` (as ``MpDeviceLoader``'s): each
    process keeps its own block. Nothing is communicated. For collators whose output
    depends on the whole batch (padding to its longest row), where each process cannot
    collate only its rows."""
    engine = engines.current("shard_batch")
    _check_input_sharding(input_sharding, "shard_batch", required=True)
    if any(getattr(s, "minibatch", False) for s in _specs(input_sharding)):
        raise SpmdError("shard_batch(input_sharding=...): minibatch=True specs describe per-process parts; "
                        "shard_batch takes the whole batch")
    return engine.shard_batch(batch, input_sharding, torch.device(device) if device is not None else runtime.device())
