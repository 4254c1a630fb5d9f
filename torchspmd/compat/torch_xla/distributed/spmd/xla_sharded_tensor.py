"""``torch_xla.distributed.spmd.xla_sharded_tensor`` under ``--xla-compat``: ``XLAShardedTensor``,
the type of a sharded tensor, and ``XLAShard``.

On the native engine a sharded tensor is a DTensor, and a DTensor is an ``XLAShardedTensor``
(``isinstance(t, XLAShardedTensor)`` holds for what ``xs.mark_sharding`` returns and for a
parameter annotated in place): it answers torch_xla's attributes (``global_tensor``,
``local_shards``, ``sharding_spec``, ``sharding_type``, ``load_local_shards_``). The class is not
constructed directly: ``xs.mark_sharding`` makes one."""

from __future__ import annotations

import abc

from torch.distributed.tensor import DTensor

from torchspmd.compat.names import NotProvidedError, message
from torchspmd.compat.stand_ins import not_provided
from torchspmd.xla_shards import XLAShard  # noqa: F401

__all__ = ["XLAShardedTensor", "XLAShard"]


class XLAShardedTensor(abc.ABC):
    """A sharded tensor: every DTensor is one. Made by ``xs.mark_sharding``, not constructed."""

    def __new__(cls, *args, **kwargs):
        raise NotProvidedError(message("torch_xla.distributed.spmd.XLAShardedTensor(...)"))


XLAShardedTensor.register(DTensor)

__getattr__ = not_provided("torch_xla.distributed.spmd.xla_sharded_tensor")
