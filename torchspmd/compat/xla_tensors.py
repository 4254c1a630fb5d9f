"""Tensors a program put on the ``'xla'`` device under ``--xla-compat``, which ``xs.mark_sharding``
can shard in place.

torch_xla annotates a tensor in place: after ``xs.mark_sharding(t, mesh, spec)`` the program's
``t`` is sharded, whether or not it keeps the result. On the native engine a sharded tensor is
a DTensor, another Python object; ``torch.utils.swap_tensors`` can make the program's object
the DTensor, but only between objects of the same layout, and a plain tensor's object lacks
DTensor's slots. So a plain tensor put on ``'xla'`` (``.to('xla')``, ``device='xla'`` or the
device object ``xm.xla_device()`` returned in a factory or ``Tensor.new_*``) is returned as an
``OnXlaDevice``: a ``torch.Tensor`` subclass with DTensor's slots and nothing else. It computes
as a plain tensor; the plain tensors an operation on it returns are ``OnXlaDevice`` too (device
tensors, as torch_xla's op results are), so that ``xs.mark_sharding`` can shard an op's result
in place as well: it swaps the object with the sharded tensor. That costs a Python call per
operation on such tensors (``bench/xla_tensor_ops.py``), never on the native API's tensors, and
results are left plain inside a wrapped module's local compute (FSDPv2's units: an activation
there is a share, which ``mark_sharding`` returns as it is). Parameters (``Module.to('xla')``)
are not changed: annotated in place through their modules, as before.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from torchspmd import runtime

__all__ = ["OnXlaDevice", "placed", "shard_in_place", "clear_in_place", "mark_device_data", "is_device_data"]

# An OnXlaDevice's attribute: the step it was put on the device in (None: data the loader sent).
# (An attribute, not a weak map: torch.utils.swap_tensors refuses a tensor with weak references.)
_PLACED_AT = "_torchspmd_placed_at"


#: torch functions whose results keep their identity (``.grad``, ``._base``): never re-wrapped
_KEEP = torch.overrides.get_default_nowrap_functions()


class OnXlaDevice(torch.Tensor):
    """A plain tensor on this process's device, as the program put it on ``'xla'``, or computed
    from one."""

    __slots__ = tuple(getattr(DTensor, "__slots__", ()))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _KEEP or runtime.in_local_compute():
            return out
        return _on_device(out)

    def __deepcopy__(self, memo):
        if id(self) not in memo:  # (a copy is one too: a plain tensor's copy, as OnXlaDevice)
            memo[id(self)] = copy.deepcopy(self.as_subclass(torch.Tensor), memo).as_subclass(OnXlaDevice)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):  # saved (torch.save, pickle) as the plain tensor it is
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def _pending(t: torch.Tensor) -> OnXlaDevice:
    out = t.as_subclass(OnXlaDevice)  # (the same data and place in autograd)
    setattr(out, _PLACED_AT, runtime.current_step())
    return out


def _on_device(out):
    """An operation's result: its plain tensors as ``OnXlaDevice`` (pending computations)."""
    if type(out) is torch.Tensor:
        return _pending(out)
    if isinstance(out, (tuple, list)) and any(type(o) is torch.Tensor for o in out):
        items = [_pending(o) if type(o) is torch.Tensor else o for o in out]
        if isinstance(out, list):
            return items
        return type(out)(*items) if hasattr(out, "_fields") and not hasattr(out, "n_fields") else type(out)(items)
    return out


def placed(source, result):
    """What a call that put a tensor on ``'xla'`` returns: a plain tensor as an ``OnXlaDevice``
    (sharing its data and its place in autograd), anything else as it is."""
    if type(result) is not torch.Tensor or isinstance(source, torch.nn.Parameter):
        return result
    if result.grad_fn is None:  # a leaf stays a leaf (as_subclass would make an alias in the graph)
        out = torch.Tensor._make_subclass(OnXlaDevice, result, result.requires_grad)
    else:
        out = result.as_subclass(OnXlaDevice)
    setattr(out, _PLACED_AT, runtime.current_step())
    return out


def mark_device_data(t):
    """``t`` (an ``OnXlaDevice``) is data the loader sent to the device, as torch_xla's
    ``send_cpu_data_to_device`` makes it: already on the device, not a pending computation."""
    if type(t) is OnXlaDevice:
        setattr(t, _PLACED_AT, None)
    return t


def is_device_data(t) -> bool:
    """Whether torch_xla would hold ``t`` as device data rather than a pending computation: data
    the loader sent, or a tensor put on the device before the last step boundary (``sync``,
    ``mark_step``). torch_xla reports such an unannotated tensor as ``'{replicated}'``, a pending
    one as ``''``."""
    if type(t) is not OnXlaDevice or not hasattr(t, _PLACED_AT):
        return False
    at = getattr(t, _PLACED_AT)
    return at is None or at < runtime.current_step()


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


def clear_in_place(t, whole):
    """``xs.clear_sharding(t)``: torch_xla drops the annotation of ``t`` itself. A sharded
    tensor (not a parameter: those are replaced in their modules) becomes ``whole``, its whole
    value as an ``OnXlaDevice``, in place; returns the tensor the program should hold."""
    if type(whole) is OnXlaDevice:  # (computed from one)
        whole = whole.as_subclass(torch.Tensor)
    if not isinstance(t, DTensor) or isinstance(t, torch.nn.Parameter) or type(whole) is not torch.Tensor:
        return whole
    plain = placed(None, whole)
    try:
        torch.utils.swap_tensors(t, plain)
    except RuntimeError:  # (held elsewhere, e.g. saved for backward): the result only
        return whole
    return t
