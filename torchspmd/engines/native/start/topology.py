"""The native engine's topology: one process per device, started by a launcher (torchrun,
``torchspmd run``) or by ``use_spmd()`` relaunching the script, before and after start."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torchspmd import accelerators
from torchspmd.launch.environment import ENV_NUM_DEVICES, XLA_CPU_NUM_DEVICES, launched, parse_count
from torchspmd.errors import SpmdError

_STATE = {"device_type": None}


def configured_processes(backend: str, num_devices: int | None = None) -> int:
    """Processes this host runs when the script was not started by a launcher (one per device)."""
    if num_devices is not None:
        if not isinstance(num_devices, int) or num_devices < 1:
            raise SpmdError(f"use_spmd(num_devices={num_devices!r}): give a positive integer")
        return num_devices
    if os.environ.get(ENV_NUM_DEVICES):
        return parse_count(os.environ[ENV_NUM_DEVICES], ENV_NUM_DEVICES)
    if backend != accelerators.CPU:
        return accelerators.device_count(backend)
    if os.environ.get(XLA_CPU_NUM_DEVICES):
        return parse_count(os.environ[XLA_CPU_NUM_DEVICES], XLA_CPU_NUM_DEVICES)
    return 1


def default_backend() -> str:
    """The accelerator PyTorch finds (its device type), else ``'cpu'``."""
    return accelerators.default_type()


def world_size() -> int:
    """Devices (processes) in the whole job."""
    if dist.is_initialized():
        return dist.get_world_size()
    if launched():
        return int(os.environ["WORLD_SIZE"])
    return configured_processes(default_backend())


def local_size() -> int:
    """Devices (processes) on this host."""
    if launched():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if dist.is_initialized():
        return dist.get_world_size()
    return configured_processes(default_backend())


def rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def set_device_type(device_type: str) -> None:
    _STATE["device_type"] = device_type


def device_type() -> str:
    """The started engine's device type (``'cpu'`` or the accelerator's, ``accelerators.current()``)."""
    if _STATE["device_type"] is None:
        raise SpmdError("the native engine is not started: call torchspmd.use_spmd() first")
    return _STATE["device_type"]


def device() -> torch.device:
    """This process's device: ``<accelerator>:<local rank>`` or ``cpu``."""
    return accelerators.device_of(device_type(), local_rank())
