"""``checkpoint_module``: activation checkpointing of one module's forward."""

from __future__ import annotations

import functools

import torch.nn as nn
import torch.utils.checkpoint

from torchspmd import _rng
from torchspmd._delegate import on_xla
from torchspmd._errors import SpmdError

_CLASSES: dict[type, type] = {}


def _run_forward(module: nn.Module, cls: type, *args, **kwargs):
    """The checkpointed module's own forward (run in forward, and again in backward). Its
    outermost recomputation forgets a tensor-parallel pair's random stream left open by the
    recomputation of another module (stopped once backward had what it needs, maybe before
    the pair's partner ran): ``_rng.recomputing``."""
    with _rng.recomputing():
        return super(cls, module).forward(*args, **kwargs)


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:

        def forward(self, *args, **kwargs):
            return torch.utils.checkpoint.checkpoint(
                functools.partial(_run_forward, self, new_cls), *args, use_reentrant=False, **kwargs
            )

        new_cls = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_torchspmd_checkpointed": True})
        _CLASSES[cls] = new_cls
    return _CLASSES[cls]


@on_xla
def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s activations in backward instead of keeping them
    (non-reentrant ``torch.utils.checkpoint``). Apply it before ``FSDPv2``:
    ``FSDPv2(checkpoint_module(layer))``. Returns the same module."""
    from torch.distributed.fsdp import FSDPModule

    from torchspmd.fsdp.fsdpv2 import SpmdFullyShardedDataParallel

    if isinstance(module, (SpmdFullyShardedDataParallel, FSDPModule)):
        raise SpmdError(
            "checkpoint_module: the module is already wrapped by FSDPv2; apply checkpoint_module before FSDPv2, to the "
            "module first and wrap the result: FSDPv2(checkpoint_module(module), ...)"
        )
    if not isinstance(module, nn.Module):
        raise SpmdError(f"checkpoint_module: expected an nn.Module, got {type(module).__name__}")
    if getattr(type(module), "forward", None) is nn.Module.forward:
        raise SpmdError(
            f"checkpoint_module: {type(module).__name__} has no forward of its own (a container is never called, so "
            f"nothing would be recomputed); apply checkpoint_module to each layer inside it"
        )
    if getattr(module, "_torchspmd_checkpointed", False):
        return module
    module.__class__ = _checkpointed_class(type(module))
    return module
