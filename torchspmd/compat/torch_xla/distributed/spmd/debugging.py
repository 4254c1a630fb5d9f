"""``torch_xla.distributed.spmd.debugging`` under ``--xla-compat``."""

from torchspmd import visualize_sharding, visualize_tensor_sharding  # noqa: F401
from torchspmd.compat import not_provided

__getattr__ = not_provided("torch_xla.distributed.spmd.debugging")
