"""``torch_xla.experimental`` under ``--xla-compat``."""

from torchspmd.compat.stand_ins import not_provided

__getattr__ = not_provided("torch_xla.experimental")
