"""``torch_xla.core.xla_model`` (``xm``) under ``--xla-compat``."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from torchspmd import accelerators, engines
from torchspmd.compat import _device, _steps
from torchspmd.compat.stand_ins import not_provided
from torchspmd.compat.torch_xla import runtime as _xr
from torchspmd.data import shard_batch
from torchspmd.errors import SpmdError


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """This process's native device."""
    return _device.program_device()


def xla_device_hw(device) -> str:
    return _xr.device_type()


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """True for a tensor on this process's device (the 'xla' device here)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == _device.native().type


def get_xla_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list[str]:
    return [str(_device.native())]


def _real_device(device) -> str:
    if _device.is_xla(device) or torch.device(device) == _device.native():
        return f"{_xr.device_type()}:{_xr.global_ordinal()}"
    raise RuntimeError(f"xla_real_devices: {device!r} is not this process's device ({_device.native()}, 'xla' under "
                       f"--xla-compat): an SPMD program sees one device")


def xla_real_devices(devices=None) -> list[str]:
    """The devices' names as torch_xla gives them (``'CPU:0'``): this process's device, whose
    number is its rank (one process per device). ``devices`` defaults to this process's."""
    return [_real_device(d) for d in (devices or get_xla_supported_devices())]


def xla_replication_devices(local_devices=None) -> list[str]:
    """The devices a replicated computation runs on: this process's one device, as torch_xla's
    one process sees under SPMD (``xr.world_size()`` is 1). ``local_devices`` must name this
    process's device (it defaults to it)."""
    real = xla_real_devices(local_devices)
    if len(real) != 1:
        raise RuntimeError(f"Cannot replicate if number of devices ({len(real)}) is different from 1 (an SPMD "
                           f"program sees one device)")
    return real


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """End the step: the closures queued by ``add_step_closure`` run."""
    _steps.end_step()
    if wait:
        wait_device_ops()


def add_step_closure(closure, args=(), run_async: bool = False) -> None:
    """Run ``closure(*args)`` when the step ends (``mark_step``, leaving ``torch_xla.step()``)."""
    _steps.add_closure(closure, args, run_async)


def optimizer_step(optimizer, barrier: bool = False, optimizer_args: dict | None = None, groups=None,
                   pin_layout: bool = True):
    """``optimizer.step(**optimizer_args)``. Under SPMD the gradients are those of the
    global batch already (no reduction is needed: ``groups``, the replica groups of that
    reduction, and ``pin_layout`` have nothing to do); ``barrier=True`` also ends the step."""
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


def send_cpu_data_to_device(datas, device, input_sharding=None):
    """The CPU tensors in ``datas`` (a tensor, or a structure of them) on ``device``, laid out by
    ``input_sharding`` (a ``ShardingSpec``, as ``MpDeviceLoader`` takes) when given: each is the
    global value, and each process keeps its block. A single tensor comes back in a list, as
    torch_xla gives it."""
    if isinstance(datas, torch.Tensor):
        datas = [datas]
    target = _device.native()
    moved = tree_map(lambda t: t.to(target) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, datas)
    return moved if input_sharding is None else shard_batch(moved, input_sharding, target)


def wait_device_ops(devices=()) -> None:
    accelerators.synchronize(_device.native())


def get_ordinal(defval: int = 0) -> int:
    return _xr.global_ordinal()


def get_local_ordinal(defval: int = 0) -> int:
    return _xr.local_ordinal()


def world_size(defval: int = 1) -> int:
    return _xr.world_size()


xrt_world_size = world_size


def is_master_ordinal(local: bool = True) -> bool:
    """True in the process that speaks for the program (rank 0; local: rank 0 of its host).
    A block under it runs in that process only: no collective (e.g. reading a sharded
    tensor's value) may be inside it."""
    ordinal = _xr.local_ordinal() if local else _xr.global_ordinal()
    return ordinal == 0


def master_print(*args, fd=sys.stdout, local: bool = False, flush: bool = False) -> None:
    """Print once for the whole program (``local``: once per host)."""
    if is_master_ordinal(local=local):
        print(*args, file=fd, flush=flush)


def rendezvous(tag: str, payload: bytes = b"", replicas=()) -> list[bytes]:
    """Wait for every process of the job (torch_xla: every host's process) and return
    their payloads, the payload of process ``i`` at position ``i``. Every process runs
    the one program, so every process calls it; ``replicas`` may only name all of them."""
    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"rendezvous(payload=...): expected bytes, got {type(payload).__name__}")
    n = dist.get_world_size() if dist.is_initialized() else 1
    if replicas and sorted(replicas) != list(range(n)):

        raise SpmdError(f"rendezvous(replicas={list(replicas)!r}): a rendezvous of some of the {n} processes is "
                        f"not provided under --xla-compat (every process runs the one program); leave replicas "
                        f"empty")
    if n == 1:
        return [bytes(payload)]
    gathered: list = [None] * n
    dist.all_gather_object(gathered, bytes(payload))
    return gathered


def optimization_barrier_(tensors) -> None:
    """Nothing: a barrier to XLA's fusion of operations; the native engine runs them as
    issued."""


def _gathered(data):
    from torch.distributed.tensor import DTensor

    if isinstance(data, DTensor):
        return data.full_tensor().detach().cpu()
    if isinstance(data, torch.Tensor):
        return data.detach().cpu()
    if isinstance(data, dict):
        return type(data)((k, _gathered(v)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        out = [_gathered(v) for v in data]
        return type(data)(out) if not hasattr(data, "_fields") else type(data)(*out)
    return data


def save(data, file_or_path, master_only: bool = True, global_master: bool = False) -> None:
    """``torch.save`` of CPU copies of whole tensors (sharded ones are gathered: every
    process must call it). With ``master_only`` (the default) rank 0 writes."""

    with engines.planned().quiet_gathers():
        cpu = _gathered(data)
    if not master_only or (dist.get_rank() if dist.is_initialized() else 0) == 0:
        torch.save(cpu, file_or_path)
    if dist.is_initialized():
        dist.barrier()


class RateTracker:
    """Items per second, smoothed (torch_xla's ``RateTracker``)."""

    def __init__(self, smooth_factor: float | None = None):
        if smooth_factor is None:
            smooth_factor = float(os.environ.get("RATE_TRACKER_SMOOTHING", "0.4"))
        self._smooth_factor = smooth_factor
        self._start_time = time.time()
        self._partial_time = self._start_time
        self._partial_count = 0.0
        self._partial_rate: float | None = None
        self._count = 0.0

    def _update(self, now: float, rate: float) -> None:
        self._partial_count += self._count
        self._count = 0.0
        self._partial_time = now
        self._partial_rate = rate

    def add(self, count: float) -> None:
        self._count += count

    def _smooth(self, current_rate: float) -> float:
        if self._partial_rate is None:
            return current_rate
        return current_rate * (1.0 - self._smooth_factor) + self._partial_rate * self._smooth_factor

    def rate(self) -> float:
        now = time.time()
        delta = now - self._partial_time
        report_rate = 0.0
        if delta > 0:
            report_rate = self._smooth(self._count / delta)
            self._update(now, report_rate)
        return report_rate

    def global_rate(self) -> float:
        delta = time.time() - self._start_time
        count = self._partial_count + self._count
        return count / delta if delta > 0 else 0.0


def unlazy(tensors) -> None:
    """Nothing to do: the native engine's tensors are computed when issued."""


__getattr__ = not_provided("torch_xla.core.xla_model")
