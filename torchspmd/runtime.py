"""Runtime: SPMD mode, devices, process groups, relaunch, and ``step()``.

One logical program; one process per device underneath. ``use_spmd()`` sets the
process up: it joins the process group its launcher made (``torchrun``,
``torchspmd run``), or, started as a plain ``python script.py`` with more than one
device configured, re-launches the script once per device on PyTorch's elastic
launcher and exits with the children's status.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from torchspmd._errors import SpmdError

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

_BACKENDS = ("cpu", "cuda", "xla")
# Environment variables read by the runtime (documented in docs/guide.md).
ENV_NUM_DEVICES = "TORCHSPMD_NUM_DEVICES"  # local processes to use, any device type
ENV_BACKEND = "TORCHSPMD_BACKEND"  # cpu | cuda | xla
ENV_ALL_RANKS_OUTPUT = "TORCHSPMD_ALL_RANKS_OUTPUT"  # 1: keep stdout/warnings of every rank
XLA_CPU_NUM_DEVICES = "CPU_NUM_DEVICES"  # torch_xla's name, honoured on CPU too
XLA_PJRT_DEVICE = "PJRT_DEVICE"  # set (with torch_xla installed): the XLA backend
# The native engine (DTensor, FSDP2) is tested on this torch; torch 2.9's DTensor lacks sharding
# rules it relies on (detach_, masked_fill_, argmax, batch norm). torch_xla 2.9 (the XLA
# backend) needs torch 2.9, so the package's own requirement stays torch>=2.9.
NATIVE_TESTED_TORCH = "2.13"


@dataclass
class _State:
    spmd: bool = False
    backend: str | None = None
    device: torch.device | None = None
    step: int = 0
    owns_process_group: bool = False
    warned_pjrt: bool = False


_STATE = _State()


def _launched() -> bool:
    """True when a launcher (torchrun, torchspmd run) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _xla_by_environment() -> bool:
    """torch_xla's own switch: PJRT_DEVICE set, and torch_xla importable."""
    if not os.environ.get(XLA_PJRT_DEVICE):
        return False
    from torchspmd import compat
    from torchspmd.backends import xla

    if compat.active():  # the program's torch_xla is the layer: PJRT_DEVICE was meant for it
        return False

    if xla.installed():
        return True
    if not _STATE.warned_pjrt:
        _STATE.warned_pjrt = True
        warnings.warn(f"{XLA_PJRT_DEVICE}={os.environ[XLA_PJRT_DEVICE]} is set but torch_xla is not installed: "
                      f"torchspmd uses its native engine ({xla.INSTALL.split(' (')[0]} for the XLA backend)")
    return False


def _choose_backend(requested: str | None) -> str:
    name = requested or os.environ.get(ENV_BACKEND) or None
    if name is None:
        if _xla_by_environment():
            return "xla"
        return "cuda" if torch.cuda.is_available() else "cpu"
    name = name.lower()
    if name not in _BACKENDS:
        where = f"use_spmd(backend={name!r})" if requested else f"{ENV_BACKEND}={name}"
        raise SpmdError(
            f"{where}: unknown backend; choose one of {', '.join(_BACKENDS)} "
            f"(or leave it unset to pick cuda when available, else cpu)"
        )
    if name == "xla":
        from torchspmd.backends import xla

        where = "use_spmd(backend='xla')" if requested else f"{ENV_BACKEND}=xla"
        if not xla.installed():
            xla.require(where)
    if name == "cuda" and not torch.cuda.is_available():
        where, fix = ("use_spmd(backend='cuda')", "backend='cpu'") if requested else \
            (f"{ENV_BACKEND}=cuda", f"{ENV_BACKEND}=cpu")
        raise SpmdError(
            f"{where}: no CUDA device is visible to PyTorch (torch.cuda.is_available() is False); use {fix}"
        )
    return name


def _parse_count(value: str, source: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise SpmdError(f"{source}={value!r} is not an integer; set it to the number of devices") from None
    if n < 1:
        raise SpmdError(f"{source}={n}: the number of devices must be at least 1; set it to the number of "
                        f"processes to run, or unset it")
    return n


def _configured_local_devices(backend_name: str, num_devices: int | None = None) -> int:
    """Processes this host should run when the script was not started by a launcher (one
    per device; one for all devices on the XLA backend)."""
    if backend_name == "xla":
        return 1
    if num_devices is not None:
        if not isinstance(num_devices, int) or num_devices < 1:
            raise SpmdError(f"use_spmd(num_devices={num_devices!r}): give a positive integer")
        return num_devices
    if os.environ.get(ENV_NUM_DEVICES):
        return _parse_count(os.environ[ENV_NUM_DEVICES], ENV_NUM_DEVICES)
    if backend_name == "cuda":
        return torch.cuda.device_count()
    if os.environ.get(XLA_CPU_NUM_DEVICES):
        return _parse_count(os.environ[XLA_CPU_NUM_DEVICES], XLA_CPU_NUM_DEVICES)
    return 1


def use_spmd(auto: bool = False, *, backend: str | None = None, num_devices: int | None = None) -> None:
    """Turn SPMD mode on. Call it first, before building models or tensors.

    Args:
        auto: torch_xla's auto-sharding switch; on the XLA backend it is handed to
            torch_xla, on the native engine it is not supported (raises if True).
        backend: ``"cuda"``, ``"cpu"`` or ``"xla"``; default: ``$TORCHSPMD_BACKEND``, else
            xla when ``$PJRT_DEVICE`` is set and torch_xla is installed, else cuda when
            available, else cpu.
        num_devices: local devices (processes) to use when the script was started
            as plain ``python script.py``; default ``$TORCHSPMD_NUM_DEVICES``, else every
            CUDA device, else ``$CPU_NUM_DEVICES`` on CPU, else 1. On the XLA backend one
            process drives every device PJRT shows (``CPU_NUM_DEVICES`` on CPU).

    With more than one device and no launcher, this call re-launches the script once
    per device (native engine) and never returns in the parent: it exits with the
    children's status.
    """
    if _STATE.spmd:
        return
    name = _choose_backend(backend)
    if name == "xla":
        from torchspmd.backends import xla

        source = "use_spmd(num_devices=...)"
        if num_devices is None and os.environ.get(ENV_NUM_DEVICES):
            num_devices, source = _parse_count(os.environ[ENV_NUM_DEVICES], ENV_NUM_DEVICES), ENV_NUM_DEVICES
        had_group = dist.is_initialized()
        _STATE.device = xla.start(bool(auto), num_devices, source)
        if not had_group and dist.is_initialized():  # several hosts: a gloo group for checkpoints
            _STATE.owns_process_group = True
            atexit.register(_shutdown)
        _STATE.backend = name
        _STATE.spmd = True
        return
    if auto:
        raise SpmdError(
            "use_spmd(auto=True): auto-sharding is torch_xla's (the XLA backend); the native engine does not "
            "support it: annotate shardings with mark_sharding / FSDPv2 instead"
        )
    if not _launched() and not dist.is_initialized():
        n = _configured_local_devices(name, num_devices)
        if n > 1:
            from torchspmd._launch import relaunch_current_script

            raise SystemExit(relaunch_current_script(n))
    _init_process_group(name)
    if dist.get_rank() == 0:
        _warn_native_torch(name)
    from torchspmd._launch import record_failures  # uncaught errors -> torchrun's error file, for the summary
    record_failures()
    _STATE.backend = name
    if name == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        _STATE.device = torch.device("cuda", local)
    else:
        _STATE.device = torch.device("cpu")
    from torchspmd import _global_view, _rng

    # One program: every process continues from rank 0's random state (docs/guide.md).
    _rng.synchronize(name)
    _global_view.install()
    importlib.import_module("torchspmd.sharded_tensor").install()  # torch_xla's XLAShardedTensor attributes
    importlib.import_module("torchspmd.replicate").install_auto()  # (the package's `replicate` is the function)
    _STATE.spmd = True
    from torchspmd._launch import _all_ranks_output

    if dist.get_rank() != 0 and not _all_ranks_output():
        # The global view: the program prints once, as one process would.
        sys.stdout = open(os.devnull, "w")
        warnings.simplefilter("ignore")


class OlderTorchWarning(UserWarning):
    """The native engine runs on a torch older than the one it is tested with."""


def _warn_native_torch(name: str) -> None:
    """Say once (rank 0) that this torch is older than the native engine's tested one: some
    operations then fail inside DTensor, on whichever first lacks a sharding rule."""
    if torch.__version__ >= NATIVE_TESTED_TORCH:
        return
    warnings.warn(
        f"use_spmd(): the native engine ({name}) is tested on torch>={NATIVE_TESTED_TORCH}, this is torch "
        f"{torch.__version__}: its DTensor lacks sharding rules the engine relies on (on torch 2.9: detach_, "
        f"masked_fill_, argmax, batch norm), and programs that reach one fail there (NotImplementedError). "
        f"Install torch>={NATIVE_TESTED_TORCH}, or run on the XLA backend (torch_xla of this torch's version, with "
        f"PJRT_DEVICE set or {ENV_BACKEND}=xla)", OlderTorchWarning, stacklevel=3)


def _init_process_group(name: str) -> None:
    if dist.is_initialized():
        return
    pg_backend = "cpu:gloo,cuda:nccl" if name == "cuda" else "gloo"
    if _launched():
        dist.init_process_group(pg_backend)
    else:
        dist.init_process_group(pg_backend, store=dist.HashStore(), rank=0, world_size=1)
    _STATE.owns_process_group = True
    atexit.register(_shutdown)


def _shutdown() -> None:
    if _STATE.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.owns_process_group = False


def _require_spmd(api: str) -> None:
    if not _STATE.spmd:
        raise SpmdError(
            f"{api} needs SPMD mode: call torchspmd.use_spmd() at the start of the program, "
            f"before any sharded computation"
        )


def is_spmd() -> bool:
    """Whether ``use_spmd()`` has been called in this process."""
    return _STATE.spmd


def _xla() -> bool:
    """The XLA backend is in use, or will be when ``use_spmd()`` is called."""
    if _STATE.backend is not None:
        return _STATE.backend == "xla"
    name = (os.environ.get(ENV_BACKEND) or "").lower()
    return name == "xla" if name else _xla_by_environment()


def _on_xla_runtime(fn):
    """On the XLA backend (in use, or to be chosen), the ``torch_xla.runtime`` function of
    the same name answers instead (torch_xla's meaning of the count or index)."""
    name = fn.__name__

    @functools.wraps(fn)
    def call() -> int:
        if not _xla():
            return fn()
        from torchspmd.backends import xla

        xla.require(f"torchspmd.{name}() ({ENV_BACKEND}={os.environ.get(ENV_BACKEND, '')!r}, "
                    f"{XLA_PJRT_DEVICE}={os.environ.get(XLA_PJRT_DEVICE, '')!r})")
        return getattr(xla._xr(), name)()

    return call


def backend() -> str:
    """The engine chosen by ``use_spmd()``: ``"cuda"`` (NCCL), ``"cpu"`` (gloo) or
    ``"xla"`` (torch_xla)."""
    _require_spmd("torchspmd.backend()")
    assert _STATE.backend is not None
    return _STATE.backend


def device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK``, ``cpu``, or torch_xla's device. Put
    models and data here."""
    _require_spmd("torchspmd.device()")
    assert _STATE.device is not None
    return _STATE.device


def device_type() -> str:
    """``"cuda"``, ``"cpu"`` or ``"xla"`` (the type of ``device()``)."""
    return device().type


@_on_xla_runtime
def global_runtime_device_count() -> int:
    """Devices in the whole job (one process per device)."""
    if dist.is_initialized():
        return dist.get_world_size()
    if _launched():
        return int(os.environ["WORLD_SIZE"])
    return _configured_local_devices(_choose_backend(None))


@_on_xla_runtime
def global_device_count() -> int:
    """Devices in the whole job."""
    return global_runtime_device_count()


@_on_xla_runtime
def local_device_count() -> int:
    """Devices on this host."""
    if _launched():
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if dist.is_initialized():
        return dist.get_world_size()
    return _configured_local_devices(_choose_backend(None))


@_on_xla_runtime
def addressable_runtime_device_count() -> int:
    """Devices this process drives: one on the native engine, all of its host's on XLA."""
    return local_device_count()


@_on_xla_runtime
def addressable_device_count() -> int:
    return local_device_count()


@_on_xla_runtime
def global_ordinal() -> int:
    """This process's (device's) index in the job: its rank."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


@_on_xla_runtime
def local_ordinal() -> int:
    """This process's device index on its host."""
    return int(os.environ.get("LOCAL_RANK", "0"))


@_on_xla_runtime
def process_index() -> int:
    """Index of this process; equal to ``global_ordinal()`` (one process per device)."""
    return global_ordinal()


@_on_xla_runtime
def process_count() -> int:
    """Number of processes in the job; equal to ``global_runtime_device_count()``."""
    return global_runtime_device_count()


@_on_xla_runtime
def world_size() -> int:
    return global_runtime_device_count()


@contextlib.contextmanager
def step() -> Iterator[None]:
    """Mark one training step.

    Inside, the step is annotated for the PyTorch profiler; on leaving it normally the
    step counter (``current_step()``) advances. Work is issued eagerly by the native
    engine, so there is no graph to flush: results are ready when read. On the XLA
    backend this is ``torch_xla.step()``: the step's graph is compiled and run on leaving.
    """
    _require_spmd("torchspmd.step()")
    if _STATE.backend == "xla":
        from torchspmd.backends import xla

        with xla.step():
            yield
    else:
        with torch.profiler.record_function(f"torchspmd.step#{_STATE.step}"):
            yield
    _STATE.step += 1


def current_step() -> int:
    """Number of ``step()`` blocks completed in this process."""
    return _STATE.step
