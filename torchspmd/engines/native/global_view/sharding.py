"""Partition specs as DTensor layouts: the native engine's ``mark_sharding`` and its family.

A checked partition spec (per tensor dim, the mesh axes splitting it) becomes DTensor
placements: ``Shard(dim)`` on each axis that splits ``dim``, ``Replicate()`` on the others;
where a dim split over several axes would then get other blocks than XLA gives it, the
tensor lives on a tiling mesh instead (``flat_tiling``).
Annotating a parameter or buffer replaces the tensor in every module slot that holds it
(``module_slots``), as torch_xla's in-place annotation does.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard

from torchspmd.layouts.blocks import block_of, contiguous_stride, tile_shape
from torchspmd.engines.native.global_view import flat_tiling, module_edges, module_slots, replaced_parameters
from torchspmd.engines.native.start.device_mesh import device_mesh
from torchspmd.errors import ShardingStateError, SpmdError

_MADE_BY_FSDP = ("mark_sharding: this parameter was made by FSDPv2 (its shard of a parameter); annotate the model's "
                 "parameters before wrapping it: ts.mark_sharding(model.layer.weight, mesh, spec), then "
                 "FSDPv2(model, ...)")


def placements(mesh, resolved) -> list[Placement]:
    """DTensor placements (one per mesh axis) for a resolved partition spec."""
    out: list[Placement] = [Replicate()] * len(mesh.mesh_shape)
    for dim, axes in enumerate(resolved):
        for a in axes:
            out[a] = Shard(dim)
    return out


def coordinate(mesh, rank: int) -> tuple[int, ...]:
    """The mesh coordinate of process ``rank``."""
    where = np.argwhere(mesh.get_logical_mesh() == rank)
    return tuple(int(i) for i in where[0])


def mark_sharding(t: torch.Tensor, mesh, resolved) -> DTensor:
    """``t`` re-laid out as a DTensor (see ``torchspmd.sharding.mark_sharding``)."""
    dmesh, layout = flat_tiling.layout(mesh, resolved, t.shape)
    if not isinstance(t, DTensor):
        marked = module_edges.mark_local_output(t, device_mesh(mesh), placements(mesh, resolved))
        if marked is not None:  # inside a shard_output callable: t is this process's block
            return marked
    if module_edges.in_local_compute():
        # An activation annotated inside a wrapped module's forward (torch_xla programs
        # constrain activations so): it is this process's share of the global value already
        # (or a tensor-parallel layer's own DTensor), and an annotation changes no value.
        return t
    if isinstance(t, DTensor):
        if replaced_parameters.made_by_fsdp(t):
            raise SpmdError(_MADE_BY_FSDP)
        if flat_tiling.root_of(t.device_mesh) != device_mesh(mesh):
            raise ShardingStateError("mark_sharding: the tensor is already sharded over another mesh; call "
                                     "clear_sharding(t) first")
        out = flat_tiling.relaid(t, dmesh, layout)
    elif t.requires_grad and not t.is_leaf:
        whole = DTensor.from_local(_plain(t), device_mesh(mesh), [Replicate()] * len(mesh.mesh_shape),
                                   run_check=False)
        out = flat_tiling.relaid(whole, dmesh, layout)
    else:
        out = flat_tiling.as_tiled(distribute_tensor(_plain(t.detach()), dmesh, list(layout)))
        if t.requires_grad:
            out.requires_grad_(True)
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        if out.requires_grad:
            # The gradient is stored as the parameter is (DTensor's backward may leave it
            # whole, or as a pending sum): so is the optimizer state computed from it.
            out.register_hook(functools.partial(_like_param, out.device_mesh, tuple(out.placements)))
    if t.is_leaf:
        if isinstance(t, torch.nn.Parameter):
            replaced_parameters.mark_replaced(t, "a parameter that mark_sharding replaced with a sharded one")
        # In place, as torch_xla: every module slot holding `t` (a parameter or a buffer)
        # now holds the sharded tensor, so the result need not be assigned back.
        module_slots.replace(t, out)
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (the same data and place in autograd): a subclass of a program's
    (under --xla-compat, a tensor on 'xla') never becomes a DTensor's local tensor."""
    return t if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) else t.as_subclass(torch.Tensor)


def _like_param(mesh, layout, grad):
    if isinstance(grad, DTensor) and (grad.device_mesh != mesh or tuple(grad.placements) != layout):
        return flat_tiling.relaid(grad, mesh, layout)
    return grad


def untile_parameters(module: torch.nn.Module) -> None:
    """Parameters of ``module`` annotated with XLA's flat tiling (``flat_tiling``) laid out
    on the mesh (the same values, split axis by axis), in every slot holding them: FSDPv2
    and tensor parallelism work on the mesh's own DeviceMesh."""
    for p in {id(q): q for q in module.parameters()}.values():
        if not isinstance(p, DTensor) or flat_tiling.tiling_of(p.device_mesh) is None:
            continue
        with torch.no_grad():
            whole = flat_tiling.on_root(p.detach())
        new = torch.nn.Parameter(whole, requires_grad=p.requires_grad)
        if new.requires_grad:
            new.register_hook(functools.partial(_like_param, new.device_mesh, tuple(new.placements)))
        replaced_parameters.mark_replaced(p, "a parameter laid out on the mesh when FSDPv2 wrapped it")
        module_slots.replace(p, new)


class _MarkWithGradients(torch.autograd.Function):
    """The value re-laid out as ``placements``; backward lays its gradient out the same way
    (which is also the gradient its input receives)."""

    @staticmethod
    def forward(ctx, t, dmesh, layout):
        ctx.dmesh, ctx.layout, ctx.source = dmesh, layout, t.device_mesh
        with torch.no_grad():
            return flat_tiling.relaid(t, dmesh, layout)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            with torch.no_grad():
                if grad.device_mesh != ctx.dmesh or tuple(grad.placements) != tuple(ctx.layout):
                    grad = flat_tiling.relaid(grad, ctx.dmesh, ctx.layout)
                if grad.device_mesh != ctx.source:  # flat-tiled: the input's mesh splits it axis by axis
                    grad = flat_tiling.on_root(grad)
        return grad, None, None


def mark_sharding_with_gradients(t: torch.Tensor, mesh, resolved) -> torch.Tensor:
    dmesh, layout = flat_tiling.layout(mesh, resolved, t.shape)
    if module_edges.in_local_compute():
        return t  # an activation inside a wrapped module's forward: see mark_sharding
    if isinstance(t, DTensor):
        if replaced_parameters.made_by_fsdp(t):
            raise SpmdError(_MADE_BY_FSDP)
        if flat_tiling.root_of(t.device_mesh) != device_mesh(mesh):
            raise SpmdError("mark_sharding_with_gradients: the tensor is sharded over another mesh; call "
                            "clear_sharding(t) first")
        source = t
    else:  # the whole value on every process: enters replicated (its gradient comes back whole)
        root = device_mesh(mesh)
        source = DTensor.from_local(t, root, [Replicate()] * root.ndim, run_check=False)
    return _MarkWithGradients.apply(source, dmesh, layout)


def enable_manual_sharding(t: torch.Tensor, mesh, resolved) -> torch.Tensor:
    dmesh, layout = flat_tiling.layout(mesh, resolved, t.shape)
    if not isinstance(t, DTensor):  # the global value, the same on every process (its gradient comes back whole)
        root = device_mesh(mesh)
        t = DTensor.from_local(t, root, [Replicate()] * root.ndim, run_check=False)
    local = flat_tiling.relaid(t, dmesh, layout).to_local()
    tile = tile_shape(t.shape, mesh.mesh_shape, resolved)
    pad = []
    for d in reversed(range(t.dim())):
        pad += [0, tile[d] - local.shape[d]]
    return torch.nn.functional.pad(local, pad) if any(pad) else local


def disable_manual_sharding(t: torch.Tensor, mesh, spec, resolved, full_shape: tuple[int, ...]) -> DTensor:
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        raise SpmdError("disable_manual_sharding: t must be this process's shard, a plain tensor (what "
                        "enable_manual_sharding gave, or computed from it)")
    dmesh, layout = flat_tiling.layout(mesh, resolved, full_shape)
    block = block_of(full_shape, tuple(dmesh.shape), layout, dmesh.get_coordinate())
    tile = tile_shape(full_shape, mesh.mesh_shape, resolved)
    for d, (_, length) in enumerate(block):
        if t.shape[d] not in (length, tile[d]):
            raise SpmdError(f"disable_manual_sharding: the shard has {t.shape[d]} on dim {d}; for full_shape "
                            f"{full_shape} sharded as {spec!r} a shard has {tile[d]} there (padded, as "
                            f"enable_manual_sharding gives it) or exactly its own block's size")
        if t.shape[d] != length:
            t = t.narrow(d, 0, length)
    return flat_tiling.as_tiled(DTensor.from_local(t.contiguous(), dmesh, layout, run_check=False,
                                                   shape=torch.Size(full_shape), stride=contiguous_stride(full_shape)))


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        whole = t.full_tensor()
        if t.is_leaf:
            if isinstance(t, torch.nn.Parameter):
                whole = torch.nn.Parameter(whole.detach(), requires_grad=t.requires_grad)
                if module_slots.slots(t):
                    replaced_parameters.mark_replaced(t, "a parameter that clear_sharding replaced with its whole "
                                                         "value")
            module_slots.replace(t, whole)
        return whole
    return t


def get_sharding(t: torch.Tensor) -> tuple | None:
    if not isinstance(t, DTensor):
        return None
    root = flat_tiling.root_of(t.device_mesh)
    names = root.mesh_dim_names
    per_dim: list[list] = [[] for _ in range(t.ndim)]
    for members, p in zip(flat_tiling.root_axes(t.device_mesh), t.placements):
        if p.is_shard() or isinstance(p, _StridedShard):  # FSDP2's split of a dim 'model' splits too
            per_dim[p.dim] += [names[axis] if names else axis for axis in members]
    return tuple(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in per_dim)


def sharding_cells(t: torch.Tensor) -> tuple[dict, str]:
    """``{(row block, col block): devices}`` of a 1-D or 2-D DTensor, and the device kind."""
    if not isinstance(t, DTensor):
        raise SpmdError("visualize_sharding: t is not sharded (not a DTensor); call mark_sharding first")
    if t.ndim not in (1, 2):
        raise SpmdError(f"visualize_sharding: only 1-D and 2-D tensors can be shown, got {t.ndim}-D")
    dmesh = t.device_mesh
    mesh_shape = tuple(dmesh.shape)
    ranks = dmesh.mesh.flatten().tolist()
    shape = tuple(t.shape) if t.ndim == 2 else (1, t.shape[0])
    layout = [Shard(p.dim + 1) if (t.ndim == 1 and p.is_shard()) else p for p in t.placements]
    cells: dict[tuple, list[int]] = {}
    for flat, rank in enumerate(ranks):
        coord = []
        rest = flat
        for size in reversed(mesh_shape):
            coord.append(rest % size)
            rest //= size
        block = block_of(shape, mesh_shape, layout, tuple(reversed(coord)))
        if any(length == 0 for _, length in block):
            continue
        cells.setdefault(tuple(block), []).append(rank)
    return cells, dmesh.device_type.upper()
