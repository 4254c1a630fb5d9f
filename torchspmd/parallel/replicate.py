"""``replicate``: data parallelism with replicated parameters, and the automatic path.

On the native engine the module computes on each process's rows of the global batch and
its gradients are summed in buckets by PyTorch's own DistributedDataParallel reducer
(through shared memory when the processes share one machine: docs/data_parallel.md, *Gradient
sums*); the same path is taken without the wrapper (the
automatic data-parallel path, ``set_auto_replicate``). On the torch_xla engine GSPMD
partitions the step and reduces the gradients itself.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.nn as nn

from torchspmd import engines
from torchspmd.errors import SpmdError
from torchspmd.mesh import Mesh, as_view, get_1d_mesh, get_global_mesh

__all__ = ["replicate", "set_auto_replicate", "auto_path"]


def replicate(
    module: nn.Module,
    mesh: Mesh | None = None,
    *,
    data_axes: Sequence[str | int] | None = None,
    shard_output: Callable | None = None,
    **ddp_kwargs,
) -> nn.Module:
    """Data-parallel ``module`` in place (parameters replicated, gradients summed in buckets
    by DDP's reducer) and return it; its ``state_dict`` keys are unchanged.

    Args:
        mesh: default: the global mesh, else all devices on one axis.
        data_axes: the mesh axes that split the batch (default: every axis).
        shard_output: ``fn(output, mesh)`` returning the output as global DTensors, for
            outputs whose dim 0 is not the batch.
        ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``).
    """
    engine = engines.current("replicate")
    mesh = mesh or get_global_mesh() or get_1d_mesh("data")
    view = as_view(mesh, "replicate(mesh=...)")
    if data_axes is None:
        dims = list(range(view.ndim))
    else:
        dims = []
        for a in data_axes:
            idx = a if type(a) is int else view.get_axis_name_idx(a)
            if idx is None or not 0 <= idx < view.ndim:
                raise SpmdError(f"replicate(data_axes=...): axis {a!r} is not in {view!r}")
            dims.append(idx)
        dims = sorted(set(dims))
    if len(dims) > 1 and view.axis_names is None:
        raise SpmdError("replicate: several data axes need a mesh with axis names")
    return engine.replicate(module, mesh, dims, shard_output, ddp_kwargs)


def set_auto_replicate(enabled: bool | None) -> bool | None:
    """Turn the automatic data-parallel path on or off (default on; without a call, the
    environment variable ``TORCHSPMD_AUTO_REPLICATE=0`` turns it off, read each time the
    path is asked, so a program that sets it before its first call is obeyed even in a
    worker that imported torchspmd earlier). ``None`` goes back to the environment's
    setting. Returns the previous setting (``None``: it followed the environment), so
    ``set_auto_replicate(previous)`` restores it. Off, a module without a wrapper always
    computes through DTensor. Every process must make the same call at the same point of
    the program. (The native engine's path: on the torch_xla engine GSPMD partitions every
    step.)"""
    return engines.planned().set_auto_replicate(enabled)


def auto_path(module: nn.Module) -> dict:
    """What the automatic path decided for ``module``: ``{kind of call: True (local
    compute, DDP's reducer) or False (through DTensor)}``; empty when it never looked."""
    return engines.planned().auto_path(module)
