"""``optimum.tpu`` under ``--xla-compat``: ``fsdp_v2``."""

from torchspmd.compat.optimum_tpu import fsdp_v2  # noqa: F401
from torchspmd.compat.stand_ins import not_provided

__getattr__ = not_provided("optimum.tpu")
