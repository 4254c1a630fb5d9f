"""Partition specs, ``mark_sharding``, ``ShardingSpec`` and sharding visualisation.

A partition spec has one entry per tensor dim:

* an axis name (``'data'``) or an axis index (``0``): that dim is split over the axis;
* ``None``: that dim is not split;
* a tuple of axes (``('data', 'fsdp')``): that dim is split over several axes, the
  first one outermost (axes must appear in the mesh's order).

Mesh axes not named in the spec replicate the tensor. A dim whose size does not
divide evenly is split like ``torch.chunk``: every device but the last ones gets
``ceil(size / devices)`` rows, the last ones fewer (possibly none).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Tuple, Union

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from torchspmd import _boundary, _owners, _stale, runtime
from torchspmd._delegate import OnXla, on_xla
from torchspmd._chunks import block_of, tile_shape
from torchspmd._chunks import contiguous_stride as _contiguous_stride
from torchspmd._errors import SpmdError
from torchspmd.mesh import Mesh

_owners.install()

__all__ = [
    "mark_sharding",
    "clear_sharding",
    "get_sharding",
    "ShardingSpec",
    "visualize_sharding",
    "visualize_tensor_sharding",
]

PartitionSpec = Tuple[Union[str, int, None, Tuple[Union[str, int], ...]], ...]


def _axis_index(mesh: Mesh, entry: Any, where: str) -> int:
    if type(entry) is int:
        if not 0 <= entry < mesh.ndim:
            raise SpmdError(
                f"{where}: mesh axis index {entry} is out of range for {mesh!r}, which has "
                f"{mesh.ndim} axes (0..{mesh.ndim - 1})"
            )
        return entry
    if type(entry) is str:
        idx = mesh.get_axis_name_idx(entry)
        if idx is None:
            known = mesh.axis_names if mesh.axis_names is not None else "none (the mesh is unnamed)"
            raise SpmdError(f"{where}: axis name {entry!r} is not defined in the mesh; its axes are {known}")
        return idx
    raise SpmdError(
        f"{where}: spec type {type(entry).__name__} ({entry!r}) is not supported; use an axis name, "
        f"an axis index, None, or a tuple of axes"
    )


def resolve_partition_spec(mesh: Mesh, partition_spec: Any, ndim: int | None = None, api: str = "partition_spec",
                           mesh_order: bool = True):
    """Check ``partition_spec`` against ``mesh`` (and a tensor of ``ndim`` dims) and return,
    per tensor dim, the tuple of mesh axis indices that split it. ``mesh_order``: the axes
    of a tuple entry must follow the mesh's order (DTensor's limit; XLA has none)."""
    if not isinstance(mesh, Mesh):
        raise SpmdError(f"{api}: mesh must be a torchspmd Mesh, got {type(mesh).__name__}")
    if not isinstance(partition_spec, (tuple, list)):
        raise SpmdError(
            f"{api}: partition_spec must be a tuple with one entry per tensor dim, got {partition_spec!r}"
        )
    spec = tuple(partition_spec)
    if ndim is not None and len(spec) != ndim:
        raise SpmdError(
            f"{api}: Partition spec length ({len(spec)}) should be equal to the input rank ({ndim}); "
            f"spec {spec} needs one entry per tensor dim"
        )
    resolved: list[tuple[int, ...]] = []
    used: dict[int, int] = {}
    for dim, entry in enumerate(spec):
        where = f"{api}: partition_spec[{dim}]"
        if entry is None:
            axes: tuple[int, ...] = ()
        elif type(entry) in (tuple, list):
            if any(type(x) in (tuple, list) for x in entry):
                raise SpmdError(f"{where} = {entry!r}: partition spec cannot contain nested tuples")
            axes = tuple(_axis_index(mesh, x, where) for x in entry)
            if mesh_order and list(axes) != sorted(axes):
                names = tuple(mesh.shape().keys())
                ordered = tuple(entry[i] for i in sorted(range(len(axes)), key=lambda i: axes[i]))
                raise SpmdError(
                    f"{where} = {entry!r}: the axes of a tuple must appear in the mesh's order {names}: DTensor "
                    f"splits a dim over several mesh axes outermost-first in mesh order, and one tensor cannot "
                    f"use another device order than the mesh's. Write {ordered!r} (the same values; only which "
                    f"device holds which block differs), or build the mesh with its axes in the tuple's order"
                )
        else:
            axes = (_axis_index(mesh, entry, where),)
        for a in axes:
            if a in used:
                raise SpmdError(
                    f"{api}: mesh axis {mesh.axis_label(a)!r} appears in partition_spec[{used[a]}] and "
                    f"partition_spec[{dim}]; each mesh axis can shard at most one tensor dim, once"
                )
            used[a] = dim
        resolved.append(axes)
    return tuple(resolved)


def spec_to_placements(mesh: Mesh, resolved) -> list[Placement]:
    """DTensor placements (one per mesh axis) for a resolved partition spec."""
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for dim, axes in enumerate(resolved):
        for a in axes:
            placements[a] = Shard(dim)
    return placements


def _coord_of(mesh: Mesh, rank: int) -> tuple[int, ...]:
    import numpy as np

    where = np.argwhere(mesh.get_logical_mesh() == rank)
    return tuple(int(i) for i in where[0])


@on_xla
def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> DTensor:
    """Shard ``t`` over ``mesh`` as ``partition_spec`` says and return it as a DTensor of the
    same global shape.

    ``t`` holds the global value (the same on every process, as in one program; rank 0's
    copy is the one distributed). A DTensor is re-laid out. A tensor inside autograd
    (an activation) stays differentiable. An ``nn.Parameter`` comes back as an
    ``nn.Parameter``: assign it back to its module (``m.weight = mark_sharding(m.weight,
    ...)``) before building the optimizer.

    Inside a wrapped module's forward (FSDPv2, ``ts.replicate``, the automatic data-parallel
    path's local calls) an activation is this process's share already: it is returned as it
    is (the spec is still checked against the mesh).

    On the XLA backend torch_xla annotates ``t`` in place and ``t`` itself is returned
    (moved to the device first if it was a CPU tensor).
    """
    runtime._require_spmd("mark_sharding")
    if not isinstance(t, torch.Tensor):
        raise SpmdError(f"mark_sharding: t must be a torch.Tensor, got {type(t).__name__}")
    resolved = resolve_partition_spec(mesh, partition_spec, t.dim(), "mark_sharding")
    placements = spec_to_placements(mesh, resolved)
    dmesh = mesh.device_mesh
    if not isinstance(t, DTensor):
        marked = _boundary.mark_local_output(t, dmesh, placements)
        if marked is not None:  # inside a shard_output callable: t is this process's block
            return marked
    if _boundary.in_local_compute():
        # An activation annotated inside a wrapped module's forward (torch_xla programs
        # constrain activations so): it is this process's share of the global value already
        # (or a tensor-parallel layer's own DTensor), and an annotation changes no value.
        return t
    if isinstance(t, DTensor):
        if _stale.made_by_fsdp(t):
            raise SpmdError(
                "mark_sharding: this parameter was made by FSDPv2 (its shard of a parameter); annotate the "
                "model's parameters before wrapping it: ts.mark_sharding(model.layer.weight, mesh, spec), then "
                "FSDPv2(model, ...)"
            )
        if t.device_mesh != dmesh:
            raise SpmdError(
                "mark_sharding: the tensor is already sharded over another mesh; call clear_sharding(t) first"
            )
        out = t.redistribute(dmesh, placements)
    elif t.requires_grad and not t.is_leaf:
        out = DTensor.from_local(t, dmesh, [Replicate()] * dmesh.ndim, run_check=False).redistribute(
            dmesh, placements
        )
    else:
        out = distribute_tensor(t.detach(), dmesh, placements)
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
            _stale.mark_replaced(t, "a parameter that mark_sharding replaced with a sharded one")
        # In place, as torch_xla: every module slot holding `t` (a parameter or a buffer)
        # now holds the sharded tensor, so the result need not be assigned back.
        _owners.replace(t, out)
    return out


class _MarkWithGradients(torch.autograd.Function):
    """The value re-laid out as ``placements``; backward lays its gradient out the same way
    (which is also the gradient its input receives)."""

    @staticmethod
    def forward(ctx, t, dmesh, placements):
        ctx.dmesh, ctx.placements = dmesh, placements
        return t.redistribute(dmesh, placements)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(ctx.placements):
            grad = grad.redistribute(ctx.dmesh, ctx.placements)
        return grad, None, None


@on_xla
def mark_sharding_with_gradients(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> DTensor:
    """torch_xla's ``mark_sharding_with_gradients``: a new tensor (``t`` is not changed) with
    ``t``'s value sharded as ``partition_spec``, whose gradient in backward is sharded the
    same way, and so is the gradient ``t`` receives when ``t`` is a DTensor (a plain tensor
    gets its gradient whole, as every plain tensor in the global view). Differentiable; for
    activations inside a model as much as for leaves."""
    runtime._require_spmd("mark_sharding_with_gradients")
    if not isinstance(t, torch.Tensor):
        raise SpmdError(f"mark_sharding_with_gradients: t must be a torch.Tensor, got {type(t).__name__}")
    resolved = resolve_partition_spec(mesh, partition_spec, t.dim(), "mark_sharding_with_gradients")
    placements = tuple(spec_to_placements(mesh, resolved))
    dmesh = mesh.device_mesh
    if _boundary.in_local_compute():
        return t  # an activation inside a wrapped module's forward: see mark_sharding
    if isinstance(t, DTensor):
        if _stale.made_by_fsdp(t):
            raise SpmdError(
                "mark_sharding: this parameter was made by FSDPv2 (its shard of a parameter); annotate the "
                "model's parameters before wrapping it: ts.mark_sharding(model.layer.weight, mesh, spec), then "
                "FSDPv2(model, ...)"
            )
        if t.device_mesh != dmesh:
            raise SpmdError("mark_sharding_with_gradients: the tensor is sharded over another mesh; call "
                            "clear_sharding(t) first")
        source = t
    else:  # the whole value on every process: enters replicated (its gradient comes back whole)
        source = DTensor.from_local(t, dmesh, [Replicate()] * dmesh.ndim, run_check=False)
    return _MarkWithGradients.apply(source, dmesh, placements)


def _manual_mesh(mesh, who: str) -> Mesh:
    from torchspmd.mesh import get_global_mesh

    mesh = get_global_mesh() if mesh is None else mesh
    if mesh is None:
        raise SpmdError(f"{who}: no mesh: pass mesh=... or call set_global_mesh(mesh) first")
    return mesh


@on_xla
def enable_manual_sharding(t: torch.Tensor, partition_spec: PartitionSpec, *, mesh: Mesh | None = None) -> torch.Tensor:
    """torch_xla's manual sharding: ``t`` sharded as ``partition_spec`` (over ``mesh``, else the
    global mesh), then this process's shard as a plain tensor, for hand-written per-shard
    code (DTensor's ``local_map`` is the native counterpart). Like torch_xla's, the shard is
    padded with zeros to the tile size (``ceil(size / tiles)`` along each split dim), so every
    process's shard has the same shape. Differentiable. ``disable_manual_sharding`` makes a
    global tensor of the results."""
    runtime._require_spmd("enable_manual_sharding")
    mesh = _manual_mesh(mesh, "enable_manual_sharding")
    if not isinstance(t, torch.Tensor):
        raise SpmdError(f"enable_manual_sharding: t must be a torch.Tensor, got {type(t).__name__}")
    resolved = resolve_partition_spec(mesh, partition_spec, t.dim(), "enable_manual_sharding")
    placements = tuple(spec_to_placements(mesh, resolved))
    dmesh = mesh.device_mesh
    if not isinstance(t, DTensor):  # the global value, the same on every process (its gradient comes back whole)
        t = DTensor.from_local(t, dmesh, [Replicate()] * dmesh.ndim, run_check=False)
    local = t.redistribute(dmesh, placements).to_local()
    tile = tile_shape(t.shape, mesh.mesh_shape, resolved)
    pad = []
    for d in reversed(range(t.dim())):
        pad += [0, tile[d] - local.shape[d]]
    return torch.nn.functional.pad(local, pad) if any(pad) else local


@on_xla
def disable_manual_sharding(t: torch.Tensor, partition_spec: PartitionSpec, full_shape, *,
                            mesh: Mesh | None = None) -> DTensor:
    """The end of a manual region: this process's shard ``t`` (padded as
    ``enable_manual_sharding`` gives it, or exactly its block) as its part of a global tensor
    of ``full_shape`` sharded as ``partition_spec``. Differentiable."""
    runtime._require_spmd("disable_manual_sharding")
    mesh = _manual_mesh(mesh, "disable_manual_sharding")
    full_shape = tuple(int(s) for s in full_shape)
    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
        raise SpmdError("disable_manual_sharding: t must be this process's shard, a plain tensor (what "
                        "enable_manual_sharding gave, or computed from it)")
    if t.dim() != len(full_shape):
        raise SpmdError(f"disable_manual_sharding: full_shape {full_shape} has {len(full_shape)} dims, the shard "
                        f"{t.dim()}")
    resolved = resolve_partition_spec(mesh, partition_spec, len(full_shape), "disable_manual_sharding")
    placements = tuple(spec_to_placements(mesh, resolved))
    dmesh = mesh.device_mesh
    block = block_of(full_shape, mesh.mesh_shape, placements, dmesh.get_coordinate())
    tile = tile_shape(full_shape, mesh.mesh_shape, resolved)
    for d, (_, length) in enumerate(block):
        if t.shape[d] not in (length, tile[d]):
            raise SpmdError(f"disable_manual_sharding: the shard has {t.shape[d]} on dim {d}; for full_shape "
                            f"{full_shape} sharded as {partition_spec!r} a shard has {tile[d]} there (padded, "
                            f"as enable_manual_sharding gives it) or exactly its own block's size")
        if t.shape[d] != length:
            t = t.narrow(d, 0, length)
    return DTensor.from_local(t.contiguous(), dmesh, placements, run_check=False, shape=torch.Size(full_shape),
                              stride=_contiguous_stride(full_shape))


def _like_param(mesh, placements, grad):
    if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
        return grad.redistribute(mesh, placements)
    return grad


@on_xla
def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """Drop the sharding: the whole value as a plain tensor on every process. As torch_xla's
    (which clears the annotation in place), a parameter or buffer is replaced by its whole
    value in every module slot holding it."""
    if isinstance(t, DTensor):
        whole = t.full_tensor()
        if t.is_leaf:
            if isinstance(t, torch.nn.Parameter):
                whole = torch.nn.Parameter(whole.detach(), requires_grad=t.requires_grad)
                if _owners.slots(t):
                    _stale.mark_replaced(t, "a parameter that clear_sharding replaced with its whole value")
            _owners.replace(t, whole)
        return whole
    return t


@on_xla
def get_sharding(t: torch.Tensor) -> PartitionSpec | None:
    """The partition spec of a DTensor (axis names where the mesh has them), or None for a
    tensor that is not sharded. Pending reductions (``Partial``) are not shardings and
    are not shown. On the XLA backend the spec is read from torch_xla's annotation, against
    the global mesh."""
    if not isinstance(t, DTensor):
        return None
    names = t.device_mesh.mesh_dim_names
    per_dim: list[list] = [[] for _ in range(t.ndim)]
    for axis, p in enumerate(t.placements):
        if p.is_shard() or isinstance(p, _StridedShard):  # FSDP2's split of a dim 'model' splits too
            per_dim[p.dim].append(names[axis] if names else axis)
    return tuple(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in per_dim)


@dataclass
class ShardingSpec(metaclass=OnXla):
    """A reusable sharding: ``mesh`` and ``partition_spec``, checked at construction.

    ``minibatch=True`` (torch_xla's multi-host input mode) means each process's loader
    yields its own part of the global batch instead of the whole global batch.
    """

    _xla_factory = "sharding_spec"
    mesh: Mesh
    partition_spec: PartitionSpec
    minibatch: bool = False
    _resolved: tuple = field(init=False, repr=False)

    def __post_init__(self):
        self.partition_spec = tuple(self.partition_spec) if isinstance(self.partition_spec, list) else self.partition_spec
        self._resolved = resolve_partition_spec(self.mesh, self.partition_spec, None, "ShardingSpec")

    @property
    def placements(self) -> list[Placement]:
        return spec_to_placements(self.mesh, self._resolved)

    def can_apply(self, t: torch.Tensor) -> bool:
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> DTensor:
        return mark_sharding(t, self.mesh, self.partition_spec)


def _cells_of_hlo(text: str) -> dict[tuple, list[int]]:
    """The device grid of an HLO sharding text (``{devices=[2,2]0,1,2,3}``, ``... last_tile_dim_replicate}``,
    ``{replicated}``, ``''``), by its first two tile dims: ``{((row, 1), (col, 1)): devices}``."""
    def bad(why: str) -> SpmdError:
        return SpmdError(f"visualize_sharding({text!r}): {why}; give a tensor, or a sharding text such as "
                         f"'{{devices=[2,1]0,1}}' (torch_xla._XLAC._get_xla_sharding_spec(t))")

    body = text.strip()
    if body in ("", "{replicated}"):
        return {((0, 1), (0, 1)): list(range(runtime.global_runtime_device_count()))}
    if not (body.startswith("{devices=[") and body.endswith("}") and "]" in body):
        raise bad("not a sharding text")
    replicate = body.endswith(" last_tile_dim_replicate}")
    dims_text, ids_text = body[len("{devices=["):].split("]", 1)
    ids_text = ids_text[: -len(" last_tile_dim_replicate}")] if replicate else ids_text[:-1]
    try:
        dims = [int(d) for d in dims_text.split(",")]
        ids = [int(i) for i in ids_text.split(",")]
    except ValueError:
        raise bad("its tile dims and device ids must be integers") from None
    if math.prod(dims) != len(ids) or any(d < 1 for d in dims) or (replicate and len(dims) < 2):
        raise bad(f"{len(ids)} device ids for tile dims {dims}")
    tiles = dims[:-1] if replicate else dims
    grid = np.array(ids).reshape(tiles + [-1])  # the last axis: each tile's copies (one without)
    if len(tiles) == 1:
        grid = grid[None]  # a 1-D layout: one row
    rows, cols = grid.shape[0], grid.shape[1]
    grid = grid.reshape(rows, cols, -1)  # deeper tile dims: their devices in the cell of the first two
    return {((r, 1), (c, 1)): sorted(int(d) for d in grid[r, c]) for r in range(rows) for c in range(cols)}


@on_xla
def visualize_sharding(t: DTensor | str, use_color: bool = True):
    """Print which device holds which block of a 1-D or 2-D tensor; returns the rich table.
    ``t`` may also be an HLO sharding text, as torch_xla's ``visualize_sharding`` takes
    (its first two tile dims are shown)."""
    if isinstance(t, str):
        return _render_cells(_cells_of_hlo(t), runtime.device_type().upper(), use_color)
    if not isinstance(t, DTensor):
        raise SpmdError("visualize_sharding: t is not sharded (not a DTensor); call mark_sharding first")
    if t.ndim not in (1, 2):
        raise SpmdError(f"visualize_sharding: only 1-D and 2-D tensors can be shown, got {t.ndim}-D")
    dmesh = t.device_mesh
    mesh_shape = tuple(dmesh.shape)
    ranks = dmesh.mesh.flatten().tolist()
    shape = tuple(t.shape) if t.ndim == 2 else (1, t.shape[0])
    placements = [Shard(p.dim + 1) if (t.ndim == 1 and p.is_shard()) else p for p in t.placements]
    cells: dict[tuple, list[int]] = {}
    for flat, rank in enumerate(ranks):
        coord = []
        rest = flat
        for size in reversed(mesh_shape):
            coord.append(rest % size)
            rest //= size
        block = block_of(shape, mesh_shape, placements, tuple(reversed(coord)))
        if any(length == 0 for _, length in block):
            continue
        cells.setdefault(tuple(block), []).append(rank)
    return _render_cells(cells, dmesh.device_type.upper(), use_color)


def _render_cells(cells: dict[tuple, list[int]], kind: str, use_color: bool):
    """A table of ``{(row block, col block): devices}``, each block ``(start, length)``."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rows = sorted({b[0] for b in cells})
    cols = sorted({b[1] for b in cells})
    table = Table(show_header=False, show_lines=True, box=box.SQUARE, padding=(0, 1))
    palette = ["red", "green", "blue", "magenta", "cyan", "yellow", "bright_red", "bright_green"]
    for c in cols:
        table.add_column(justify="center", ratio=max(1, c[1]))
    for r in rows:
        row = []
        for c in cols:
            devs = cells.get((r, c), [])
            label = f"{kind} {','.join(map(str, sorted(devs)))}" if devs else ""
            style = palette[(rows.index(r) * len(cols) + cols.index(c)) % len(palette)] if use_color else None
            row.append(Text(label, style=f"on {style}" if style else ""))
        table.add_row(*row)
    Console().print(table)
    return table


@on_xla
def visualize_tensor_sharding(t: DTensor, use_color: bool = True):
    """torch_xla's name for ``visualize_sharding``."""
    return visualize_sharding(t, use_color)
