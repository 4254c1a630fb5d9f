"""A ``Mesh`` realised as a ``torch.distributed.DeviceMesh`` over the same ranks.

Device id ``i`` is the process of rank ``i``. Meshes over devices in another order than
``0..n-1`` get process groups that keep that order; meshes of several axes get flattened
meshes over each run of consecutive axes, so that DTensor moves a value split over several
axes with one collective.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchspmd.engines.native.start import topology
from torchspmd.errors import SpmdError
from torchspmd.patches import dtensor as dtensor_patches


#: The DeviceMeshes made, by the mesh's devices, shape and axis names, each with the default process
#: group it was made under: a program that builds the same ``Mesh`` again (in a function it calls each
#: step, or in each test of a suite) gets the same process groups, not new ones. Every process group
#: holds its threads (gloo: three) until the process ends, and a DeviceMesh's groups cannot be handed
#: back while a DTensor may still use them.
_MADE: dict[tuple, tuple[object, DeviceMesh]] = {}


def device_mesh(mesh) -> DeviceMesh:
    """The DeviceMesh of ``mesh`` (created on first use, then kept on the mesh, and reused for
    an equal mesh; every process must reach it, as every process runs the same program)."""
    made = getattr(mesh, "_device_mesh", None)
    if made is not None:
        return made
    n = topology.world_size()
    if mesh.size() != n:
        raise SpmdError(f"{mesh!r} of shape {mesh.mesh_shape} is not mappable over {n} devices: the product of "
                        f"mesh_shape must equal global_runtime_device_count() ({n})")
    logical = mesh.get_logical_mesh()
    names = tuple(mesh.axis_names) if mesh.axis_names is not None else None
    key = (topology.device_type(), logical.shape, tuple(logical.reshape(-1).tolist()), names)
    world = dist.group.WORLD
    earlier = _MADE.get(key)
    if earlier is not None and earlier[0] is world:  # (made under this process group, not a destroyed one)
        made = earlier[1]
    elif np.array_equal(logical.reshape(-1), np.arange(n)):
        made = DeviceMesh(topology.device_type(), torch.as_tensor(logical, dtype=torch.int64),
                          mesh_dim_names=mesh.axis_names)
        _flatten_spans(made)
    else:
        made = mesh_over(logical, mesh.axis_names)
    _MADE[key] = (world, made)
    mesh._device_mesh = made
    return made


def mesh_over(logical: np.ndarray, axis_names) -> DeviceMesh:
    """A DeviceMesh over the processes of the array ``logical``, in any order (np.flip, a transposed array, a custom tile
    assignment). DTensor places a shard by the process's coordinate in the mesh, and its
    collectives order a group's members by their rank within the process group; torch's
    DeviceMesh builds its groups from sorted ranks (and reuses the world group for an axis
    spanning every process), so the two disagree on such a mesh and values come out
    permuted. Here every group (each axis, each flattened run of axes) lists its members
    in mesh order (``new_group(sort_ranks=False)``, forced past the world-group shortcut by
    naming the backend)."""
    if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
        raise SpmdError(
            f"Mesh(device_ids=...): devices in an order other than 0..{logical.size - 1} need process groups that "
            f"keep that order (torch.distributed.new_group(sort_ranks=False)), which torch {torch.__version__} "
            f"lacks; upgrade torch, or build the mesh over np.arange({logical.size}) (the same shape: only which "
            f"process holds which block changes)"
        )
    backend = dist.get_backend()
    with dtensor_patches.groups_in_mesh_order():
        made = DeviceMesh(topology.device_type(), torch.as_tensor(logical, dtype=torch.int64),
                          mesh_dim_names=axis_names, backend_override=tuple((backend, None) for _ in logical.shape))
        _flatten_spans(made, backend)
    return made


def _flatten_spans(dmesh: DeviceMesh, backend: str | None = None) -> None:
    """Flattened meshes over every run of consecutive axes: with them DTensor moves a value
    sharded (or pending a sum) over several axes with one collective over their devices,
    not one per axis (which torch warns about: "flatten mesh dimensions")."""
    names = dmesh.mesh_dim_names
    if names is None or len(names) < 2:
        return
    for start in range(len(names)):
        for stop in range(start + 2, len(names) + 1):
            span = tuple(names[start:stop])
            (dmesh if len(span) == len(names) else dmesh[span])._flatten("_".join(span), backend_override=backend)
