"""``torch_xla._XLAC`` (torch_xla's C++ bindings) under ``--xla-compat``: ``_get_xla_sharding_spec`` and
``_get_xla_sharding_type`` (what torch_xla's ``XLAShardedTensor.sharding_spec`` and ``.sharding_type`` read).
Its other names are stand-ins that raise ``NotProvidedError`` when called: they reach into
XLA's runtime, compiler and IR, which the native engine does not have."""

from __future__ import annotations

from torchspmd import engines, runtime
from torchspmd.layouts import hlo
from torchspmd.compat import xla_tensors
from torchspmd.compat.stand_ins import not_provided
from torchspmd.layouts.xla_shards import ShardingType


def _get_xla_sharding_spec(t) -> str:
    """The HLO sharding text of ``t``'s layout as torch_xla prints it (``{devices=[4,1]0,1,2,3}``,
    ``{replicated}``; ``''`` for a tensor without sharding). As in torch_xla under SPMD, an
    unannotated tensor that is device data (sent by the loader, or put on the device before
    the last ``sync``) is ``{replicated}``: whole on every device."""
    if runtime.is_spmd() and xla_tensors.is_device_data(t):
        return hlo.REPLICATED
    return engines.planned().sharding_string(t)


def _get_xla_sharding_type(t) -> ShardingType | None:
    """The ``ShardingType`` of ``t``'s layout, None for a tensor without sharding (as its text is
    ``''``); unannotated device data is ``REPLICATED``, as its text is ``{replicated}``."""
    if runtime.is_spmd() and xla_tensors.is_device_data(t):
        return ShardingType.REPLICATED
    return engines.planned().sharding_type(t)


__getattr__ = not_provided("torch_xla._XLAC")
