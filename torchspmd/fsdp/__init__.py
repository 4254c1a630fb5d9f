"""FSDPv2: fully sharded data parallelism on the named mesh, on PyTorch FSDP2."""

from torchspmd.fsdp.checkpoint import checkpoint_module
from torchspmd.fsdp.fsdpv2 import FSDPv2, SpmdFullyShardedDataParallel, shard_in_place
from torchspmd.fsdp.utils import clip_grad_norm_, full_state_dict, load_full_state_dict
from torchspmd.fsdp.wrap import (
    always_wrap_policy,
    lambda_auto_wrap_policy,
    recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [
    "SpmdFullyShardedDataParallel",
    "FSDPv2",
    "shard_in_place",
    "checkpoint_module",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "recursive_wrap",
]
