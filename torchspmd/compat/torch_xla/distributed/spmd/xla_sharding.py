"""``torch_xla.distributed.spmd.xla_sharding`` (where torch_xla defines ``xs``'s names) under
``--xla-compat``: the same names as ``torch_xla.distributed.spmd``, ``MarkShardingFunction`` and
``wrap_as_sharded_tensor``."""

import torch

from torchspmd.compat.names import NotProvidedError, message
from torchspmd.compat.stand_ins import not_provided
from torchspmd.compat.torch_xla.distributed.spmd import *  # noqa: F401,F403
from torchspmd.compat.torch_xla.distributed.spmd.xla_sharded_tensor import XLAShardedTensor
from torchspmd.sharding import mark_sharding_with_gradients


class MarkShardingFunction(torch.autograd.Function):
    """torch_xla's autograd function: ``MarkShardingFunction.apply(t, mesh, partition_spec)`` is a
    new tensor with ``t``'s value sharded as ``partition_spec``, whose gradient is sharded the
    same way; ``t`` is not changed. It is ``xs.mark_sharding_with_gradients``, which torch_xla
    defines with it."""

    @classmethod
    def apply(cls, torch_tensor, mesh, partition_spec):
        return mark_sharding_with_gradients(torch_tensor, mesh, partition_spec)

    @staticmethod
    def forward(ctx, *args):
        raise NotProvidedError(message("torch_xla.distributed.spmd.xla_sharding.MarkShardingFunction.forward"))

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotProvidedError(message("torch_xla.distributed.spmd.xla_sharding.MarkShardingFunction.backward"))


def wrap_as_sharded_tensor(t, mesh_shape=None, partition_spec=None):
    """A sharded tensor as an ``XLAShardedTensor``: a DTensor is one already and is returned as it
    is (its mesh and spec are its own; to re-lay it out, ``mark_sharding`` it). A plain tensor
    has no sharding to wrap: ``NotProvidedError`` (torch_xla would make an ``XLAShardedTensor``
    of it); use ``mark_sharding``."""
    if isinstance(t, XLAShardedTensor):
        return t
    return XLAShardedTensor(t)


__getattr__ = not_provided("torch_xla.distributed.spmd.xla_sharding")
