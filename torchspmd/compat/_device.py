"""The ``'xla'`` device under ``--xla-compat``: this process's native device.

``torch.device('xla')`` is a device PyTorch knows by name but cannot use without torch_xla.
The calls that take a device are wrapped so that ``'xla'``, ``'xla:N'`` and
``torch.device('xla')`` mean ``torchspmd.device()`` (``cuda:LOCAL_RANK`` or ``cpu``):
``Tensor.to`` (and so ``Module.to``), ``Tensor.new_*``, every ``torch.*`` factory with a
``device`` argument, and ``torch.autocast('xla')``. A
``torch.device('xla')`` object itself keeps its type: compare devices by the tensors'
own ``.device``. A plain tensor put on the device (named ``'xla'``, or as
``xm.xla_device()`` returns it: ``x.to(xm.xla_device())``) is an ``OnXlaDevice``, which
``xs.mark_sharding`` shards in place (``xla_tensors``).
"""

from __future__ import annotations

import os

import torch

from torchspmd import accelerators, runtime
from torchspmd.compat import xla_tensors
from torchspmd.patches import torch as torch_patches


def native() -> torch.device:
    if runtime.is_spmd():
        return runtime.device()
    return accelerators.device_of(accelerators.default_type(), int(os.environ.get("LOCAL_RANK", "0")))


_PROGRAM: dict[str, torch.device] = {}


def program_device() -> torch.device:
    """The native device as ``torch_xla.device()`` and ``xm.xla_device()`` give it to the program:
    always the same object, of its own (equal to ``native()``), so that a factory given it
    (``torch.randn(..., device=xm.xla_device())``) is told from torchspmd's own and PyTorch's
    calls on the same device, and puts its result on ``'xla'``."""
    d = native()
    if str(d) not in _PROGRAM:
        _PROGRAM[str(d)] = torch.device(str(d))
    return _PROGRAM[str(d)]


def is_program_device(d) -> bool:
    return any(d is o for o in _PROGRAM.values())


def is_xla(d) -> bool:
    if isinstance(d, str):
        return d == "xla" or d.startswith("xla:")
    return isinstance(d, torch.device) and d.type == "xla"


def is_native(d) -> bool:
    """Whether ``d`` is the native device itself (a ``torch.device``, as ``xm.xla_device()``
    returns it, or its name)."""
    if not isinstance(d, (str, torch.device)) or is_xla(d):
        return False
    try:
        return torch.device(d) == native()
    except RuntimeError:  # not a device name (a dtype given as a string, say)
        return False


def _map(d):
    return native() if is_xla(d) else d


def install() -> None:
    """The ``'xla'`` device means this process's (``torchspmd.patches.torch.XLA_DEVICE``)."""
    torch_patches.map_device(is_xla, native, xla_tensors.placed, is_native,
                             lambda t: type(t) is xla_tensors.OnXlaDevice, is_program_device)
