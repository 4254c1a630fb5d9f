"""The device a process computes on, for any device type PyTorch knows: the one place that
names device types.

Everything device-specific goes through PyTorch's own device-generic API: the accelerator
PyTorch finds at start (``torch.accelerator.current_accelerator()``: CUDA, ROCm, XPU, MPS, or
a PrivateUse1 device such as TorchTPU's ``'tpu'``), its device module
(``torch.get_device_module(type)``: ``torch.cuda``, ``torch.xpu``, the module a PrivateUse1
backend registers) for device counts, the current device, random state, synchronisation and
memory figures, and c10d's map from device type to process-group backend
(``torch.distributed.Backend.default_device_backend_map``: ``cpu`` -> gloo, ``cuda`` -> nccl,
``xpu`` -> xccl; a backend registered with ``Backend.register_backend(..., devices=[type])``
adds its own). A new device needs no edit here: it is found at start or named
(``use_spmd(backend=type)``, ``$TORCHSPMD_BACKEND``), and its process-group backend is found
in that map or named (``$TORCHSPMD_PG_BACKEND``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torchspmd.errors import SpmdError

__all__ = ["CPU", "NAMED", "ENV_PG_BACKEND", "current", "default_type", "device_module", "is_available", "device_count",
           "set_device", "current_index", "pg_backend", "pg_spec", "rng_state", "set_rng_state", "manual_seed",
           "synchronize", "max_memory_allocated", "legacy_rng", "total_memory", "device_name", "device_of", "profiler_activity"]

CPU = "cpu"
#: the device types named in messages (any other PyTorch has a module for is served as well)
NAMED = (CPU, "cuda")
ENV_PG_BACKEND = "TORCHSPMD_PG_BACKEND"


def current() -> str | None:
    """The accelerator's device type PyTorch finds (``'cuda'``, ``'xpu'``, a PrivateUse1 name);
    None where there is none (a CPU-only machine)."""
    found = torch.accelerator.current_accelerator(check_available=True)
    if found is None or found.type == CPU:
        return None
    return found.type if is_available(found.type) else None


def default_type() -> str:
    """The accelerator's device type where there is one, else ``'cpu'``."""
    return current() or CPU


def device_module(device_type: str):
    """PyTorch's module for ``device_type`` (``torch.cuda``, ``torch.cpu``, a PrivateUse1 backend's);
    None where PyTorch has none."""
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError, ValueError):
        return None


def _call(device_type: str, name: str, *args, default=None):
    fn = getattr(device_module(device_type), name, None)
    return default if fn is None else fn(*args)


def _through_accelerator(device_type: str) -> bool:
    """Whether ``device_type`` is the accelerator's: then counts, the current device and
    synchronisation go through ``torch.accelerator``, not the device module (TorchTPU's module
    refuses those calls from outside torch on torch >= 2.11 and points to ``torch.accelerator``)."""
    found = torch.accelerator.current_accelerator()
    return device_type != CPU and found is not None and found.type == device_type


def is_available(device_type: str) -> bool:
    """Whether a device of ``device_type`` can be used in this process."""
    if device_type == CPU:
        return True
    if _through_accelerator(device_type):
        return bool(torch.accelerator.is_available())
    return bool(_call(device_type, "is_available", default=False))


def device_count(device_type: str) -> int:
    if device_type == CPU:
        return 1
    if _through_accelerator(device_type):
        return int(torch.accelerator.device_count())
    return int(_call(device_type, "device_count", default=0) or 0)


def set_device(device_type: str, index: int) -> None:
    """Make device ``index`` of ``device_type`` this process's current one (nothing for the CPU)."""
    if device_type == CPU:
        return
    if _through_accelerator(device_type):
        torch.accelerator.set_device_index(index)
    else:
        _call(device_type, "set_device", index)


def current_index(device_type: str) -> int | None:
    if device_type == CPU or not is_available(device_type):
        return None
    if _through_accelerator(device_type):
        return int(torch.accelerator.current_device_index())
    return _call(device_type, "current_device")


def device_of(device_type: str, index: int) -> torch.device:
    """The device ``index`` of ``device_type`` (the CPU has one, unnumbered)."""
    return torch.device(CPU) if device_type == CPU else torch.device(device_type, index)


def pg_backend(device_type: str) -> str:
    """The process-group backend for tensors of ``device_type``: ``$TORCHSPMD_PG_BACKEND``, else
    c10d's map (gloo for the CPU, nccl for CUDA, xccl for XPU, what a registered backend declared)."""
    named = os.environ.get(ENV_PG_BACKEND)
    if named and device_type != CPU:
        return named
    found = dist.Backend.default_device_backend_map.get(device_type)
    if found is None:
        raise SpmdError(f"no process-group backend is known for device type {device_type!r}: register one "
                           f"(torch.distributed.Backend.register_backend(name, ..., devices=[{device_type!r}])) "
                           f"or name it in ${ENV_PG_BACKEND}")
    return str(found)


def pg_spec(device_type: str) -> str:
    """What ``init_process_group(backend=...)`` takes for a job on ``device_type``: gloo for CPU
    tensors, and the device's own backend for its tensors (``'cpu:gloo,cuda:nccl'``)."""
    if device_type == CPU:
        return pg_backend(CPU)
    return f"{CPU}:{pg_backend(CPU)},{device_type}:{pg_backend(device_type)}"


def _generator(device_type: str, index: int | None):
    """The device's default generator (of ``index``, else the current device) where its module
    lists them (``default_generators``: read without the module's ``get_rng_state``, which
    TorchTPU keeps to torch's own callers); None where it does not."""
    generators = getattr(device_module(device_type), "default_generators", None)
    if not generators:
        return None
    return generators[current_index(device_type) if index is None else index]


def rng_state(device_type: str, index: int | None = None) -> torch.Tensor | None:
    """The device's random state (of ``index``, else the current device); None for the CPU (its
    generator is ``torch.get_rng_state()``) or where the device is not there."""
    if device_type == CPU or not is_available(device_type):
        return None
    generator = _generator(device_type, index)
    if generator is not None:
        return generator.get_state()
    return _call(device_type, "get_rng_state", *(() if index is None else (index,)))


def set_rng_state(device_type: str, state: torch.Tensor, index: int | None = None) -> None:
    if device_type == CPU or not is_available(device_type):
        return
    generator = _generator(device_type, index)
    if generator is not None:
        generator.set_state(state)
    else:
        _call(device_type, "set_rng_state", state, *(() if index is None else (index,)))


def manual_seed(device_type: str, seed: int) -> None:
    """Seed the device's generator of the current device (the CPU's is ``torch.manual_seed``)."""
    if device_type != CPU and is_available(device_type):
        _call(device_type, "manual_seed", seed)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing on the CPU)."""
    if device.type == CPU or not is_available(device.type):
        return
    if _through_accelerator(device.type):
        torch.accelerator.synchronize(device)
    else:
        _call(device.type, "synchronize", device)


def max_memory_allocated(device: torch.device) -> int | None:
    """Peak bytes allocated on ``device`` where its module counts them (None: not counted)."""
    if device.type == CPU or not is_available(device.type):
        return None
    if _through_accelerator(device.type):
        return int(torch.accelerator.max_memory_allocated(device))
    return _call(device.type, "max_memory_allocated", device)


def total_memory(device: torch.device) -> int | None:
    """The device's memory in bytes where its module reports it."""
    if device.type == CPU or not is_available(device.type):
        return None
    props = _call(device.type, "get_device_properties", device)
    return getattr(props, "total_memory", None)


def profiler_activity(device_type: str):
    """The profiler's activity for ``device_type``'s kernels (CUDA, XPU, MTIA, a PrivateUse1
    device's); None for the CPU or where the profiler has none."""
    if device_type == CPU:
        return None
    activity = torch.profiler.ProfilerActivity
    found = getattr(activity, device_type.upper(), None)
    if found is None and device_type == torch._C._get_privateuse1_backend_name():
        found = getattr(activity, "PrivateUse1", None)
    return found


#: the keys under which checkpoints written before ``device_rng`` (type, state) held a device's random state
_LEGACY_RNG_KEYS = {"cuda_rng": "cuda"}


def legacy_rng(saved: dict) -> tuple[str, torch.Tensor] | None:
    """The (device type, random state) a checkpoint written before the device-neutral
    ``device_rng`` key held under its device-specific key; None where it holds none."""
    for key, device_type in _LEGACY_RNG_KEYS.items():
        if saved.get(key) is not None:
            return device_type, saved[key]
    return None


def device_name(device: torch.device) -> str | None:
    if device.type == CPU or not is_available(device.type):
        return None
    return _call(device.type, "get_device_name", device)
