"""``torch_xla.distributed.parallel_loader`` under ``--xla-compat``: ``MpDeviceLoader``
(torchspmd's: global batches in, sharded global batches out)."""

from torchspmd import MpDeviceLoader  # noqa: F401
from torchspmd.compat import not_provided

__getattr__ = not_provided("torch_xla.distributed.parallel_loader")
