"""Runtime: SPMD mode, devices, device counts, and ``step()``.

One logical program; on the native engine one process per device underneath. ``use_spmd()``
chooses the engine (``torchspmd.engines``) and starts it: the native engine joins the
process group its launcher made (``torchrun``, ``torchspmd run``), or, started as a plain
``python script.py`` with more than one device configured, re-launches the script once per
device and exits with the workers' status; the torch_xla engine drives every local device
from this process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from torchspmd import engines
from torchspmd.launch import environment

__all__ = [
    "use_spmd",
    "is_spmd",
    "backend",
    "device",
    "device_type",
    "global_runtime_device_count",
    "global_device_count",
    "addressable_runtime_device_count",
    "addressable_device_count",
    "local_device_count",
    "global_ordinal",
    "local_ordinal",
    "process_index",
    "process_count",
    "world_size",
    "step",
    "current_step",
]

# Environment variables read when choosing and starting an engine (documented in docs/environment.md).
ENV_BACKEND = engines.ENV_BACKEND
ENV_NUM_DEVICES = environment.ENV_NUM_DEVICES
XLA_CPU_NUM_DEVICES = environment.XLA_CPU_NUM_DEVICES


@dataclass
class _State:
    backend: str | None = None
    device: torch.device | None = None
    step: int = 0


_STATE = _State()


def use_spmd(auto: bool = False, *, backend: str | None = None, num_devices: int | None = None) -> None:
    """Turn SPMD mode on. Call it first, before building models or tensors.

    Args:
        auto: torch_xla's auto-sharding switch; on the torch_xla engine it is handed to
            torch_xla, on the native engine it is not supported (raises if True).
        backend: ``"cpu"``, an accelerator's device type (any PyTorch has a module for:
            CUDA's, XPU's, a PrivateUse1 device such as TorchTPU's ``"tpu"``), or ``"xla"``;
            default: ``$TORCHSPMD_BACKEND``, else xla when ``$PJRT_DEVICE`` is set and
            torch_xla is installed, else the accelerator PyTorch finds
            (``torch.accelerator.current_accelerator()``), else cpu.
        num_devices: local devices (processes) to use when the script was started
            as plain ``python script.py``; default ``$TORCHSPMD_NUM_DEVICES``, else every
            accelerator device, else ``$CPU_NUM_DEVICES`` on CPU, else 1. On the torch_xla engine
            one process drives every device PJRT shows (``CPU_NUM_DEVICES`` on CPU).

    With more than one device and no launcher, this call re-launches the script once
    per device (native engine) and never returns in the parent: it exits with the
    children's status.
    """
    if engines.started() is not None:
        return
    engine, name = engines.choose(backend)
    _STATE.device = engines.start(engine, name, auto=bool(auto), num_devices=num_devices)
    _STATE.backend = name


def require_spmd(api: str):
    """The started engine; ``api`` names the caller in the error when SPMD mode is off."""
    return engines.current(api)


def is_spmd() -> bool:
    """Whether ``use_spmd()`` has been called in this process."""
    return engines.started() is not None


def backend() -> str:
    """The backend ``use_spmd()`` chose: ``"cpu"`` (gloo), an accelerator's device type
    (its own process-group backend for its tensors) or ``"xla"`` (torch_xla)."""
    engines.current("torchspmd.backend()")
    assert _STATE.backend is not None
    return _STATE.backend


def capabilities() -> engines.Capabilities:
    """What the started engine can do (``torchspmd.engines.base.Capabilities``)."""
    return engines.current("torchspmd.runtime.capabilities()").capabilities


def device() -> torch.device:
    """This process's device: ``<accelerator>:LOCAL_RANK`` (``cuda:1``), ``cpu``, or
    torch_xla's device. Put models and data here."""
    engines.current("torchspmd.device()")
    assert _STATE.device is not None
    return _STATE.device


def device_type() -> str:
    """The type of ``device()``: ``"cpu"``, an accelerator's, or ``"xla"``."""
    return device().type


def launched() -> bool:
    """A launcher (torchrun, ``torchspmd run``) started this process."""
    return environment.launched()


def backends() -> tuple[str, ...]:
    """The backend names ``use_spmd(backend=...)`` accepts."""
    return engines.backends()


def known_backend(name: str) -> bool:
    """Whether some engine serves backend ``name`` (a listed name, or a device type PyTorch
    has a module for)."""
    return engines.serving(name.lower()) is not None


def chosen_backend(requested: str | None = None) -> str:
    """The backend ``use_spmd(backend=requested)`` would start (nothing is started)."""
    return engines.choose(requested)[1]


def planned_processes(requested: str | None = None, num_devices: int | None = None) -> int | None:
    """The processes a job of backend ``requested`` runs (``WORLD_SIZE`` under a launcher,
    else what ``use_spmd`` would start); None where the engine counts its devices when it
    starts (torch_xla)."""
    engine, name = engines.choose(requested)
    return engine.planned_processes(name, num_devices)


# Counts and indices: asked of the engine in use, or of the one use_spmd() would choose.
def global_runtime_device_count() -> int:
    """Devices in the whole job (one process per device on the native engine)."""
    return engines.planned().global_runtime_device_count()


def global_device_count() -> int:
    """Devices in the whole job."""
    return engines.planned().global_device_count()


def local_device_count() -> int:
    """Devices on this host (torch_xla's meaning on its engine: 1 in SPMD mode)."""
    return engines.planned().local_device_count()


def addressable_runtime_device_count() -> int:
    """Devices this process drives: one on the native engine (one process per device), all of
    its host's on torch_xla. What a process loads with ``ShardingSpec(..., minibatch=True)`` is
    its addressable devices' share of the global batch."""
    return engines.planned().addressable_runtime_device_count()


def addressable_device_count() -> int:
    """As ``addressable_runtime_device_count`` (1 on the native engine; torch_xla's own on its engine)."""
    return engines.planned().addressable_device_count()


def global_ordinal() -> int:
    """This process's (device's) index in the job: its rank."""
    return engines.planned().global_ordinal()


def local_ordinal() -> int:
    """This process's device index on its host."""
    return engines.planned().local_ordinal()


def process_index() -> int:
    """Index of this process; on the native engine equal to ``global_ordinal()``."""
    return engines.planned().process_index()


def process_count() -> int:
    """Number of processes in the job; on the native engine ``global_runtime_device_count()``."""
    return engines.planned().process_count()


def world_size() -> int:
    """The devices of the job on the native engine (one process each); on the torch_xla engine,
    what torch_xla's ``xr.world_size()`` says (1 under SPMD). ``--xla-compat`` answers
    ``xr.world_size()`` with 1, as torch_xla does."""
    return engines.planned().world_size()


@contextlib.contextmanager
def step() -> Iterator[None]:
    """Mark one training step.

    Inside, the step is annotated for the PyTorch profiler; on leaving it normally the
    step counter (``current_step()``) advances. The native engine issues work eagerly, so
    there is no graph to flush: results are ready when read. On the torch_xla engine this
    is ``torch_xla.step()``: the step's graph is compiled and run on leaving.
    """
    engine = engines.current("torchspmd.step()")
    with engine.step(_STATE.step):
        yield
    _STATE.step += 1


def in_local_compute() -> bool:
    """Inside a wrapped module's local compute (FSDPv2's units, ``replicate``): tensors there are
    this process's shares of the global values."""
    engine = engines.started()
    return engine is not None and engine.in_local_compute()


def current_step() -> int:
    """Number of ``step()`` blocks completed in this process."""
    return _STATE.step


def count_step() -> None:
    """Count a step that ended outside ``step()`` (torch_xla's ``mark_step``, ``sync``)."""
    _STATE.step += 1
