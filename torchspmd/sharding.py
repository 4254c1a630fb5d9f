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

import abc
import copyreg
import warnings
from typing import Any, Tuple, Union

import torch

from torchspmd import engines
from torchspmd.call_sites import result_discarded
from torchspmd.errors import SpmdError
from torchspmd.mesh import Mesh, as_view, get_global_mesh

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
    of a tuple entry must follow the mesh's order (DTensor's rule, which input ShardingSpecs
    follow; XLA and mark_sharding have none)."""
    mesh = as_view(mesh, api)
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
                    f"{where} = {entry!r}: the axes of a tuple must appear in the mesh's order {names}: here a "
                    f"dim is split over several mesh axes outermost-first in mesh order (DTensor's rule; "
                    f"mark_sharding itself takes any order). Write {ordered!r} (the same values; only which "
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


def _checked(api: str, t, mesh, partition_spec, ndim: int | None = None):
    """The engine, ``t`` checked, and the spec resolved against ``mesh``."""
    engine = engines.current(api)
    if not isinstance(t, torch.Tensor):
        raise SpmdError(f"{api}: t must be a torch.Tensor, got {type(t).__name__}")
    spec = tuple(partition_spec) if isinstance(partition_spec, list) else partition_spec
    resolved = resolve_partition_spec(mesh, spec, t.dim() if ndim is None else ndim, api,
                                      mesh_order=engine.capabilities.tuple_axes_in_mesh_order)
    return engine, spec, resolved


def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> torch.Tensor:
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

    On the torch_xla engine torch_xla annotates ``t`` in place and ``t`` itself is returned
    (moved to the device first if it was a CPU tensor). On the native engine a plain tensor
    cannot change into a DTensor in place (``torch.utils.swap_tensors`` refuses: DTensor's
    objects have another layout), so a call whose result is dropped leaves a plain ``t`` whole
    and warns (not inside a wrapper's ``shard_output`` given ``t`` as part of the module's
    output: the wrapper returns the marked value in its place); parameters and buffers are replaced in their modules, as said above. A tensor
    whose object has DTensor's layout (under ``--xla-compat``, what the program put on
    ``'xla'`` and what operations compute from it) becomes the sharded tensor in place, as on
    torch_xla, and so does a DTensor
    marked again by a call whose result is dropped.
    """
    engine, spec, resolved = _checked("mark_sharding", t, mesh, partition_spec)
    out = engine.mark_sharding(t, mesh, spec, resolved)
    if out is t or isinstance(t, torch.nn.Parameter):
        return out
    dropped = result_discarded()
    # t's object has the result's layout (a DTensor re-laid out by a call whose result is dropped; under
    # --xla-compat, a tensor the program put on 'xla'): it becomes the result in place, as on torch_xla
    if copyreg._slotnames(type(t)) == copyreg._slotnames(type(out)) and (type(t) is not type(out) or dropped):
        try:
            torch.utils.swap_tensors(t, out)
            return t
        except RuntimeError:  # (held elsewhere: by autograd for backward, a weak reference...)
            pass
    if dropped and type(t) is not type(out) and not engine.result_taken(out):
        warnings.warn(f"mark_sharding: the sharded tensor it returns is not used, and a plain tensor cannot become "
                      f"one in place (a DTensor is another Python object): t stays whole on every process (the "
                      f"values are the same; only the memory and the layout differ). Keep the result: "
                      f"`t = mark_sharding(t, mesh, {tuple(partition_spec)!r})`", stacklevel=2)
    return out


def mark_sharding_with_gradients(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> torch.Tensor:
    """torch_xla's ``mark_sharding_with_gradients``: a new tensor (``t`` is not changed) with
    ``t``'s value sharded as ``partition_spec``, whose gradient in backward is sharded the
    same way, and so is the gradient ``t`` receives when ``t`` is a DTensor (a plain tensor
    gets its gradient whole, as every plain tensor in the global view). Differentiable; for
    activations inside a model as much as for leaves."""
    engine, spec, resolved = _checked("mark_sharding_with_gradients", t, mesh, partition_spec)
    return engine.mark_sharding_with_gradients(t, mesh, spec, resolved)


def _manual_mesh(mesh, who: str):
    mesh = get_global_mesh() if mesh is None else mesh
    if mesh is None:
        raise SpmdError(f"{who}: no mesh: pass mesh=... or call set_global_mesh(mesh) first")
    return mesh


def enable_manual_sharding(t: torch.Tensor, partition_spec: PartitionSpec, *, mesh: Mesh | None = None) -> torch.Tensor:
    """torch_xla's manual sharding: ``t`` sharded as ``partition_spec`` (over ``mesh``, else the
    global mesh), then this process's shard as a plain tensor, for hand-written per-shard
    code (DTensor's ``local_map`` is the native counterpart). Like torch_xla's, the shard is
    padded with zeros to the tile size (``ceil(size / tiles)`` along each split dim), so every
    process's shard has the same shape. Differentiable. ``disable_manual_sharding`` makes a
    global tensor of the results."""
    engines.current("enable_manual_sharding")
    mesh = _manual_mesh(mesh, "enable_manual_sharding")
    engine, spec, resolved = _checked("enable_manual_sharding", t, mesh, partition_spec)
    return engine.enable_manual_sharding(t, mesh, spec, resolved)


def disable_manual_sharding(t: torch.Tensor, partition_spec: PartitionSpec, full_shape, *,
                            mesh: Mesh | None = None) -> torch.Tensor:
    """The end of a manual region: this process's shard ``t`` (padded as
    ``enable_manual_sharding`` gives it, or exactly its block) as its part of a global tensor
    of ``full_shape`` sharded as ``partition_spec``. Differentiable."""
    engine = engines.current("disable_manual_sharding")
    mesh = _manual_mesh(mesh, "disable_manual_sharding")
    full_shape = tuple(int(s) for s in full_shape)
    if not isinstance(t, torch.Tensor):
        raise SpmdError(f"disable_manual_sharding: t must be this process's shard, a tensor; got {type(t).__name__}")
    if t.dim() != len(full_shape):
        raise SpmdError(f"disable_manual_sharding: full_shape {full_shape} has {len(full_shape)} dims, the shard "
                        f"{t.dim()}")
    engine, spec, resolved = _checked("disable_manual_sharding", t, mesh, partition_spec, len(full_shape))
    return engine.disable_manual_sharding(t, mesh, spec, resolved, full_shape)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """Drop the sharding: the whole value as a plain tensor on every process. As torch_xla's
    (which clears the annotation in place), a parameter or buffer is replaced by its whole
    value in every module slot holding it."""
    return engines.current("clear_sharding").clear_sharding(t)


def get_sharding(t: torch.Tensor) -> PartitionSpec | None:
    """The partition spec of a DTensor (axis names where the mesh has them), or None for a
    tensor that is not sharded. Pending reductions (``Partial``) are not shardings and
    are not shown. On the XLA backend the spec is read from torch_xla's annotation, against
    the global mesh."""
    return engines.current("get_sharding").get_sharding(t)


class ShardingSpec(abc.ABC):
    """A reusable sharding: ``mesh`` and ``partition_spec``, checked at construction.

    ``minibatch=True`` (torch_xla's multi-host input mode) means each process's loader
    yields its own part of the global batch instead of the whole global batch. On the
    torch_xla engine this builds torch_xla's ``ShardingSpec``.
    """

    def __new__(cls, mesh, partition_spec: PartitionSpec, minibatch: bool = False):
        engine = engines.started()
        spec = tuple(partition_spec) if isinstance(partition_spec, list) else partition_spec
        if engine is not None and engine.own_class("ShardingSpec") is not None:
            resolve_partition_spec(mesh, spec, None, "ShardingSpec",
                                    mesh_order=engine.capabilities.tuple_axes_in_mesh_order)
            return engine.sharding_spec(mesh, spec, minibatch)
        return object.__new__(cls)

    def __init__(self, mesh, partition_spec: PartitionSpec, minibatch: bool = False):
        self.mesh = mesh
        self.partition_spec = tuple(partition_spec) if isinstance(partition_spec, list) else partition_spec
        self.minibatch = minibatch
        #: per tensor dim, the mesh axes splitting it
        self.resolved = resolve_partition_spec(mesh, self.partition_spec, None, "ShardingSpec")

    def __repr__(self) -> str:
        return f"ShardingSpec(mesh={self.mesh!r}, partition_spec={self.partition_spec!r}, minibatch={self.minibatch})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and (self.mesh, self.partition_spec, self.minibatch) == (
            other.mesh, other.partition_spec, other.minibatch)

    __hash__ = None

    def can_apply(self, t: torch.Tensor) -> bool:
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return mark_sharding(t, self.mesh, self.partition_spec)


engines.counts_as(ShardingSpec, "ShardingSpec")


def visualize_sharding(t: torch.Tensor | str, use_color: bool = True):
    """Print which device holds which block of a 1-D or 2-D tensor; returns the rich table.
    ``t`` may also be an HLO sharding text, as torch_xla's ``visualize_sharding`` takes
    (its first two tile dims are shown)."""
    return engines.current("visualize_sharding").visualize_sharding(t, use_color)


def visualize_tensor_sharding(t, use_color: bool = True):
    """torch_xla's name for ``visualize_sharding``."""
    return visualize_sharding(t, use_color)
