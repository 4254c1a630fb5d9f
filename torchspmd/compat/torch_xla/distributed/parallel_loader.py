"""``torch_xla.distributed.parallel_loader`` under ``--xla-compat``: ``MpDeviceLoader``
(torchspmd's: global batches in, sharded global batches out)."""

from torchspmd.compat.stand_ins import not_provided
from torchspmd.data import MpDeviceLoader  # noqa: F401

__getattr__ = not_provided("torch_xla.distributed.parallel_loader")
