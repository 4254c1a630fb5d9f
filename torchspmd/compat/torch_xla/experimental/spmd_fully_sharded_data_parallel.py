"""``torch_xla.experimental.spmd_fully_sharded_data_parallel`` under ``--xla-compat``:
FSDPv2 is torchspmd's (FSDP2 over the mesh's ``'fsdp'`` axis; the same arguments)."""

from torchspmd.compat.stand_ins import not_provided
from torchspmd.parallel.fsdpv2 import SpmdFullyShardedDataParallel  # noqa: F401

__getattr__ = not_provided("torch_xla.experimental.spmd_fully_sharded_data_parallel")
