"""Named device meshes: ``Mesh``, ``HybridMesh``, ``get_1d_mesh`` and the global mesh.

A ``Mesh`` is torch_xla's logical mesh (device ids laid out in a shape, axes named), an
engine-neutral value. The native engine realises it as a ``torch.distributed.DeviceMesh``
over the same ranks (device id ``i`` is the process of rank ``i``); on the torch_xla engine
``Mesh(...)`` builds torch_xla's own mesh, which counts as a ``Mesh``.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from typing import Sequence

import numpy as np

from torchspmd import engines, runtime
from torchspmd.errors import SpmdError
from torchspmd.layouts.mesh_layouts import hybrid_layout

__all__ = ["Mesh", "HybridMesh", "get_1d_mesh", "set_global_mesh", "get_global_mesh"]


class Mesh(abc.ABC):
    """A logical device mesh (torch_xla's ``Mesh`` on the torch_xla engine).

    Args:
        device_ids: the devices (ranks) in C order; reshaped to ``mesh_shape``.
        mesh_shape: devices along each axis; its product is the number of devices.
        axis_names: one unique name per axis, e.g. ``('data', 'model')``.

    Example::

        mesh = Mesh(np.arange(8), (4, 2), ('data', 'model'))
        mesh.get_logical_mesh()   # array([[0, 1], [2, 3], [4, 5], [6, 7]])
        mesh.shape()              # OrderedDict([('data', 4), ('model', 2)])
    """

    def __new__(cls, *args, **kwargs):
        engine = engines.started()
        if engine is None or engine.own_class("Mesh") is None:
            return object.__new__(cls)
        view = object.__new__(cls)
        view.__init__(*args, **kwargs)  # torchspmd's checks and messages
        return engine.own_mesh(view)

    @classmethod
    def view(cls, device_ids, mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> "Mesh":
        """A checked public ``Mesh`` on any engine (never the engine's own)."""
        out = object.__new__(Mesh)
        out.__init__(device_ids, mesh_shape, axis_names)
        return out

    def __init__(self, device_ids, mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None):
        # Any order of the ids (np.flip, a transposed array, a custom tile assignment): a C-ordered
        # copy, so that negative or non-contiguous strides reach no tensor.
        ids = np.ascontiguousarray(np.asarray(device_ids).reshape(-1))
        if runtime.is_spmd() or runtime.launched():
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
        """The ``torch.distributed.DeviceMesh`` over the same ranks, on the native engine
        (created on first use; every process must reach it, as every process runs the same
        program)."""
        return runtime.require_spmd("Mesh.device_mesh").device_mesh(self)


class HybridMesh(Mesh):
    """A mesh over several hosts: ``ici_mesh_shape`` lays out the devices of one host,
    ``dcn_mesh_shape`` how hosts tile the mesh (the axes crossing the slower network).

    Hosts are torchrun's nodes: ``LOCAL_WORLD_SIZE`` devices each, ranks numbered host by
    host. The mesh shape is the element-wise product of both shapes. On the XLA backend
    this is torch_xla's ``HybridMesh`` (laid out by the TPU topology).
    """

    def __new__(cls, *, ici_mesh_shape: Sequence[int], dcn_mesh_shape: Sequence[int] | None = None,
                axis_names: Sequence[str] | None = None):
        engine = engines.started()
        if engine is None or engine.own_class("HybridMesh") is None:
            return object.__new__(cls)
        return engine.own_hybrid_mesh(ici_mesh_shape, dcn_mesh_shape, axis_names, Mesh.view)

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


def as_view(mesh, api: str) -> Mesh:
    """``mesh`` as a public ``Mesh`` to check partition specs against: the mesh itself, or a
    view of an engine's own mesh (torch_xla's). A public mesh where the engine needs its own
    (built before ``use_spmd()`` chose the torch_xla engine) is refused."""
    engine = engines.started()
    own = engine.own_class("Mesh") if engine is not None else None
    if type(mesh) in (Mesh, HybridMesh):
        if own is not None:
            raise SpmdError(f"{api}: this Mesh was built before use_spmd() chose the {engine.name} engine; call "
                            f"torchspmd.use_spmd() first, then build the mesh")
        return mesh
    if not isinstance(mesh, Mesh):
        raise SpmdError(f"{api}: mesh must be a torchspmd Mesh, got {type(mesh).__name__}")
    return Mesh.view(np.asarray(mesh.device_ids), mesh.mesh_shape, mesh.axis_names)


def _own_meshes():
    """The started engine when it keeps meshes of its own (torch_xla's), else None."""
    engine = engines.started()
    return engine if engine is not None and engine.own_class("Mesh") is not None else None


def set_global_mesh(mesh: Mesh | None) -> None:
    """Make ``mesh`` the default for FSDPv2 and for calls given no mesh (None clears it)."""
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise SpmdError(f"set_global_mesh(mesh=...): expected a torchspmd Mesh, got {type(mesh).__name__}")
        as_view(mesh, "set_global_mesh(mesh=...)")
    engine = _own_meshes()
    if engine is not None:
        engine.set_global_mesh(mesh)
    else:
        _GLOBAL_MESH[:] = [mesh]


def get_global_mesh() -> Mesh | None:
    """The mesh set by ``set_global_mesh``, or None."""
    engine = _own_meshes()
    if engine is not None:
        return engine.get_global_mesh()
    return _GLOBAL_MESH[0] if _GLOBAL_MESH else None


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """All devices along one axis (named ``axis_name`` if given)."""
    engine = engines.started()
    own = engine.get_1d_mesh(axis_name) if engine is not None else None
    if own is not None:
        return own
    n = runtime.global_runtime_device_count()
    return Mesh(np.arange(n), (n,), (axis_name,) if axis_name is not None else None)


_GLOBAL_MESH: list = []  # the global mesh, where the engine keeps none of its own


engines.counts_as(Mesh, "Mesh")
engines.counts_as(HybridMesh, "HybridMesh")
