"""The ``'xla'`` device under ``--xla-compat``: this process's native device.

``torch.device('xla')`` is a device PyTorch knows by name but cannot use without torch_xla.
The calls that take a device are wrapped so that ``'xla'``, ``'xla:N'`` and
``torch.device('xla')`` mean ``torchspmd.device()`` (``cuda:LOCAL_RANK`` or ``cpu``):
``Tensor.to`` (and so ``Module.to``), ``Tensor.new_*``, every ``torch.*`` factory with a
``device`` argument, and ``torch.autocast('xla')``. A
``torch.device('xla')`` object itself keeps its type: compare devices by the tensors'
own ``.device``.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

_INSTALLED = []


def native() -> torch.device:
    from torchspmd import runtime

    if runtime.is_spmd():
        return runtime.device()
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def is_xla(d) -> bool:
    if isinstance(d, str):
        return d == "xla" or d.startswith("xla:")
    return isinstance(d, torch.device) and d.type == "xla"


def _map(d):
    return native() if is_xla(d) else d


def _wrap_device_kwarg(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        d = kwargs.get("device")
        if d is not None and is_xla(d):
            kwargs["device"] = native()
        return fn(*args, **kwargs)

    call._torchspmd_original = fn
    return call


def _wrap_to(fn):
    @functools.wraps(fn)
    def to(self, *args, **kwargs):
        if args and is_xla(args[0]):
            args = (native(),) + args[1:]
        d = kwargs.get("device")
        if d is not None and is_xla(d):
            kwargs["device"] = native()
        return fn(self, *args, **kwargs)

    to._torchspmd_original = fn
    return to


def _factories() -> list[str]:
    """Functions in ``torch`` documented with a ``device`` argument (the factories)."""
    names = []
    for name in dir(torch):
        if name.startswith("_"):
            continue
        fn = getattr(torch, name, None)
        if not callable(fn) or isinstance(fn, type):
            continue
        doc = getattr(fn, "__doc__", None) or ""
        if "device (:class:`torch.device`" in doc or "device=None" in doc:
            names.append(name)
    names += [n for n in ("normal", "scalar_tensor") if hasattr(torch, n)]
    return sorted(set(names))


class _Autocast(torch.amp.autocast):
    def __init__(self, device_type="cuda", *args, **kwargs):
        if is_xla(device_type):
            device_type = native().type
        super().__init__(device_type, *args, **kwargs)


def install() -> None:
    if _INSTALLED:
        return
    # torch.device('meta') as a context manager (and set_default_device) gives a device to
    # the factories found in a set of functions that torch builds once, when first asked, from
    # the torch.* attributes: built after the wrapping it would hold the wrappers, never the
    # functions the mode is called with, and factories would ignore the context (transformers
    # then initializes a model's non-persistent buffers on meta and loads them as garbage).
    # Build it now, from torch's own functions.
    from torch.utils import _device as torch_device

    if hasattr(torch_device, "_device_constructors"):
        torch_device._device_constructors()
    torch.Tensor.to = _wrap_to(torch.Tensor.to)
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided"):
        setattr(torch.Tensor, name, _wrap_device_kwarg(getattr(torch.Tensor, name)))
    for name in _factories():
        setattr(torch, name, _wrap_device_kwarg(getattr(torch, name)))
    torch.autocast = _Autocast
    torch.amp.autocast = _Autocast
    _INSTALLED.append(True)
