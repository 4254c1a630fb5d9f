"""``torch_xla.experimental.spmd_fully_sharded_data_parallel`` under ``--xla-compat``:
FSDPv2 is torchspmd's (FSDP2 over the mesh's ``'fsdp'`` axis; the same arguments)."""

from torchspmd import SpmdFullyShardedDataParallel  # noqa: F401
from torchspmd.compat import not_provided

__getattr__ = not_provided("torch_xla.experimental.spmd_fully_sharded_data_parallel")
