"""``torch_xla.distributed.spmd.xla_sharded_tensor`` under ``--xla-compat``: ``XLAShardedTensor``,
the type of a sharded tensor, and ``XLAShard``.

On the native engine a sharded tensor is a DTensor, and a DTensor is an ``XLAShardedTensor``
(``isinstance(t, XLAShardedTensor)`` holds for what ``xs.mark_sharding`` returns and for a
parameter annotated in place): it answers torch_xla's attributes (``global_tensor``,
``local_shards``, ``sharding_spec``, ``sharding_type``, ``partition_spec``, ``mesh_shape``,
``load_local_shards_``).

``XLAShardedTensor(t, mesh_shape=None, partition_spec=None, requires_grad=False)`` makes one
of ``t``: torch_xla's wraps ``t`` and records the mesh shape and spec it is told; here they
are made true, ``t``'s value laid out as ``partition_spec`` (mesh dim indices, as torch_xla's
``partition_spec`` attribute has them) over a mesh of ``mesh_shape`` over every device in
order. Without them a plain tensor is replicated over one axis of every device, and a
sharded tensor keeps its own."""

from __future__ import annotations

import abc

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from torchspmd.compat.stand_ins import not_provided
from torchspmd.mesh import Mesh, get_global_mesh
from torchspmd.runtime import global_runtime_device_count
from torchspmd.sharding import mark_sharding
from torchspmd.layouts.xla_shards import XLAShard  # noqa: F401

__all__ = ["XLAShardedTensor", "XLAShard"]

_MESHES: dict[tuple[int, ...], Mesh] = {}


def _mesh(mesh_shape) -> Mesh:
    """A mesh of ``mesh_shape`` over every device in order: the global mesh when it is one,
    else one made once per shape (every process makes it: one program)."""
    shape = tuple(int(s) for s in mesh_shape)
    mesh = get_global_mesh()
    if mesh is not None and tuple(mesh.mesh_shape) == shape and np.array_equal(
            mesh.get_logical_mesh().reshape(-1), np.arange(mesh.size())):
        return mesh
    if shape not in _MESHES:
        _MESHES[shape] = Mesh(np.arange(int(np.prod(shape))), shape)
    return _MESHES[shape]


def sharded(elem: torch.Tensor, mesh_shape=None, partition_spec=None, requires_grad: bool = False) -> DTensor:
    """``elem`` as a sharded tensor laid out as ``partition_spec`` over a mesh of ``mesh_shape``
    (see the module docstring)."""
    if not isinstance(elem, torch.Tensor):
        raise TypeError(f"XLAShardedTensor: elem must be a torch.Tensor, got {type(elem).__name__}")
    if isinstance(elem, DTensor):
        mesh_shape = tuple(elem.mesh_shape) if mesh_shape is None else mesh_shape
        partition_spec = tuple(elem.partition_spec) if partition_spec is None else partition_spec
    if mesh_shape is None:
        mesh_shape = (global_runtime_device_count(),)
    if partition_spec is None:
        partition_spec = (None,) * elem.dim()
    mesh = _mesh(mesh_shape)
    if isinstance(elem, DTensor):
        if elem.device_mesh is not mesh.device_mesh or elem.requires_grad:
            elem = elem.full_tensor()  # the value, to lay out on the other mesh (differentiably)
        elif not elem.is_leaf:
            elem = elem.redistribute(elem.device_mesh, elem.placements)  # a new tensor: elem is left as it is
    out = mark_sharding(elem.detach() if requires_grad else elem, mesh, tuple(partition_spec))
    if requires_grad:
        out.requires_grad_(True)
    return out


class XLAShardedTensor(abc.ABC):
    """A sharded tensor: every DTensor is one. ``XLAShardedTensor(t, mesh_shape, partition_spec)``
    gives ``t`` laid out so (a DTensor)."""

    def __new__(cls, elem, mesh_shape=None, partition_spec=None, *args, requires_grad: bool = False, **kwargs):
        return sharded(elem, mesh_shape, partition_spec, requires_grad)


XLAShardedTensor.register(DTensor)


def wrap_as_sharded_tensor(t, mesh_shape=None, partition_spec=None):
    """torch_xla's: ``t`` as an ``XLAShardedTensor``. A sharded tensor without ``mesh_shape`` and
    ``partition_spec`` is returned as it is; otherwise ``XLAShardedTensor(t, mesh_shape,
    partition_spec)``: ``t``'s value laid out so (torch_xla records them on the wrapper)."""
    if isinstance(t, XLAShardedTensor) and mesh_shape is None and partition_spec is None:
        return t
    return XLAShardedTensor(t, mesh_shape, partition_spec)

__getattr__ = not_provided("torch_xla.distributed.spmd.xla_sharded_tensor")
