"""``torch_xla.distributed.fsdp`` under ``--xla-compat``: ``checkpoint_module`` and the
wrap policies (``.wrap``). torch_xla's FSDPv1 (``XlaFullyShardedDataParallel``) is not
provided: FSDPv2 is ``torch_xla.experimental.spmd_fully_sharded_data_parallel``."""

from torchspmd.compat.stand_ins import not_provided
from torchspmd.compat.torch_xla.distributed.fsdp import wrap  # noqa: F401
from torchspmd.parallel.activation_checkpointing import checkpoint_module  # noqa: F401

__getattr__ = not_provided("torch_xla.distributed.fsdp")
