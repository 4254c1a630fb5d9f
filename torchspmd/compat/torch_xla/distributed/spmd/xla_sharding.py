"""``torch_xla.distributed.spmd.xla_sharding`` (where torch_xla defines ``xs``'s names) under
``--xla-compat``: the same names as ``torch_xla.distributed.spmd``, ``MarkShardingFunction``,
``wrap_as_sharded_tensor`` and the einsum linear (``XLAPatchedLinear``, ``EinsumLinear``,
``apply_xla_patch_to_nn_linear``), which is PyTorch's linear here."""

import torch

from torchspmd.compat.names import NotProvidedError, message
from torchspmd.compat.stand_ins import not_provided
from torchspmd.compat.torch_xla.distributed.spmd import *  # noqa: F401,F403
from torchspmd.compat.torch_xla.distributed.spmd.xla_sharded_tensor import wrap_as_sharded_tensor  # noqa: F401
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


class XLAPatchedLinear(torch.autograd.Function):
    """torch_xla's linear through ``einsum`` (so that XLA's sharding propagation keeps the batch
    dims apart): ``XLAPatchedLinear.apply(input, weight, bias=None)`` is
    ``torch.nn.functional.linear``, the same function, whose DTensor rules keep the layouts."""

    @classmethod
    def apply(cls, input, weight, bias=None):
        return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    def forward(ctx, *args):
        raise NotProvidedError(message("torch_xla.distributed.spmd.xla_sharding.XLAPatchedLinear.forward"))

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotProvidedError(message("torch_xla.distributed.spmd.xla_sharding.XLAPatchedLinear.backward"))


def xla_patched_nn_linear_forward(m, input):
    return XLAPatchedLinear.apply(input, m.weight, m.bias)


class EinsumLinear(torch.nn.Linear):
    """torch_xla's ``nn.Linear`` whose forward is ``XLAPatchedLinear``."""

    def forward(self, input):
        return xla_patched_nn_linear_forward(self, input)


def apply_xla_patch_to_nn_linear(module: torch.nn.Module) -> torch.nn.Module:
    """torch_xla's: every ``nn.Linear`` under ``module`` replaced with an ``EinsumLinear``
    holding its parameters (as tensors assigned from its state dict, as in torch_xla)."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear) and not isinstance(child, EinsumLinear):
            with torch.device("meta"):
                einsum_linear = EinsumLinear(child.in_features, child.out_features, bias=child.bias is not None)
            einsum_linear.load_state_dict(child.state_dict(), strict=True, assign=True)
            setattr(module, name, einsum_linear)
        else:
            apply_xla_patch_to_nn_linear(child)
    return module


__getattr__ = not_provided("torch_xla.distributed.spmd.xla_sharding")
