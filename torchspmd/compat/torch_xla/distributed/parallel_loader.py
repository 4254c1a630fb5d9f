"""``torch_xla.distributed.parallel_loader`` under ``--xla-compat``: ``MpDeviceLoader``.

Under SPMD (after ``xr.use_spmd()``) it is torchspmd's: global batches in, global batches laid out
by ``input_sharding`` out. A program that never turns SPMD on (torch_xla's single-device
programs) gets what torch_xla gives it there: the loader's batches on this process's device.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from torchspmd import runtime
from torchspmd.compat import _device, xla_tensors
from torchspmd.compat.stand_ins import not_provided
from torchspmd.data import MpDeviceLoader as _SpmdLoader

__all__ = ["MpDeviceLoader"]


class _OnDevice:
    """The batches of ``loader`` with their tensors moved to this process's device."""

    def __init__(self, loader):
        self._loader = loader

    def __iter__(self):
        device = _device.native()
        for batch in self._loader:
            yield tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)

    def __len__(self) -> int:
        return len(self._loader)


class _AsDeviceData:
    """torchspmd's loader under SPMD, its unsharded tensors given as the program's ``'xla'``
    tensors that torch_xla's loader sends (``OnXlaDevice``, device data: ``{replicated}``)."""

    def __init__(self, loader):
        self._loader = loader

    def __iter__(self):
        def as_data(t):
            return xla_tensors.mark_device_data(xla_tensors.placed(None, t)) if isinstance(t, torch.Tensor) else t

        for batch in self._loader:
            yield tree_map(as_data, batch)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


_SpmdLoader.register(_AsDeviceData)


class MpDeviceLoader(_SpmdLoader):
    """torchspmd's ``MpDeviceLoader`` under SPMD; the batches on this process's device without it."""

    def __new__(cls, loader, device, **kwargs):
        if not runtime.is_spmd():
            return _OnDevice(loader)
        return _AsDeviceData(_SpmdLoader(loader, device, **kwargs))


__getattr__ = not_provided("torch_xla.distributed.parallel_loader")
