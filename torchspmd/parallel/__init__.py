"""Parallelism on the named mesh: FSDPv2, its auto-wrap policies and activation
checkpointing, data parallelism (``replicate``), and gradient clipping and full state
dicts over sharded parameters."""

from torchspmd.parallel.activation_checkpointing import checkpoint_module
from torchspmd.parallel.fsdpv2 import (
    FSDPv2,
    SpmdFullyShardedDataParallel,
    shard_in_place,
)
from torchspmd.parallel.pipeline import pipeline
from torchspmd.parallel.replicate import auto_path, replicate, set_auto_replicate
from torchspmd.parallel.state import (
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
)
from torchspmd.wrapping import (
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
    "replicate",
    "pipeline",
    "set_auto_replicate",
    "auto_path",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "recursive_wrap",
]
