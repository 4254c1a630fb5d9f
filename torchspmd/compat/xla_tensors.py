"""Tensors a program put on the ``'xla'`` device under ``--xla-compat``, which ``xs.mark_sharding``
can shard in place.

torch_xla annotates a tensor in place: after ``xs.mark_sharding(t, mesh, spec)`` the program's
``t`` is sharded, whether or not it keeps the result. On the native engine a sharded tensor is
a DTensor, another Python object; ``torch.utils.swap_tensors`` can make the program's object
the DTensor, but only between objects of the same layout, and a plain tensor's object lacks
DTensor's slots. So a plain tensor put on ``'xla'`` (``.to('xla')``, ``device='xla'`` in a
factory or ``Tensor.new_*``) is returned as an ``OnXlaDevice``: a ``torch.Tensor`` subclass with
DTensor's slots and nothing else. It is a plain tensor in every operation (torch function
dispatch is disabled for it, so operations return plain tensors); ``xs.mark_sharding`` swaps it
with the sharded tensor. Parameters (``Module.to('xla')``) are not changed: annotated in place
through their modules, as before.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["OnXlaDevice", "placed", "shard_in_place"]


class OnXlaDevice(torch.Tensor):
    """A plain tensor on this process's device, as the program put it on ``'xla'``."""

    __slots__ = tuple(getattr(DTensor, "__slots__", ()))
    __torch_function__ = torch._C._disabled_torch_function_impl


def placed(source, result):
    """What a call that put a tensor on ``'xla'`` returns: a plain tensor as an ``OnXlaDevice``
    (sharing its data and its place in autograd), anything else as it is."""
    if type(result) is torch.Tensor and not isinstance(source, torch.nn.Parameter):
        return result.as_subclass(OnXlaDevice)
    return result


def shard_in_place(t, sharded) -> bool:
    """Make the program's ``t`` (an ``OnXlaDevice``) the ``sharded`` DTensor in place; False
    where it cannot (another tensor type, or ``t`` held elsewhere, e.g. saved for backward)."""
    if type(t) is not OnXlaDevice or not isinstance(sharded, DTensor) or sharded is t:
        return False
    try:
        torch.utils.swap_tensors(t, sharded)
    except RuntimeError:
        return False
    return True
