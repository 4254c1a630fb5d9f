"""``checkpoint_module``: activation checkpointing of one module's forward."""

from __future__ import annotations

import torch.nn as nn

from torchspmd import engines
from torchspmd.errors import SpmdError
from torchspmd.parallel.fsdpv2 import SpmdFullyShardedDataParallel

__all__ = ["checkpoint_module"]


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s activations in backward instead of keeping them
    (non-reentrant ``torch.utils.checkpoint``; torch_xla's ``checkpoint_module`` on its
    engine). Apply it before ``FSDPv2``: ``FSDPv2(checkpoint_module(layer))``. Returns the
    module (the same module on the native engine)."""
    engine = engines.current("checkpoint_module")
    if isinstance(module, SpmdFullyShardedDataParallel) or engine.is_fully_sharded(module):
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
    return engine.checkpoint_module(module)
