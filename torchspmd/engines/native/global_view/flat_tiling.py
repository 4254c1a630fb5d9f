"""XLA's tiling of a dim split over several mesh axes, as DTensors.

torch_xla tiles a dim that a partition spec splits over several mesh axes (a tuple entry)
flat: ``ceil(size / product of the axes)`` per device, devices numbered along the axes in
the tuple's order. DTensor splits such a dim axis by axis (``Shard(d)`` on each, outermost
first in mesh order), which gives other blocks when the size is uneven (9 rows over 2x2:
3, 2, 2, 2 rows here, 3, 3, 3, 0 in XLA) and cannot follow a tuple in another order than
the mesh's.

Where the two differ, the annotated tensor lives on a *tiling mesh*: the same devices with
each tuple's axes merged into one dim (in the tuple's order), on which ``Shard(d)`` is
``torch.chunk``'s flat tiling, XLA's. Such a tensor is a ``FlatTiled`` DTensor:

- ops among tensors of one tiling mesh compute there, and their results stay flat-tiled;
- an op mixing it with tensors of the mesh (the program's other DTensors) first lays it out
  on the mesh (its whole value gathered, each process keeping its block): the same values,
  DTensor's split;
- an in-place op on it (an optimizer's update) lays the other operands out like it, so the
  tensor keeps its tiling.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_leaves, tree_map

from torchspmd.layouts.blocks import block_of
from torchspmd.engines.native.start import device_mesh as meshes


class Tiling:
    """What a tiling mesh is: the mesh's DeviceMesh it was made from, and per dim of the
    tiling mesh the mesh axes merged into it (in the order that numbers its devices)."""

    def __init__(self, root: DeviceMesh, dims: tuple[tuple[int, ...], ...]):
        self.root = root
        self.dims = dims


def tiling_of(dmesh: DeviceMesh) -> Tiling | None:
    """The ``Tiling`` of a tiling mesh; None for any other DeviceMesh."""
    return getattr(dmesh, "_torchspmd_tiling", None)


def same_devices(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether ``a`` and ``b`` are a mesh's DeviceMesh and its tiling meshes (the same devices)."""
    return root_of(a) == root_of(b)


def root_of(dmesh: DeviceMesh) -> DeviceMesh:
    """The mesh's own DeviceMesh of ``dmesh`` (itself, or what a tiling mesh was made from)."""
    tiling = tiling_of(dmesh)
    return tiling.root if tiling else dmesh


def _effective(mesh_shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """The axes that split (an axis of size 1 leaves every device the whole dim)."""
    return tuple(a for a in axes if mesh_shape[a] > 1)


def _same_blocks(size: int, sizes: Sequence[int]) -> bool:
    """Whether DTensor's axis-by-axis split of ``size`` over axes of ``sizes`` (in mesh order)
    gives every device the flat tile XLA gives it."""
    tiles = math.prod(sizes)
    flat = [block_of((size,), (tiles,), [Shard(0)], (i,))[0] for i in range(tiles)]
    nested = [block_of((size,), tuple(sizes), [Shard(0)] * len(sizes), tuple(c))[0]
              for c in np.ndindex(*sizes)]
    return flat == nested


def needs_tiling_mesh(mesh, resolved, shape: Sequence[int]) -> bool:
    """Whether DTensor's placements on the mesh give other blocks than XLA for this spec."""
    for d, axes in enumerate(resolved):
        eff = _effective(mesh.mesh_shape, axes)
        if len(eff) < 2:
            continue
        if list(eff) != sorted(eff) or not _same_blocks(int(shape[d]), [mesh.mesh_shape[a] for a in eff]):
            return True
    return False


def tiling_mesh(mesh, resolved) -> DeviceMesh:
    """The tiling mesh of ``mesh`` for a spec: each tuple's axes (of size > 1) merged into one
    dim, in the tuple's order, placed where its first axis (in mesh order) is; the other axes
    as they are. Made once per grouping (every process makes it: one program)."""
    groups = [g for g in (_effective(mesh.mesh_shape, axes) for axes in resolved) if len(g) >= 2]
    key = tuple(groups)
    made = getattr(mesh, "_tiling_meshes", None)
    if made is None:
        made = mesh._tiling_meshes = {}
    if key in made:
        return made[key]
    root = meshes.device_mesh(mesh)
    names = mesh.axis_names or tuple(f"axis{a}" for a in range(len(mesh.mesh_shape)))
    dims: list[tuple[int, ...]] = []
    for a in range(len(mesh.mesh_shape)):
        group = next((g for g in groups if a in g), None)
        if group is None:
            dims.append((a,))
        elif a == min(group):
            dims.append(group)
    order = [a for dim in dims for a in dim]
    grid = root.mesh.numpy().transpose(order).reshape([math.prod(mesh.mesh_shape[a] for a in dim) for dim in dims])
    dim_names = tuple("_".join(str(names[a]) for a in dim) for dim in dims)
    tmesh = meshes.mesh_over(grid, dim_names)
    tmesh._torchspmd_tiling = Tiling(root, tuple(dims))
    made[key] = tmesh
    return tmesh


def layout(mesh, resolved, shape: Sequence[int]) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The DeviceMesh and placements giving every device XLA's block of a tensor of ``shape``
    annotated with ``resolved`` (per tensor dim, the mesh axes splitting it, in spec order)."""
    if not needs_tiling_mesh(mesh, resolved, shape):
        out: list[Placement] = [Replicate()] * len(mesh.mesh_shape)
        for dim, axes in enumerate(resolved):
            for a in axes:
                out[a] = Shard(dim)
        return meshes.device_mesh(mesh), tuple(out)
    tmesh = tiling_mesh(mesh, resolved)
    dims = tiling_of(tmesh).dims
    out = [Replicate()] * len(dims)
    for dim, axes in enumerate(resolved):
        eff = _effective(mesh.mesh_shape, axes) or tuple(axes)
        for k, members in enumerate(dims):
            if members == eff or (len(members) == 1 and members[0] in axes):
                out[k] = Shard(dim)
    return tmesh, tuple(out)


def root_axes(dmesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Per dim of ``dmesh``, the axes of the mesh it stands for (itself on a mesh's own
    DeviceMesh)."""
    tiling = tiling_of(dmesh)
    return [tuple(d) for d in tiling.dims] if tiling else [(a,) for a in range(dmesh.ndim)]


def _root_placements(t: DTensor) -> tuple[DeviceMesh, list[Placement]]:
    """The root mesh and DTensor placements holding the same value as flat-tiled ``t`` split
    the same way (axis by axis); a pending sum is resolved."""
    tiling = tiling_of(t.device_mesh)
    out: list[Placement] = [Replicate()] * tiling.root.ndim
    for members, p in zip(tiling.dims, t.placements):
        if isinstance(p, Shard):
            for a in sorted(members):
                out[a] = Shard(p.dim)
    return tiling.root, out


def _plain(t: DTensor) -> DTensor:
    """A DTensor of DTensor's own class over the same data (no flat-tiling dispatch)."""
    return DTensor(t._local_tensor, t._spec, requires_grad=False) if isinstance(t, FlatTiled) else t


def _moved(t: DTensor, dmesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``t``'s value laid out on another mesh over the same devices (no autograd; a pending
    sum in ``placements`` arrives summed, as ``Replicate``)."""
    target = [Replicate() if p.is_partial() else p for p in placements]
    with torch.no_grad():
        whole = _plain(t).full_tensor()
        out = distribute_tensor(whole, dmesh, target, src_data_rank=None)
    return as_tiled(out)


def as_tiled(t: Any) -> Any:
    """``t`` as a ``FlatTiled`` when it is a DTensor on a tiling mesh (differentiably when it
    has a history); else ``t``."""
    if type(t) is DTensor and tiling_of(t.device_mesh) is not None:
        if t.grad_fn is not None and torch.is_grad_enabled():
            return _AsTiled.apply(t)
        return FlatTiled(t._local_tensor.detach(), t._spec, requires_grad=t.requires_grad)
    return t


class _AsTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return FlatTiled(t._local_tensor.detach(), t._spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Relaid(torch.autograd.Function):
    """``t`` laid out on another mesh over the same devices; the gradient goes back to ``t``'s."""

    @staticmethod
    def forward(ctx, t, dmesh, placements):
        ctx.source = (t.device_mesh, tuple(t.placements))
        return _moved(t, dmesh, placements)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and (grad.device_mesh != ctx.source[0]
                                          or tuple(grad.placements) != ctx.source[1]):
            grad = _moved(grad, *ctx.source)
        return grad, None, None


def relaid(t: DTensor, dmesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``t`` on ``dmesh`` (the mesh's DeviceMesh or one of its tiling meshes) as ``placements``
    say, differentiably."""
    if t.device_mesh == dmesh:
        return as_tiled(t.redistribute(dmesh, list(placements)))
    return _Relaid.apply(t, dmesh, tuple(placements))


def on_root(t: DTensor) -> DTensor:
    """A flat-tiled ``t`` as a DTensor of the mesh (the same value, split axis by axis)."""
    if tiling_of(t.device_mesh) is None:
        return t
    return relaid(t, *_root_placements(t))


def _writes_first(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _is_tiled(t: Any) -> bool:
    return isinstance(t, DTensor) and tiling_of(t.device_mesh) is not None


def _like(t: Any, home: DTensor) -> Any:
    """Operand ``t`` of an in-place op on flat-tiled ``home``, laid out on ``home``'s mesh:
    like ``home`` when it has its shape, else whole (a value broadcast against it)."""
    if not isinstance(t, DTensor) or t is home:
        return _plain(t) if isinstance(t, DTensor) else t
    if t.device_mesh == home.device_mesh:
        return _plain(t)
    target = home.placements if tuple(t.shape) == tuple(home.shape) else [Replicate()] * home.device_mesh.ndim
    return _plain(_moved(t, home.device_mesh, target))


def _to_root(t: Any) -> Any:
    if _is_tiled(t):
        return _plain(_moved(t, *_root_placements(t)))
    return t


class FlatTiled(DTensor):
    """A DTensor on a tiling mesh: its dims split over several mesh axes are tiled flat, as
    XLA tiles them (see the module docstring for how it computes with others)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if _writes_first(func) and _is_tiled(first):  # in place on a flat-tiled tensor: it keeps its tiling
            func(*tree_map(lambda t: _like(t, first), args), **tree_map(lambda t: _like(t, first), kwargs))
            return first
        if _writes_first(func) and isinstance(first, (list, tuple)) and any(_is_tiled(t) for t in first):
            # a foreach op (an optimizer's update over its parameters): operands zipped by index
            lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and len(a) == len(first)]
            args = list(args)
            for k in lists:
                args[k] = [_like(t, home) if k != 0 and _is_tiled(home) else _plain(t) if _is_tiled(t) else t
                           for t, home in zip(args[k], first)]
            func(*args, **kwargs)
            return None
        meshes = {t.device_mesh for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor)}
        if len(meshes) == 1:  # all on one tiling mesh: computed there, the results tiled alike
            out = func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
            return tree_map(as_tiled, out)
        # mixed with the mesh's own DTensors: laid out on the mesh first
        return func(*tree_map(_to_root, args), **tree_map(_to_root, kwargs))

    def redistribute(self, device_mesh=None, placements=None, *args, **kwargs):
        if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
            device_mesh = meshes.device_mesh(device_mesh)
        if device_mesh is None or device_mesh == self.device_mesh:
            return as_tiled(DTensor.redistribute(self, device_mesh, placements, *args, **kwargs))
        if placements is None:
            raise ValueError("redistribute: give the placements on the other mesh")
        return relaid(self, device_mesh, placements)
