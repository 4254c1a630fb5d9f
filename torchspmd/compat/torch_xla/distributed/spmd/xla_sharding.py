"""``torch_xla.distributed.spmd.xla_sharding`` (where torch_xla defines ``xs``'s names) under
``--xla-compat``: the same names as ``torch_xla.distributed.spmd``."""

from torchspmd.compat.names import not_provided
from torchspmd.compat.torch_xla.distributed.spmd import *  # noqa: F401,F403

__getattr__ = not_provided("torch_xla.distributed.spmd.xla_sharding")
