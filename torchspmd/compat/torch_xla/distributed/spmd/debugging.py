"""``torch_xla.distributed.spmd.debugging`` under ``--xla-compat``."""

from torchspmd.compat.names import not_provided
from torchspmd.sharding import visualize_sharding, visualize_tensor_sharding  # noqa: F401

__getattr__ = not_provided("torch_xla.distributed.spmd.debugging")
