"""``optimum.tpu`` under ``--xla-compat``: ``fsdp_v2``."""

from torchspmd.compat.names import not_provided
from torchspmd.compat.optimum_tpu import fsdp_v2  # noqa: F401

__getattr__ = not_provided("optimum.tpu")
