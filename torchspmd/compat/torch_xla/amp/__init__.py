"""``torch_xla.amp`` under ``--xla-compat``: ``autocast`` is ``torch.autocast`` on this
process's device (bfloat16 unless a dtype is given, as torch_xla's on TPU)."""

from __future__ import annotations

import torch

from torchspmd.compat import _device
from torchspmd.compat.stand_ins import not_provided


def autocast(device=None, enabled: bool = True, dtype: torch.dtype | None = None, cache_enabled=None):

    kwargs = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    return torch.amp.autocast(_device.native().type, enabled=enabled, dtype=dtype or torch.bfloat16, **kwargs)


__getattr__ = not_provided("torch_xla.amp")
