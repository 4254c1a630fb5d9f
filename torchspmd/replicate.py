"""``replicate``: data parallelism with replicated parameters, as fast as DDP.

The module computes on each process's rows of the global batch; its gradients are
all-reduced in buckets that overlap with the backward pass, by PyTorch's own
DistributedDataParallel reducer. Inputs and outputs stay global DTensors.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from torchspmd import _global_view, runtime
from torchspmd._boundary import inputs_to_local, local_rows_stream, outputs_to_global
from torchspmd._delegate import on_xla
from torchspmd._errors import SpmdError
from torchspmd.mesh import Mesh, get_1d_mesh, get_global_mesh

__all__ = ["replicate"]


def _sum_allreduce_hook(group, bucket):
    # The global-mean loss already divides by the global batch: sum, do not average.
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class _ReplicateState:
    def __init__(self, module, mesh: Mesh, data_dims: list[int], shard_output, ddp_kwargs):
        dmesh = mesh.device_mesh
        if len(data_dims) == 1:
            group = dmesh.get_group(data_dims[0])
        else:
            names = [mesh.axis_names[d] for d in data_dims]
            group = dmesh[tuple(names)]._flatten().get_group()
        params = [p for p in module.parameters() if p.requires_grad]
        self.ddp = DistributedDataParallel(nn.ParameterList(params), process_group=group, **ddp_kwargs)
        self.ddp.register_comm_hook(group, _sum_allreduce_hook)
        self.dmesh = dmesh
        self.mesh = mesh
        self.data_dims = data_dims
        self.shard_output = shard_output
        self.layout = None
        self.suspended = None
        self.stream = None

    def pre(self, module, args, kwargs):
        args, kwargs, self.layout = inputs_to_local(args, kwargs, self.dmesh, self.data_dims, "replicate")
        self.suspended = _global_view.suspend()  # local compute: no lifting needed (see _global_view)
        self.stream = local_rows_stream(self.layout, self.data_dims)  # dropout: this process's rows' own stream
        self.stream.__enter__()
        DistributedDataParallel._active_ddp_module = self.ddp
        return self.ddp._pre_forward(*args, **kwargs)

    def leave_local(self, module, args, kwargs, output):
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.__exit__(None, None, None)
        _global_view.resume(self.suspended)
        self.suspended = None

    def post(self, module, args, kwargs, output):
        DistributedDataParallel._active_ddp_module = None
        output = self.ddp._post_forward(output)
        if self.shard_output is not None:
            return self.shard_output(output, self.mesh) or output
        return outputs_to_global(output, self.layout, "replicate")


@on_xla
def replicate(
    module: nn.Module,
    mesh: Mesh | None = None,
    *,
    data_axes: Sequence[str | int] | None = None,
    shard_output: Callable | None = None,
    **ddp_kwargs,
) -> nn.Module:
    """Data-parallel ``module`` in place (parameters replicated, gradients all-reduced in
    overlapped buckets by DDP's reducer) and return it; its ``state_dict`` keys are
    unchanged.

    Args:
        mesh: default: the global mesh, else all devices on one axis.
        data_axes: the mesh axes that split the batch (default: every axis).
        shard_output: ``fn(output, mesh)`` returning the output as global DTensors, for
            outputs whose dim 0 is not the batch.
        ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``).
    """
    runtime._require_spmd("replicate")
    if getattr(module, "_torchspmd_replicate", None) is not None:
        raise SpmdError("replicate: this module is already replicated")
    mesh = mesh or get_global_mesh() or get_1d_mesh("data")
    if data_axes is None:
        dims = list(range(mesh.ndim))
    else:
        dims = []
        for a in data_axes:
            idx = a if type(a) is int else mesh.get_axis_name_idx(a)
            if idx is None or not 0 <= idx < mesh.ndim:
                raise SpmdError(f"replicate(data_axes=...): axis {a!r} is not in {mesh!r}")
            dims.append(idx)
        dims = sorted(set(dims))
    if len(dims) > 1 and mesh.axis_names is None:
        raise SpmdError("replicate: several data axes need a mesh with axis names")
    state = _ReplicateState(module, mesh, dims, shard_output, ddp_kwargs)
    module._torchspmd_replicate = state
    module.register_forward_pre_hook(state.pre, with_kwargs=True)
    module.register_forward_hook(state.leave_local, with_kwargs=True, always_call=True)
    module.register_forward_hook(state.post, with_kwargs=True)
    return module
