"""Changes to ``torch.distributed.tensor`` (DTensor) and ``DeviceMesh``."""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Callable, Iterator

from torchspmd.patches import Patch, applied, apply, replace_attribute, skip

OP_HANDLERS = Patch(
    name="DTensor op handlers",
    library="torch",
    what="entries in DTensor's table of custom op handlers (DTensor._op_dispatcher._custom_op_handlers): losses, "
         "means and reductions over unevenly split rows, view, dropout and random ops per shard, item(), CPU "
         "flash attention per row",
    why="DTensor's own rules average per-device means (wrong for uneven splits and unevenly ignored labels), draw "
        "one mask for every shard on CPU meshes, and lack a rule for CPU flash attention (docs/data_parallel.md)",
    versions=">=2.13,<2.16",
    feature="exact losses and per-shard randomness (the native engine's global view)",
    targets=("torch.distributed.tensor:DTensor._op_dispatcher._custom_op_handlers",),
)


def handlers_table() -> dict:
    """DTensor's table of custom op handlers (op -> handler(op, args, kwargs))."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def add_op_handlers(handlers: dict) -> None:
    def install():
        table = handlers_table()
        before = {op: table[op] for op in handlers if op in table}
        table.update(handlers)

        def undo():
            for op in handlers:
                if op in before:
                    table[op] = before[op]
                else:
                    table.pop(op, None)

        return undo

    apply(OP_HANDLERS, install)


@contextlib.contextmanager
def without_handler(op) -> Iterator[None]:
    """DTensor's own handling of ``op`` inside the block (the handler set aside)."""
    table = handlers_table()
    mine = table.pop(op)
    try:
        yield
    finally:
        table[op] = mine


UNEVEN_GATHERS = Patch(
    name="torch.distributed.tensor._redistribute._optimize_transform_infos",
    library="torch",
    what="DTensor's merging of the per-axis all-gathers of a value split over several mesh axes into one over "
         "their flattened mesh is skipped when the dim does not divide evenly",
    why="torch 2.13 merges them without checking evenness: the nested split (9 over 2 then 2: 3, 2, 2, 2) is not "
        "the flat one (3, 3, 3, 0) and the gathered value is wrong (torch checks this for reduce-scatters only)",
    versions=">=2.13,<2.16",
    feature="uneven tensors split over several mesh axes",
    targets=("torch.distributed.tensor._redistribute:_optimize_transform_infos",),
    signatures={"torch.distributed.tensor._redistribute:_optimize_transform_infos": (
        ("transform_infos", "device_mesh", "src_placements", "dst_placements"),)},
)


def guard_uneven_gathers() -> None:
    """Keep per-axis all-gathers for values that do not divide evenly (torch 2.9 has no
    merging to guard: nothing to do there)."""
    try:
        r = importlib.import_module("torch.distributed.tensor._redistribute")
    except ImportError:
        skip(UNEVEN_GATHERS, "not needed on this version: torch has no DTensor redistribute module")
        return
    if not hasattr(r, "_optimize_transform_infos"):
        skip(UNEVEN_GATHERS, "not needed on this version: DTensor does not merge per-axis all-gathers")
        return

    def install():
        original = r._optimize_transform_infos

        @functools.wraps(original)
        def guarded(transform_infos, device_mesh, *args, **kwargs):
            dims: dict[int, tuple[int, int]] = {}
            for info in transform_infos:
                src = info.src_dst_placements[0]
                if info._comm_type_key() == "all_gather" and src.is_shard():
                    size, ways = dims.get(src.dim, (0, 1))
                    dims[src.dim] = (max(size, info.logical_shape[src.dim]), ways * device_mesh.size(info.mesh_dim))
            if any(size % ways for size, ways in dims.values()):
                return transform_infos
            return original(transform_infos, device_mesh, *args, **kwargs)

        return replace_attribute(r, "_optimize_transform_infos", guarded)

    apply(UNEVEN_GATHERS, install)


GROUPS_IN_MESH_ORDER = Patch(
    name="torch.distributed.device_mesh.new_group (sort_ranks=False)",
    library="torch",
    what="while a DeviceMesh over reordered devices is built, its process groups keep the mesh's order",
    why="DeviceMesh builds groups from sorted ranks while DTensor places shards by mesh coordinate: on a "
        "reordered mesh values come out permuted",
    versions=">=2.13,<2.16",
    feature="meshes over devices in another order than 0..n-1",
    targets=("torch.distributed.device_mesh:new_group",),
)


def groups_in_mesh_order():
    """A context: DeviceMesh's groups list their members in the order given."""
    def install():
        import torch.distributed.device_mesh as device_mesh_module

        original = device_mesh_module.new_group

        def in_mesh_order(*args, **kwargs):
            kwargs["sort_ranks"] = False
            return original(*args, **kwargs)

        return replace_attribute(device_mesh_module, "new_group", in_mesh_order)

    return applied(GROUPS_IN_MESH_ORDER, install)


_REDISTRIBUTE = "torch.distributed.tensor._redistribute:redistribute_local_tensor"

REDISTRIBUTION_COUNT = Patch(
    name="torch.distributed.tensor redistribute_local_tensor (counting)",
    library="torch",
    what="while a forward is checked, DTensor's redistribute_local_tensor (as its dispatcher, its API and its "
         "redistribute module call it) counts the redistributions that change a layout",
    why="the automatic data-parallel path runs a forward locally only once one forward through DTensor moved "
        "no data",
    versions=">=2.13,<2.16",
    feature="the automatic data-parallel path",
    targets=(_REDISTRIBUTE,),
    signatures={_REDISTRIBUTE: (("local_tensor", "current_spec", "target_spec", "async_op", "use_graph_based_transform",
                                 "is_explicit"),)},
)

_REDISTRIBUTING_MODULES = ("torch.distributed.tensor._redistribute", "torch.distributed.tensor._dispatch",
                           "torch.distributed.tensor._api")


def counting_redistributions(seen: Callable[[], None]):
    """A context: ``seen()`` for every redistribution that changes placements or mesh."""
    def install():
        undo = []
        for name in _REDISTRIBUTING_MODULES:
            mod = importlib.import_module(name)
            original = getattr(mod, "redistribute_local_tensor", None)
            if original is None:  # another torch: its redistributions there go uncounted, so count one now
                seen()
                continue

            @functools.wraps(original)
            def counting(local, current_spec, target_spec, *a, _original=original, **k):
                if current_spec.placements != target_spec.placements or current_spec.mesh != target_spec.mesh:
                    seen()
                return _original(local, current_spec, target_spec, *a, **k)

            undo.append(replace_attribute(mod, "redistribute_local_tensor", counting))
        return lambda: [u() for u in reversed(undo)]

    return applied(REDISTRIBUTION_COUNT, install)


REDISTRIBUTION_FALLBACK = Patch(
    name="torch.distributed.tensor redistribute_local_tensor (fallback)",
    library="torch",
    what="DTensor's redistribute_local_tensor (as its dispatcher, its API and its redistribute module call it) "
         "goes through the engine's fallback: a redistribution DTensor raises on is done again in two exact "
         "steps (gathered to Replicate on every mesh axis, then split to the target)",
    why="some layouts DTensor's sharding propagation chooses it cannot redistribute: a value split twice on one "
        "dim (_StridedShard) over a 2D mesh raises \"_StridedShard redistribute assumes no flattened transforms\" "
        "(torch 2.13 merges its per-axis gathers into one over the flattened mesh, then refuses to run the merged "
        "step); Pattern 1 on a (data, model) mesh failed in backward (docs/tensor_parallel.md)",
    versions=">=2.13,<2.16",
    feature="Pattern 1 on meshes of two or more axes",
    targets=(_REDISTRIBUTE,),
    signatures={_REDISTRIBUTE: (("local_tensor", "current_spec", "target_spec", "async_op", "use_graph_based_transform",
                                 "is_explicit"),)},
)


def redistribute_through(fallback: Callable) -> None:
    """Every call of DTensor's ``redistribute_local_tensor`` becomes ``fallback(original,
    local, current_spec, target_spec, *args, **kwargs)`` (``original``: DTensor's function)."""
    def install():
        undo = []
        for name in _REDISTRIBUTING_MODULES:
            mod = importlib.import_module(name)
            original = getattr(mod, "redistribute_local_tensor", None)
            if original is None:  # another torch: its module calls the redistribute module's function
                continue

            @functools.wraps(original)
            def through(local, current_spec, target_spec, *a, _original=original, **k):
                return fallback(_original, local, current_spec, target_spec, *a, **k)

            undo.append(replace_attribute(mod, "redistribute_local_tensor", through))
        return lambda: [u() for u in reversed(undo)]

    apply(REDISTRIBUTION_FALLBACK, install)


XLA_SHARDED_TENSOR = Patch(
    name="DTensor: XLAShardedTensor attributes",
    library="torch",
    what="DTensor gets torch_xla's XLAShardedTensor attributes global_tensor, local_shards, sharding_spec, "
         "sharding_type, partition_spec, mesh_shape and load_local_shards_ (only names DTensor lacks)",
    why="mark_sharding returns a DTensor where torch_xla returns an XLAShardedTensor; programs read these",
    versions=">=2.13,<2.16",
    feature="torch_xla's XLAShardedTensor view",
    targets=("torch.distributed.tensor:DTensor",),
)


def add_dtensor_attributes(attributes: dict) -> None:
    def install():
        from torch.distributed.tensor import DTensor

        undo = [replace_attribute(DTensor, name, value) for name, value in attributes.items()
                if not hasattr(DTensor, name)]
        return lambda: [u() for u in reversed(undo)]

    apply(XLA_SHARDED_TENSOR, install)


REDISTRIBUTE_MESH = Patch(
    name="DTensor.redistribute (a Mesh)",
    library="torch",
    what="DTensor.redistribute takes a mesh given as another object than a DeviceMesh (a torchspmd Mesh) and "
         "turns it into its DeviceMesh first; every other call is DTensor's own",
    why="--xla-compat: torch_xla's XLAShardedTensor.redistribute(mesh, placements) takes its Mesh (xs.Mesh), "
        "which DTensor refuses as another mesh ('Cross device mesh comm not supported')",
    versions=">=2.13,<2.16",
    feature="--xla-compat",
    targets=("torch.distributed.tensor:DTensor.redistribute",),
)


def redistribute_to_meshes(to_device_mesh: Callable) -> None:
    """``DTensor.redistribute(mesh, placements)`` with ``mesh`` not a DeviceMesh:
    ``to_device_mesh(mesh, tensor, placements)`` (None when it is no mesh known to the caller,
    which leaves the call as it is; it may raise on placements the caller's API refuses)."""
    def install():
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor

        original = DTensor.redistribute

        @functools.wraps(original)
        def redistribute(self, device_mesh=None, placements=None, *args, **kwargs):
            if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
                device_mesh = to_device_mesh(device_mesh, self, placements) or device_mesh
            return original(self, device_mesh, placements, *args, **kwargs)

        return replace_attribute(DTensor, "redistribute", redistribute)

    apply(REDISTRIBUTE_MESH, install)
