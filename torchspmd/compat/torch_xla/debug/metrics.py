"""``torch_xla.debug.metrics`` under ``--xla-compat``: a report of what torchspmd knows.

The native engine compiles no XLA graphs and falls back to no CPU op, so torch_xla's
counters and metrics do not exist here: ``counter_names()`` / ``metric_names()`` are
empty, ``counter_value`` / ``metric_data`` are None. ``metrics_report()`` says the engine,
the devices, the steps ended and the device memory peak."""

from __future__ import annotations

import resource

import torch

from torchspmd import accelerators
from torchspmd import runtime as _rt
from torchspmd.compat import _device
from torchspmd.compat.stand_ins import not_provided


def counter_names() -> list[str]:
    return []


def counter_value(name: str):
    return None


def metric_names() -> list[str]:
    return []


def metric_data(name: str):
    return None


def executed_fallback_ops() -> list[str]:
    return []


def clear_counters() -> None:
    pass


def clear_metrics() -> None:
    pass


def clear_all() -> None:
    pass


def metrics_report() -> str:

    dev = _device.native()
    lines = [
        "torchspmd --xla-compat (PyTorch's engine: operations run eagerly, no XLA graphs are compiled)",
        f"Engine: {_rt.backend() if _rt.is_spmd() else 'not started (use_spmd not called)'}",
        f"Device: {dev}",
        f"Devices in the job: {_rt.global_runtime_device_count() if _rt.is_spmd() else 1}",
        f"Steps ended: {_rt.current_step()}",
    ]
    peak = accelerators.max_memory_allocated(dev)
    if peak is not None:
        lines.append(f"Peak device memory: {peak / 2**20:.1f} MiB")
    else:
        lines.append(f"Peak process memory (RSS): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB")
    return "\n".join(lines) + "\n"


def short_metrics_report(counter_names: list | None = None, metric_names: list | None = None) -> str:
    return metrics_report()


__getattr__ = not_provided("torch_xla.debug.metrics")
