"""torch_xla's ``XLAShardedTensor`` view of a sharded tensor, on the native engine.

``mark_sharding`` returns a DTensor; after ``use_spmd()`` a DTensor also answers the
attributes torch_xla programs read from the ``XLAShardedTensor`` it returns:

- ``global_tensor``: the tensor itself (a DTensor already is the global value);
- ``local_shards``: this process's shard (one process is one device) as an ``XLAShard``:
  ``data`` padded to torch_xla's tile size (``ceil(size / tiles)`` along each split dim,
  zeros past the end), ``indices`` (a slice per dim into the global tensor, without the
  padding; ``Ellipsis`` when the tensor is replicated), ``shard_device`` (``"CPU:3"``,
  ``"CUDA:3"``: the global device id) and ``replica_id`` (0 for a tiled tensor, the device
  ordinal for a replicated one, for a partially replicated one its place by device id among
  the devices holding the same block);
- ``sharding_spec``: XLA's HLO sharding text (``{devices=[4,1]0,1,2,3}``);
- ``sharding_type``: a ``ShardingType`` (REPLICATED, TILED, or PARTIAL when some mesh axes
  split nothing and hold copies);
- ``partition_spec``: per dim, the index of the mesh dim that splits it (a tuple of them when
  several do, None when none), and ``mesh_shape``: the shape of the tensor's mesh;
- ``load_local_shards_(shards)``: write this process's shard from an ``XLAShard`` (padded
  or not), in place.

A pending reduction (DTensor's ``Partial`` placement) reads as replicated: its value, once
reduced, is the same on those devices. The names are added to DTensor (only where DTensor
has none of its own); ``torchspmd.XLAShard`` and ``torchspmd.ShardingType`` are the types.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Shard

from torchspmd.layouts import hlo
from torchspmd.layouts.blocks import block_of, tile_shape
from torchspmd.engines.native.global_view import flat_tiling
from torchspmd.engines.native.start import topology
from torchspmd.errors import SpmdError
from torchspmd.patches import dtensor as dtensor_patches
from torchspmd.layouts.xla_shards import ShardingType, XLAShard

__all__ = ["install", "sharding_string", "sharding_type"]


def _layout(t: DTensor):
    """Per dim: the mesh axes splitting it (outermost first; an axis of size 1 splits
    nothing, and a tensor it alone splits is replicated, as in XLA); the axes holding copies;
    this process's coordinate; the mesh's device grid. On a tiling mesh (``flat_tiling``) a
    dim of the mesh is all the axes it merges, tiled flat as XLA tiles them."""
    mesh = t.device_mesh
    dims: list[list[int]] = [[] for _ in range(t.ndim)]
    for axis, p in enumerate(t.placements):
        if isinstance(p, Shard) and mesh.size(axis) > 1:
            dims[p.dim].append(axis)
    split = {a for d in dims for a in d}
    copies = [a for a in range(mesh.ndim) if a not in split]
    return dims, copies, mesh.get_coordinate(), mesh.mesh.numpy()


def _sharding_type(t: DTensor) -> ShardingType:
    dims, copies, _, grid = _layout(t)
    if not any(dims):
        return ShardingType.REPLICATED
    if any(grid.shape[a] > 1 for a in copies):
        return ShardingType.PARTIAL
    return ShardingType.TILED


def sharding_type(t) -> ShardingType | None:
    """torch_xla's ``ShardingType`` of ``t``'s layout; None for a tensor without one (not a DTensor)."""
    return _sharding_type(t) if isinstance(t, DTensor) else None


def _local_shard(t: DTensor) -> XLAShard:
    dims, copies, coord, grid = _layout(t)
    device = f"{topology.device_type().upper()}:{int(grid[tuple(coord)])}"
    local = t.to_local()
    kind = _sharding_type(t)
    if kind == ShardingType.REPLICATED:
        return XLAShard(local.detach().clone(), Ellipsis, device, int(grid[tuple(coord)]))
    indices = [slice(start, start + length, 1)
               for start, length in block_of(t.shape, grid.shape, t.placements, coord)]
    padded = tile_shape(t.shape, grid.shape, dims)
    data = torch.zeros(padded, dtype=local.dtype, device=local.device)
    data[tuple(slice(0, s.stop - s.start) for s in indices)] = local.detach()
    replica = 0
    if kind == ShardingType.PARTIAL:  # its place among the devices holding the same block, by id (as XLA)
        same = grid[tuple(slice(None) if a in copies else coord[a] for a in range(grid.ndim))]
        replica = sorted(int(d) for d in np.asarray(same).reshape(-1)).index(int(grid[tuple(coord)]))
    return XLAShard(data, indices, device, replica)


def _load_local_shards_(t: DTensor, shards: list) -> DTensor:
    mine = _local_shard(t)
    if len(shards) != 1:
        raise SpmdError(f"load_local_shards_: give this process's one shard (one process is one device), got "
                        f"{len(shards)}")
    shard = shards[0]
    if shard.shard_device != mine.shard_device:
        raise SpmdError(f"load_local_shards_: the shard is for device {shard.shard_device!r}; this process is "
                        f"{mine.shard_device!r}")
    local = t.to_local()
    data = shard.data
    if tuple(data.shape) == tuple(mine.data.shape) and mine.indices is not Ellipsis:
        data = data[tuple(slice(0, s.stop - s.start) for s in mine.indices)]
    if tuple(data.shape) != tuple(local.shape):
        raise SpmdError(f"load_local_shards_: the shard's data has shape {tuple(shard.data.shape)}; this process's "
                        f"shard is {tuple(local.shape)} ({tuple(mine.data.shape)} padded)")
    with torch.no_grad():
        local.copy_(data)
    return t


def sharding_string(t) -> str:
    """XLA's HLO sharding text for ``t`` (``torchspmd.layouts.hlo``): ``''`` for a plain tensor, else
    its DTensor layout on the whole mesh (a DTensor on a sub-mesh, as FSDP keeps its
    parameters, is replicated over the other axes of the mesh it was cut from). A pending
    reduction (``Partial``) reads as replicated: its value, once reduced, is the same on
    those devices."""
    if not isinstance(t, DTensor):
        return ""
    mesh = t.device_mesh
    tiling = flat_tiling.tiling_of(mesh)
    if tiling is not None:  # a tiling mesh: its dims stand for the mesh's axes, in tiling order
        grid = tiling.root.mesh.numpy()
        dims = [[] for _ in range(t.ndim)]
        for members, p in zip(tiling.dims, t.placements):
            if isinstance(p, Shard):
                dims[p.dim] += list(members)
        return hlo.text(grid, dims)
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = list(mesh.mesh_dim_names or ())
    root_names = list(root.mesh_dim_names or ())
    if root is not mesh and names and all(n in root_names for n in names):
        grid = root.mesh.numpy()
        axis_of = [root_names.index(n) for n in names]
    else:
        grid = mesh.mesh.numpy()
        axis_of = list(range(mesh.ndim))
    dims = [[] for _ in range(t.ndim)]
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Shard):  # (a _StridedShard is a Shard: its tiles are counted alike)
            dims[p.dim].append(axis_of[mesh_dim])
    return hlo.text(grid, [sorted(d) for d in dims])


def _partition_spec(t: DTensor) -> tuple:
    """torch_xla's ``partition_spec`` of a sharded tensor: for each dim, the mesh dim that
    splits it (an int; a tuple when several do; None when none), on the tensor's own mesh
    (the mesh a tiling mesh was made from)."""
    per_dim: list[list[int]] = [[] for _ in range(t.ndim)]
    for members, p in zip(flat_tiling.root_axes(t.device_mesh), t.placements):
        if isinstance(p, Shard):
            per_dim[p.dim] += list(members)
    return tuple(None if not d else d[0] if len(d) == 1 else tuple(d) for d in per_dim)


def _mesh_shape(t: DTensor) -> tuple[int, ...]:
    tiling = flat_tiling.tiling_of(t.device_mesh)
    return tuple((tiling.root if tiling else t.device_mesh).shape)


_ATTRIBUTES = {
    "global_tensor": property(lambda self: self),
    "local_shards": property(lambda self: [_local_shard(self)]),
    "sharding_spec": property(sharding_string),
    "sharding_type": property(_sharding_type),
    "partition_spec": property(_partition_spec),
    "mesh_shape": property(_mesh_shape),
    "load_local_shards_": _load_local_shards_,
}


def install() -> None:
    """Give DTensor torch_xla's ``XLAShardedTensor`` attributes (a name DTensor already has
    is left alone): ``torchspmd.patches.dtensor.XLA_SHARDED_TENSOR``."""
    dtensor_patches.add_dtensor_attributes(_ATTRIBUTES)
