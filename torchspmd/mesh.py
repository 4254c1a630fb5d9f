"""Named device meshes: ``Mesh``, ``HybridMesh``, ``get_1d_mesh`` and the global mesh.

A ``Mesh`` is torch_xla's logical mesh (device ids laid out in a shape, axes named)
and is backed by a ``torch.distributed.DeviceMesh`` over the same ranks: device id
``i`` is the process of rank ``i``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from torchspmd import runtime
from torchspmd._delegate import OnXla, on_xla
from torchspmd._errors import SpmdError

__all__ = ["Mesh", "HybridMesh", "get_1d_mesh", "set_global_mesh", "get_global_mesh"]


class Mesh(metaclass=OnXla):
    """A logical device mesh (torch_xla's ``Mesh`` on the XLA backend).

    Args:
        device_ids: the devices (ranks) in C order; reshaped to ``mesh_shape``.
        mesh_shape: devices along each axis; its product is the number of devices.
        axis_names: one unique name per axis, e.g. ``('data', 'model')``.

    Example::

        mesh = Mesh(np.arange(8), (4, 2), ('data', 'model'))
        mesh.get_logical_mesh()   # array([[0, 1], [2, 3], [4, 5], [6, 7]])
        mesh.shape()              # OrderedDict([('data', 4), ('model', 2)])
    """

    _xla_factory = "mesh"

    def __init__(self, device_ids, mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None):
        # Any order of the ids (np.flip, a transposed array, a custom tile assignment): a C-ordered
        # copy, so that negative or non-contiguous strides reach no tensor.
        ids = np.ascontiguousarray(np.asarray(device_ids).reshape(-1))
        if runtime.is_spmd() or runtime._launched():
            # torch_xla's rule, checked where torch_xla checks it: a mesh spans every device.
            n = runtime.global_runtime_device_count()
            if len(ids) != n:
                raise SpmdError(
                    f"Mesh: Number of device IDs ({len(ids)}) must match the global number of devices ({n}): "
                    f"mesh_shape {mesh_shape!r} is not mappable over {n} devices; build the mesh over "
                    f"np.arange(global_runtime_device_count()) with a mesh_shape whose product is {n}"
                )
        try:
            shape = tuple(int(s) for s in mesh_shape)
        except TypeError:
            raise SpmdError(f"Mesh(mesh_shape={mesh_shape!r}): give a tuple of axis sizes, e.g. (4, 2)") from None
        if any(s < 1 for s in shape):
            raise SpmdError(f"Mesh(mesh_shape={shape}): every axis needs at least one device")
        if isinstance(axis_names, str):
            raise SpmdError(f"Mesh(axis_names={axis_names!r}): give a tuple of names, one per axis, e.g. "
                            f"({axis_names!r},) for one axis")
        if axis_names is not None:
            axis_names = tuple(axis_names)
            if len(axis_names) != len(shape):
                raise SpmdError(
                    f"Number of axis names ({len(axis_names)}) must match mesh dimensions ({len(shape)}): "
                    f"Mesh(axis_names={axis_names}) for a mesh_shape of {len(shape)} axes {shape}; give one name "
                    f"per axis"
                )
            if not all(isinstance(n, str) and n for n in axis_names):
                raise SpmdError(f"Mesh(axis_names={axis_names}): axis names must be non-empty strings")
            dup = sorted({n for n in axis_names if axis_names.count(n) > 1})
            if dup:
                raise SpmdError(f"Axis names must be unique, got: {axis_names}: Mesh(axis_names=...) repeats "
                                f"{dup[0]!r}; give each axis its own name")
        if len(ids) != int(np.prod(shape)):
            raise SpmdError(
                f"Number of device IDs ({len(ids)}) must match mesh size ({int(np.prod(shape))}): Mesh: "
                f"{len(ids)} device_ids do not fill mesh_shape {shape}; the product of mesh_shape must equal "
                f"the number of devices"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise SpmdError(f"Mesh(device_ids=...): device ids must be integers, got dtype {ids.dtype}")
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            raise SpmdError(f"Device IDs must be unique, got: {ids}: Mesh(device_ids=...) lists device "
                            f"{int(uniq[counts > 1][0])} more than once; give each device once")
        bad = [int(d) for d in ids if d < 0 or d >= len(ids)]
        if bad:
            raise SpmdError(
                f"Device IDs must be less than mesh size ({len(ids)}), got: {ids}: Mesh(device_ids=...) device "
                f"id {bad[0]} is out of range; ids must be 0..{len(ids) - 1} for a mesh of {len(ids)} devices"
            )
        self.device_ids = ids
        self.mesh_shape = shape
        self.axis_names = axis_names
        self._device_mesh = None

    # torch_xla's accessors -------------------------------------------------
    def size(self) -> int:
        return int(np.prod(self.mesh_shape))

    def shape(self) -> OrderedDict:
        if self.axis_names is None:
            return OrderedDict(enumerate(self.mesh_shape))
        return OrderedDict(zip(self.axis_names, self.mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: str) -> int | None:
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    def axis_label(self, index: int):
        """The name of axis ``index``, or the index on an unnamed mesh."""
        return self.axis_names[index] if self.axis_names is not None else index

    def __repr__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.shape().items())
        return f"Mesh({axes})"

    # the engine underneath ----------------------------------------------
    @property
    def device_mesh(self):
        """The ``torch.distributed.DeviceMesh`` over the same ranks (created on first use;
        every process must reach it, as every process runs the same program)."""
        if self._device_mesh is None:
            runtime._require_spmd("Mesh.device_mesh")
            n = runtime.global_runtime_device_count()
            if self.size() != n:
                raise SpmdError(
                    f"{self!r} of shape {self.mesh_shape} is not mappable over {n} devices: "
                    f"the product of mesh_shape must equal global_runtime_device_count() ({n})"
                )
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            logical = self.get_logical_mesh()
            if np.array_equal(logical.reshape(-1), np.arange(n)):
                self._device_mesh = DeviceMesh(runtime.device_type(), torch.as_tensor(logical, dtype=torch.int64),
                                               mesh_dim_names=self.axis_names)
                _flatten_spans(self._device_mesh)
            else:
                self._device_mesh = _reordered_device_mesh(logical, self.axis_names)
        return self._device_mesh


def _reordered_device_mesh(logical: np.ndarray, axis_names):
    """A DeviceMesh over devices in any order (np.flip, a transposed array, a custom tile
    assignment). DTensor places a shard by the process's coordinate in the mesh, and its
    collectives order a group's members by their rank within the process group; torch's
    DeviceMesh builds its groups from sorted ranks (and reuses the world group for an axis
    spanning every process), so the two disagree on such a mesh and values come out
    permuted. Here every group (each axis, each flattened run of axes) lists its members
    in mesh order (``new_group(sort_ranks=False)``, forced past the world-group shortcut by
    naming the backend)."""
    import inspect

    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh_module
    from torch.distributed.device_mesh import DeviceMesh

    if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
        raise SpmdError(
            f"Mesh(device_ids=...): devices in an order other than 0..{logical.size - 1} need process groups that "
            f"keep that order (torch.distributed.new_group(sort_ranks=False)), which torch {torch.__version__} "
            f"lacks; upgrade torch, or build the mesh over np.arange({logical.size}) (the same shape: only which "
            f"process holds which block changes)"
        )
    backend = dist.get_backend()
    original = device_mesh_module.new_group

    def in_mesh_order(*args, **kwargs):
        kwargs["sort_ranks"] = False
        return original(*args, **kwargs)

    device_mesh_module.new_group = in_mesh_order
    try:
        dmesh = DeviceMesh(runtime.device_type(), torch.as_tensor(logical, dtype=torch.int64),
                           mesh_dim_names=axis_names, backend_override=tuple((backend, None) for _ in logical.shape))
        _flatten_spans(dmesh, backend)
    finally:
        device_mesh_module.new_group = original
    return dmesh


def _flatten_spans(dmesh, backend: str | None = None) -> None:
    """Flattened meshes over every run of consecutive axes: with them DTensor moves a value
    sharded (or pending a sum) over several axes with one collective over their devices,
    not one per axis (which torch warns about: "flatten mesh dimensions")."""
    names = dmesh.mesh_dim_names
    if names is None or len(names) < 2:
        return
    _guard_uneven_gathers()
    for start in range(len(names)):
        for stop in range(start + 2, len(names) + 1):
            span = tuple(names[start:stop])
            (dmesh if len(span) == len(names) else dmesh[span])._flatten("_".join(span), backend_override=backend)


class HybridMesh(Mesh):
    """A mesh over several hosts: ``ici_mesh_shape`` lays out the devices of one host,
    ``dcn_mesh_shape`` how hosts tile the mesh (the axes crossing the slower network).

    Hosts are torchrun's nodes: ``LOCAL_WORLD_SIZE`` devices each, ranks numbered host by
    host. The mesh shape is the element-wise product of both shapes. On the XLA backend
    this is torch_xla's ``HybridMesh`` (laid out by the TPU topology).
    """

    _xla_factory = "hybrid_mesh"

    def __init__(
        self,
        *,
        ici_mesh_shape: Sequence[int],
        dcn_mesh_shape: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
    ):
        ici, dcn, full = hybrid_layout(ici_mesh_shape, dcn_mesh_shape, runtime.global_runtime_device_count(),
                                       runtime.local_device_count())
        self.ici_mesh_shape = ici
        self.dcn_mesh_shape = dcn
        super().__init__(full.reshape(-1), full.shape, axis_names)


def hybrid_layout(ici_mesh_shape, dcn_mesh_shape, total: int, per_host: int):
    """Device ids of a hybrid mesh laid out host by host: each host's ``per_host`` devices
    (numbered consecutively) fill an ``ici`` block, and the hosts tile the mesh by ``dcn``."""
    ici = tuple(int(s) for s in ici_mesh_shape)
    dcn = tuple(int(s) for s in dcn_mesh_shape) if dcn_mesh_shape is not None else (1,) * len(ici)
    if len(ici) != len(dcn):
        raise SpmdError(f"HybridMesh: ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have the same number of axes")
    hosts = max(1, total // per_host)
    if int(np.prod(dcn)) != hosts:
        raise SpmdError(
            f"HybridMesh(dcn_mesh_shape={dcn}): the job has {hosts} host(s) of {per_host} devices; "
            f"the product of dcn_mesh_shape must equal the number of hosts"
        )
    if int(np.prod(ici)) != per_host:
        raise SpmdError(
            f"HybridMesh(ici_mesh_shape={ici}): each host has {per_host} devices; "
            f"the product of ici_mesh_shape must equal it"
        )
    host_meshes = [np.arange(h * per_host, (h + 1) * per_host).reshape(ici) for h in range(hosts)]
    # Tile the per-host meshes by the dcn shape: host (i, j, ...) occupies block (i, j, ...).
    grid = np.arange(hosts).reshape(dcn)
    full = np.empty(tuple(a * b for a, b in zip(ici, dcn)), dtype=np.int64)
    for idx in np.ndindex(*dcn):
        block = tuple(slice(i * s, (i + 1) * s) for i, s in zip(idx, ici))
        full[block] = host_meshes[int(grid[idx])]
    return ici, dcn, full


def _guard_uneven_gathers() -> None:
    """torch 2.13 merges the per-axis all-gathers of a value sharded over several axes into
    one over their flattened mesh without checking that the dim divides evenly; when it does
    not, the nested split (9 over 2 then 2: 3, 2, 2, 2) is not the flat one (3, 3, 3, 0) and
    the gathered value is wrong (torch checks this for reduce-scatters only). Such
    redistributions keep their per-axis collectives; the others are merged."""
    try:
        from torch.distributed.tensor import _redistribute as r
    except ImportError:
        return
    original = getattr(r, "_optimize_transform_infos", None)
    if original is None or getattr(original, "_torchspmd_guard", False):
        return

    def guarded(transform_infos, device_mesh, *args, **kwargs):
        dims: dict[int, list[int]] = {}
        for info in transform_infos:
            src = info.src_dst_placements[0]
            if info._comm_type_key() == "all_gather" and src.is_shard():
                size, ways = dims.get(src.dim, (0, 1))
                dims[src.dim] = (max(size, info.logical_shape[src.dim]), ways * device_mesh.size(info.mesh_dim))
        if any(size % ways for size, ways in dims.values()):
            return transform_infos
        return original(transform_infos, device_mesh, *args, **kwargs)

    guarded._torchspmd_guard = True
    r._optimize_transform_infos = guarded


_GLOBAL_MESH: Mesh | None = None


@on_xla
def set_global_mesh(mesh: Mesh | None) -> None:
    """Make ``mesh`` the default for FSDPv2 and for calls given no mesh (None clears it)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise SpmdError(f"set_global_mesh(mesh=...): expected a torchspmd Mesh, got {type(mesh).__name__}")
    global _GLOBAL_MESH
    _GLOBAL_MESH = mesh


@on_xla
def get_global_mesh() -> Mesh | None:
    """The mesh set by ``set_global_mesh``, or None."""
    return _GLOBAL_MESH


@on_xla
def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """All devices along one axis (named ``axis_name`` if given)."""
    n = runtime.global_runtime_device_count()
    return Mesh(np.arange(n), (n,), (axis_name,) if axis_name is not None else None)
