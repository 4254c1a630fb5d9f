"""``torch_xla.core`` under ``--xla-compat``."""

from torchspmd.compat.stand_ins import not_provided

__getattr__ = not_provided("torch_xla.core")
