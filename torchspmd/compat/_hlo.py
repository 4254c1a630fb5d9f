"""``torch_xla._XLAC._get_xla_sharding_spec`` under ``--xla-compat``: the HLO sharding text
XLA prints for a tensor's layout, computed from torchspmd's layout (a DTensor's mesh and
placements).

XLA's text: ``{devices=[t0,t1,...]d0,d1,...}`` where ``t_i`` is the number of tiles along
tensor dim ``i`` and the device list is the tile assignment in C order; when some mesh
axes split no dim, one more tile dim holds the copies (each tile's in ascending device
order), marked ``last_tile_dim_replicate``;
``{replicated}`` when nothing is split; ``''`` for a tensor that has no sharding."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def hlo_text(device_grid: np.ndarray, dims_axes: Sequence[Sequence[int]]) -> str:
    """The text for a tensor whose dim ``i`` is split over the mesh axes ``dims_axes[i]``
    (outermost first) of the mesh whose devices are laid out as ``device_grid``."""
    grid = np.asarray(device_grid)
    shape = grid.shape
    used = [a for axes in dims_axes for a in axes]
    rest = [a for a in range(len(shape)) if a not in used]
    tiles = [int(np.prod([shape[a] for a in axes], dtype=np.int64)) for axes in dims_axes]
    copies = int(np.prod([shape[a] for a in rest], dtype=np.int64))
    if all(t == 1 for t in tiles):
        return "{replicated}"
    # Tile assignment: move each dim's axes together (in order), the replicating axes last.
    order = [a for axes in dims_axes for a in axes] + rest
    assignment = grid.transpose(order).reshape(tiles + ([copies] if copies > 1 else []))
    if copies > 1:  # XLA lists each tile's copies in ascending device order
        assignment = np.sort(assignment, axis=-1)
    text = "{devices=[" + ",".join(map(str, assignment.shape)) + "]" + ",".join(
        str(int(d)) for d in assignment.reshape(-1))
    return text + (" last_tile_dim_replicate}" if copies > 1 else "}")


def from_partition_spec(device_grid: np.ndarray, axis_names: Sequence[str], spec) -> str:
    """The text for a torch_xla-style partition spec (axis names, tuples of them, None)."""
    index = {n: i for i, n in enumerate(axis_names)}
    dims = []
    for entry in spec:
        if entry is None:
            dims.append(())
        elif isinstance(entry, (tuple, list)):
            dims.append(tuple(index[e] if isinstance(e, str) else int(e) for e in entry))
        else:
            dims.append((index[entry] if isinstance(entry, str) else int(entry),))
    return hlo_text(device_grid, dims)


def sharding_string(t) -> str:
    """The text for ``t``: ``''`` for a plain tensor, else its DTensor layout on the whole
    mesh (a DTensor on a sub-mesh, as FSDP keeps its parameters, is replicated over the
    other axes of the mesh it was cut from). A pending reduction (``Partial``) reads as
    replicated: its value, once reduced, is the same on those devices."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return ""
    mesh = t.device_mesh
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = list(mesh.mesh_dim_names or ())
    root_names = list(root.mesh_dim_names or ())
    if root is not mesh and names and all(n in root_names for n in names):
        grid = root.mesh.numpy()
        axis_of = [root_names.index(n) for n in names]
    else:
        grid = mesh.mesh.numpy()
        axis_of = list(range(mesh.ndim))
    dims: list[list[int]] = [[] for _ in range(t.ndim)]
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Shard):  # (a _StridedShard is a Shard: its tiles are counted alike)
            dims[p.dim].append(axis_of[mesh_dim])
    return hlo_text(grid, [sorted(d) for d in dims])
