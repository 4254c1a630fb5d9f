"""``torch_xla.runtime`` under ``--xla-compat``.

Counts follow torch_xla's meanings under SPMD, where one program drives every device:
``global_runtime_device_count()`` is the devices of the job, ``world_size()`` and the
(non-runtime) ``*_device_count()`` are 1 (the program sees one device). torchspmd runs one
process per device: ``process_index()`` / ``global_ordinal()`` are this process's rank and
``process_count()`` the number of processes, so that a file written under
``if xr.process_index() == 0`` is written once."""

from __future__ import annotations

import torch.distributed as dist

from torchspmd import runtime as _ts
from torchspmd.compat import _device
from torchspmd.compat.names import NotProvidedError, message, not_provided


def use_spmd(auto: bool = False) -> None:
    if auto:
        raise NotProvidedError(message("torch_xla.runtime.use_spmd(auto=True)"))
    _ts.use_spmd()


def is_spmd() -> bool:
    return _ts.is_spmd()


def global_runtime_device_count() -> int:
    return _ts.global_runtime_device_count()


def addressable_runtime_device_count() -> int:
    """The host's devices (torch_xla: the devices the host's one process drives)."""
    return _ts.local_device_count()


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
