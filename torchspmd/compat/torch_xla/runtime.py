"""``torch_xla.runtime`` under ``--xla-compat``.

Counts follow torch_xla's meanings under SPMD, where one program drives every device:
``global_runtime_device_count()`` is the devices of the job, ``world_size()`` and the
(non-runtime) ``*_device_count()`` are 1 (the program sees one device). torchspmd runs one
process per device: ``process_index()`` / ``global_ordinal()`` are this process's rank and
``process_count()`` the number of processes, so that a file written under
``if xr.process_index() == 0`` is written once."""

from __future__ import annotations

import os

import torch.distributed as dist

from torchspmd import runtime as _ts
from torchspmd.compat import _device
from torchspmd.compat.names import NotProvidedError, message
from torchspmd.compat.stand_ins import not_provided


def use_spmd(auto: bool = False) -> None:
    """``torchspmd.use_spmd()`` (with several configured devices and no launcher, the program is
    started once per device). Sets ``XLA_USE_SPMD=1``, as torch_xla does (programs and torch_xla's
    tests read it, or delete it when done)."""
    if auto:
        raise NotProvidedError(message("torch_xla.runtime.use_spmd(auto=True)"))
    _ts.use_spmd()
    os.environ["XLA_USE_SPMD"] = "1"


def is_spmd() -> bool:
    """Whether SPMD is on, as torch_xla says it: ``use_spmd()`` ran and ``XLA_USE_SPMD`` is
    still 1 (torch_xla reads the variable; a program that deletes it turns the answer off,
    and the next ``use_spmd()`` on again; the engine itself keeps running)."""
    return _ts.is_spmd() and os.environ.get("XLA_USE_SPMD") == "1"


def global_runtime_device_count() -> int:
    return _ts.global_runtime_device_count()


def global_runtime_device_attributes() -> list[dict]:
    """One dict per device of the mesh, as torch_xla's PJRT client describes a CPU or CUDA
    device: ``{'name': 'CPU:0'}``... (TPUs add their coordinates; there are none here)."""
    return [{"name": f"{device_type()}:{i}"} for i in range(global_runtime_device_count())]


def runtime_device_attributes(device) -> dict:
    """The attributes of one device named as torch_xla names it (``'CPU:1'``), or of this
    process's device."""
    name = str(device)
    if not name.startswith(f"{device_type()}:"):  # ('xla:0', torch.device('cpu')...: this process's device)
        name = f"{device_type()}:{dist.get_rank() if dist.is_initialized() else 0}"
    return {"name": name}


def addressable_runtime_device_count() -> int:
    """The devices this process drives: 1 (torch_xla's one process per host drives the host's;
    here each process is one device, and a program that sizes its ``minibatch=True`` share of
    the batch by this count loads one device's share)."""
    return _ts.addressable_runtime_device_count()


def world_size() -> int:
    return 1


def global_device_count() -> int:
    return 1


def local_device_count() -> int:
    return 1


def addressable_device_count() -> int:
    return 1


def global_ordinal() -> int:
    return _ts.global_ordinal()


def local_ordinal() -> int:
    return _ts.local_ordinal()


def process_index() -> int:
    return dist.get_rank() if dist.is_initialized() else _ts.global_ordinal()


def process_count() -> int:
    return dist.get_world_size() if dist.is_initialized() else _ts.global_runtime_device_count()


def local_process_count() -> int:
    """The processes on this host: one per device here (torch_xla under SPMD: 1, its one process)."""
    return _ts.local_device_count()


def host_index() -> int:
    return 0 if process_index() < _ts.local_device_count() else process_index() // max(1, _ts.local_device_count())


def device_type() -> str:
    """``'CUDA'`` or ``'CPU'`` (torch_xla's PJRT names; never ``'TPU'`` here)."""

    return _device.native().type.upper()


def using_pjrt() -> bool:
    return True


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Nothing: XLA's persistent cache of compiled programs; the native engine compiles no
    XLA program (``torch.compile`` keeps its own cache)."""


__getattr__ = not_provided("torch_xla.runtime")
