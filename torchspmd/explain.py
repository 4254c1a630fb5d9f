"""``explain(model, step_fn=None, strict=False)``: what a model's parameters look like on
this process, and which collectives one training step runs.

Layouts are read from the parameters themselves (``model.named_parameters()``: a plain
module, a Pattern 1 module with DTensor parameters, or an FSDPv2-wrapped model, whose
names are the unwrapped module's). Collectives are counted by PyTorch's
``torch.distributed.tensor.debug.CommDebugMode`` while ``step_fn`` runs: the counts,
the names of the collectives and the forward/backward phase are its own. What it does not
keep (the process group and the tensors of each call) is read from the arguments of the
very calls it counts, as they pass through it: the mesh axes of the group, its size and
the bytes of the call. Where they cannot be read, the report says so.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchspmd import engines
from torchspmd.errors import SpmdError
from torchspmd.mesh import get_global_mesh

__all__ = ["explain", "Explanation", "ParamLayout", "Collective", "Regathered"]


@dataclass
class ParamLayout:
    """One parameter on this process."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple  # per tensor dim: None, an axis name, or a tuple of axis names (mesh order)
    placements: str  # the DTensor placements as torch writes them; "" for a plain tensor
    mesh: str  # "fsdp=2, model=2" for a DTensor; "" for a plain tensor
    local_numel: int  # elements stored on this process
    numel: int  # elements of the whole parameter
    compute: str  # how forward uses it (FSDP all-gather, tensor-parallel style, gathered whole, ...)
    gathered_whole: bool = False

    @property
    def fraction(self) -> float:
        return self.local_numel / self.numel if self.numel else 1.0


@dataclass
class Collective:
    """Calls of one collective, alike in phase, module, group and size."""

    kind: str  # CommDebugMode's name of the op, e.g. "c10d_functional.all_reduce", "c10d._allgather_base_"
    phase: str  # "forward" or "backward" (CommDebugMode's module tracker; "forward" outside autograd)
    module: str  # the module CommDebugMode's tracker was in ("Global": outside any module)
    axis: str | None  # mesh axes the group spans ("model", "fsdp", "fsdp+model"), "world"; None: unknown
    group_size: int | None  # None: the group could not be read from the call
    count: int
    bytes: int | None  # per call: the whole buffer (all-gather output, reduce-scatter input, all-reduce tensor)

    @property
    def family(self) -> str:
        """all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, send, recv, ... (from ``kind``)."""
        return _family(self.kind)


@dataclass
class Regathered:
    """Redistributions DTensor refused (it raised), alike in op, place and layouts, which the
    native engine did as a gather to Replicate on every mesh axis and a split to the target."""

    op: str  # the op whose argument was redistributed ("aten.mm.default"); "redistribute": an explicit call
    phase: str  # "forward" or "backward" (CommDebugMode's module tracker); "" without step_fn
    module: str  # the module running ("Global": outside any); "" without step_fn
    source: str  # placements before
    target: str  # placements asked for
    shape: tuple[int, ...]
    error: str  # what DTensor raised
    count: int


@dataclass
class Explanation:
    """What ``explain`` found: ``str()`` renders it as tables."""

    layouts: list[ParamLayout]
    collectives: list[Collective]
    comm_counts: dict[str, int] | None = None  # CommDebugMode.get_comm_counts(), by name; None without step_fn
    total: int | None = None  # CommDebugMode.get_total_counts()
    gathered_whole: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    regathered: list[Regathered] = field(default_factory=list)
    #: FSDPv2 (native engine): each kind of call decided so far and where its model computes:
    #: None on this process's rows (proven row-local), else why on the global view
    row_paths: list[tuple[str, str | None]] = field(default_factory=list)
    #: FSDPv2 (native engine) with tensor-parallel pairs: (kind of call, pair, None where its
    #: activation stays split between its linears (proven), else why it is gathered)
    pair_paths: list[tuple[str, str, str | None]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Calls per family (all_gather, reduce_scatter, all_reduce, ...), from CommDebugMode's counts."""
        out: dict[str, int] = {}
        for kind, n in (self.comm_counts or {}).items():
            out[_family(kind)] = out.get(_family(kind), 0) + n
        return out

    def __str__(self) -> str:
        lines = ["Parameters (this process)"]
        rows = [("name", "shape", "mesh axes per dim", "local / whole numel", "compute")]
        for p in self.layouts:
            axes = ", ".join("-" if a is None else a if isinstance(a, str) else "+".join(a) for a in p.axes)
            rows.append((p.name, "x".join(map(str, p.shape)) or "scalar", f"({axes})" if p.axes else "()",
                         f"{p.local_numel} / {p.numel} ({_frac(p.local_numel, p.numel)})",
                         ("GATHERED WHOLE: " if p.gathered_whole else "") + p.compute))
        lines += _table(rows)
        local = sum(p.local_numel for p in self.layouts)
        whole = sum(p.numel for p in self.layouts)
        lines.append(f"total: {local} of {whole} elements on this process ({_frac(local, whole)})")
        if self.gathered_whole:
            lines.append(f"gathered whole for compute (stored sharded, all-gathered in full on every forward): "
                         f"{', '.join(self.gathered_whole)}")
        if self.comm_counts is not None:
            lines.append("")
            lines.append(f"Collectives of one step (CommDebugMode: {self.total} calls)")
            rows = [("collective", "phase", "module", "group", "calls", "bytes per call")]
            for c in self.collectives:
                group = "?" if c.group_size is None else f"{c.axis or '?'} (size {c.group_size})"
                rows.append((c.kind, c.phase, c.module, group, str(c.count),
                             "?" if c.bytes is None else _size(c.bytes)))
            if len(rows) > 1:
                lines += _table(rows)
            else:
                lines.append("(none)")
            if self.comm_counts:
                lines.append("counts: " + ", ".join(f"{k} {v}" for k, v in self.comm_counts.items()))
        if self.regathered:
            lines.append("")
            lines.append("Redistributions DTensor refused, done as a gather to Replicate and a split (exact; each "
                         "moves the whole tensor)")
            rows = [("op", "phase", "module", "from", "to", "shape", "calls")]
            for r in self.regathered:
                rows.append((r.op, r.phase or "?", r.module or "?", r.source, r.target,
                             "x".join(map(str, r.shape)) or "scalar", str(r.count)))
            lines += _table(rows)
            lines += [f"DTensor raised: {e}" for e in dict.fromkeys(r.error for r in self.regathered)]
        if self.row_paths:
            lines.append("")
            lines.append("Where FSDPv2's model computes, per kind of call (this process's rows only where proven)")
            rows = [("call", "computes on")]
            for kind, why in self.row_paths:
                rows.append((kind, "this process's rows (proven)" if why is None else f"the whole batch: {why}"))
            lines += _table(rows)
        if self.pair_paths:
            lines.append("")
            lines.append("Tensor-parallel pairs, per kind of call (the activation split between the linears only "
                         "where proven)")
            rows = [("call", "pair (row-parallel partner)", "activation")]
            for kind, pair, why in self.pair_paths:
                rows.append((kind, pair, "split (proven)" if why is None else f"gathered whole: {why}"))
            lines += _table(rows)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- layouts ----------------------------------------------------------------------------


def _owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    out: dict[int, tuple[nn.Module, str]] = {}
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), (m, n))
    return out


def _fsdp_managed(model: nn.Module) -> set[int] | None:
    """ids of the parameters FSDP2 manages; None when the model has no FSDP2 unit."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return None
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    managed: set[int] = set()
    for unit in units:
        state = unit._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            for fp in group.fsdp_params:
                managed.add(id(fp.sharded_param))
    return managed


def _split_dim(pl) -> int | None:
    """The tensor dim a placement splits: Shard(d), and _StridedShard(d) (FSDP2's split of a
    dim another axis already splits: it is not a Shard, and its is_shard() is False)."""
    if pl.is_shard():
        return pl.dim
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        return None
    return pl.dim if isinstance(pl, _StridedShard) else None


def _axes(p: DTensor) -> tuple:
    names = p.device_mesh.mesh_dim_names
    per_dim: list[list] = [[] for _ in range(p.ndim)]
    for i, pl in enumerate(p.placements):
        if _split_dim(pl) is not None:
            per_dim[_split_dim(pl) % max(p.ndim, 1)].append(names[i] if names else str(i))
    return tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in per_dim)


def _mesh_text(p: DTensor) -> str:
    names = p.device_mesh.mesh_dim_names or tuple(str(i) for i in range(p.device_mesh.ndim))
    return ", ".join(f"{n}={s}" for n, s in zip(names, p.device_mesh.shape))


def _layouts(model: nn.Module) -> tuple[list[ParamLayout], list[str]]:
    owners = _owners(model)
    managed = _fsdp_managed(model)
    layouts, whole = [], []
    for name, p in model.named_parameters():
        owner, attr = owners.get(id(p), (None, name.rsplit(".", 1)[-1]))
        tp = getattr(owner, "_torchspmd_tp", None)
        gathered = False
        parts = []
        if managed is not None and id(p) in managed:
            parts.append("FSDP all-gather")
        if tp is not None and attr in ("weight", "bias"):
            axis, style, paired = tp
            parts.append(f"tensor-parallel {style} over {axis!r}" + (" (paired)" if paired else ""))
        if managed is not None and id(p) not in managed and isinstance(p, DTensor) and tp is None:
            # FSDPv2 left it outside FSDP (tensor_parallel.prepare could not compute it
            # split): _gather_on_use all-gathers it whole before its owner's forward.
            if any(_split_dim(pl) is not None for pl in p.placements):
                gathered = True
                whole.append(name)
                parts.append(f"all-gathered before each {type(owner).__name__}.forward, outside FSDP")
        unwrapped = engines.planned().tensor_parallel_layout(owner) if owner is not None and tp is None else None
        if unwrapped is not None and attr in ("weight", "bias") and isinstance(p, DTensor):
            parts.append(f"tensor-parallel {unwrapped} over 'model' (no wrapper: Megatron's layouts)")
        if not parts:
            if isinstance(p, DTensor):
                parts.append("DTensor ops" if any(not pl.is_replicate() for pl in p.placements) else "replicated")
            else:
                parts.append("whole on every process" if managed is None else "whole (outside FSDP)")
        if isinstance(p, DTensor):
            local = p.to_local().numel()
            layouts.append(ParamLayout(name, tuple(p.shape), str(p.dtype).replace("torch.", ""), _axes(p),
                                       str(tuple(p.placements)), _mesh_text(p), local, p.numel(), ", ".join(parts),
                                       gathered))
        else:
            layouts.append(ParamLayout(name, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                                       (None,) * p.dim(), "", "", p.numel(), p.numel(), ", ".join(parts)))
    return layouts, whole


# -- collectives ------------------------------------------------------------------------


def _family(kind: str) -> str:
    op = kind.rsplit(".", 1)[-1].strip("_").lower().replace("_", "")
    for key, fam in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
                     ("allreduce", "all_reduce"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"),
                     ("gather", "gather"), ("scatter", "scatter"), ("reduce", "reduce"), ("send", "send"),
                     ("recv", "recv")):
        if key in op:
            return fam
    return kind


def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _nbytes(args: tuple, kwargs: dict, out: Any) -> int | None:
    """The largest buffer of the call: the all-gather's output, the reduce-scatter's input,
    the all-reduce's tensor (each argument position summed over its list of tensors)."""
    sizes = [sum(t.numel() * t.element_size() for t in _tensors(a)) for a in (*args, *kwargs.values(), out)]
    return max(sizes) if any(sizes) else None


def _group(args: tuple, kwargs: dict):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in (*args, *kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except Exception:
                continue
        if isinstance(a, str):  # functional collectives name their group
            try:
                return _resolve_process_group(a)
            except Exception:
                continue
    return None


def _axis_names(meshes: list) -> dict[frozenset, str]:
    """Rank sets of this process's groups along every combination of mesh axes."""
    import torch.distributed as dist

    me = dist.get_rank()
    out: dict[frozenset, str] = {}
    for dm in meshes:
        grid = dm.mesh
        names = dm.mesh_dim_names or tuple(str(i) for i in range(dm.ndim))
        where = (grid == me).nonzero()
        if len(where) == 0:
            continue
        coord = where[0].tolist()
        for r in range(1, dm.ndim + 1):
            for dims in itertools.combinations(range(dm.ndim), r):
                index = tuple(slice(None) if d in dims else coord[d] for d in range(dm.ndim))
                ranks = frozenset(grid[index].flatten().tolist())
                out.setdefault(ranks, "+".join(names[d] for d in dims))
    out.setdefault(frozenset(range(dist.get_world_size())), "world")
    return out


def _meshes(model: nn.Module) -> list:
    seen: dict[int, Any] = {}
    for p in model.parameters():
        if isinstance(p, DTensor):
            dm = p.device_mesh
            seen.setdefault(id(dm), dm)
            root = getattr(dm, "_get_root_mesh", lambda: None)()
            if root is not None:
                seen.setdefault(id(root), root)
    try:

        g = get_global_mesh()
        if g is not None and getattr(g, "_device_mesh", None) is not None:
            seen.setdefault(id(g._device_mesh), g._device_mesh)
    except Exception:  # pragma: no cover
        pass
    # the largest meshes first: their axis names win for the same ranks
    return sorted(seen.values(), key=lambda dm: -dm.ndim)


def _tracker_class():
    """CommDebugMode's module tracker, keeping one post-forward hook per module.

    torch's ``_CommModeModuleTracker._fw_pre_hook`` registers a forward hook (the one that
    pops its ``parent_list``) on a module each time that module's forward starts, and only
    removes the last one per module name on exit: a module called n times in the step pops
    n times on its n-th call (IndexError in ``_fw_set_module_hook``), and the hooks left
    behind pop on later calls, after the mode. transformers 5.25 requires ``kernels``, whose
    ``use_kernel_forward_from_hub`` makes functions such as Llama's ``apply_rotary_pos_emb``
    one module-level ``nn.Module`` that every attention layer calls."""
    try:
        from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker
    except ImportError:  # pragma: no cover - another torch: its own tracker
        return None

    class _Tracker(_CommModeModuleTracker):
        def __enter__(self):
            self._post_hooks: dict[nn.Module, Any] = {}  # module -> its one hook's handle
            return super().__enter__()

        def _fw_pre_hook(self, mod, input):
            handles = self.register_forward_hook_handles
            name = self._get_mod_name(mod)
            before = handles.get(name)
            super()._fw_pre_hook(mod, input)
            added = handles.get(name)
            if added is not None and added is not before:  # torch hooked mod (again)
                if mod in self._post_hooks:  # already hooked on an earlier call: that hook pops
                    added.remove()
                else:
                    self._post_hooks[mod] = added

        def __exit__(self, *args):
            super().__exit__(*args)
            for handle in self._post_hooks.values():
                handle.remove()
            self._post_hooks.clear()

    return _Tracker


def _comm_mode_class():
    from torch.distributed.tensor.debug import CommDebugMode

    tracker = _tracker_class()

    class _SizedCommDebugMode(CommDebugMode):
        """CommDebugMode, which counts the collectives; for each call it counted, the
        group and the tensors of that call are noted (CommDebugMode keeps neither)."""

        def __init__(self):
            super().__init__()
            if tracker is not None:
                self.advanced_module_tracker = tracker()
            self.calls: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = dict(self.comm_counts)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func in _point_to_point():  # (CommDebugMode counts collectives only)
                self.comm_counts[func.overloadpacket] += 1  # (keyed as CommDebugMode keys its ops)
            changed = [k for k, n in self.comm_counts.items() if before.get(k, 0) != n]
            if changed:  # CommDebugMode counted this call as a collective
                kind = changed[0]
                tracker = self.advanced_module_tracker
                kwargs = kwargs or {}
                try:
                    group = _group(args, kwargs)
                except Exception:
                    group = None
                try:
                    nbytes = _nbytes(args, kwargs, out)
                except Exception:
                    nbytes = None
                self.calls.append((str(kind), "backward" if tracker.is_bw else "forward", tracker.name, group,
                                   nbytes))
            return out

    return _SizedCommDebugMode


def _point_to_point() -> tuple:
    """c10d's send and receive ops (ring attention passes keys and values with them)."""
    ops = torch.ops.c10d
    return tuple(getattr(ops, name).default for name in ("send", "recv_") if hasattr(ops, name))


def _clean_module(name: str) -> str:
    """The tracker's module name without FSDPv2's ``_orig_module`` hops."""
    return ".".join(p for p in name.split(".") if p != "_orig_module") or name


def _regathered(events: list, counts: dict | None = None) -> list[Regathered]:
    """The engine's gather-and-split fallback records (``Engine.watching_fallbacks``), alike ones counted together (``counts``: given)."""
    rows: dict[tuple, int] = {}
    for e in events:
        key = (e.op, e.phase, e.module, e.source, e.target, e.shape, e.error)
        rows[key] = rows.get(key, 0) + (counts[e] if counts is not None else 1)
    return [Regathered(*key, count=n) for key, n in rows.items()]


def _collectives(model: nn.Module, step_fn: Callable[[], Any]) -> tuple[list[Collective], dict, int, list[str],
                                                                          list[Regathered]]:
    import torch.distributed as dist

    mode = _comm_mode_class()()

    def where() -> tuple[str, str]:
        tracker = mode.advanced_module_tracker
        return ("backward" if tracker.is_bw else "forward"), _clean_module(tracker.name)

    # The exact loss's small sums as the backend's all-reduces (on one machine a training step
    # makes them through shared memory: docs/data_parallel.md, "Exact global losses").
    with mode, warnings.catch_warnings(), engines.planned().watching_fallbacks(where) as fallbacks:
        # CommDebugMode's module tracker puts a full backward hook on every module; torch warns
        # for each whose inputs need no gradient (the first layer's): the tracker's noise.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        # ... and warn about modules returning containers (transformers' ModelOutput)
        warnings.filterwarnings("ignore", message="For backward hooks to be called, module output should be")
        # ... and when two modules of one name nest (kernels' function modules, outside the model,
        # are all named by their class): it counts the nesting per name, so the names stay right
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        fmt = warnings.formatwarning  # which ModTracker replaces, for good, before that warning
        try:
            step_fn()
        finally:
            warnings.formatwarning = fmt
    counts = {str(k): v for k, v in mode.get_comm_counts().items()}
    total = mode.get_total_counts()
    notes: list[str] = []
    names = _axis_names(_meshes(model)) if dist.is_available() and dist.is_initialized() else {}
    rows: dict[tuple, int] = {}
    for kind, phase, module, group, nbytes in mode.calls:
        size = axis = None
        if group is not None:
            try:
                ranks = frozenset(dist.get_process_group_ranks(group))
                size, axis = len(ranks), names.get(ranks)
            except Exception:
                size = group.size()
        key = (kind, phase, _clean_module(module), axis, size, nbytes)
        rows[key] = rows.get(key, 0) + 1
    collectives = [Collective(k, ph, m, ax, sz, n, b) for (k, ph, m, ax, sz, b), n in rows.items()]
    if collectives:
        notes.append("phase and module are CommDebugMode's (its module tracker): a call after backward (the "
                     "optimizer step, an .item() not started by backward) shows the phase 'forward' and the last "
                     "module backward reached")
        notes.append("bytes per call: the whole buffer (an all-gather's output, a reduce-scatter's input, an "
                     "all-reduce's tensor), read from the call's tensors")
        notes.append("the exact loss's small sums (a batch's ignored-target counts, a loss's pending sum) are "
                     "listed as all-reduces; when the processes share one machine, steps outside explain make "
                     "them through shared memory")
    seen = sum(c.count for c in collectives)
    if seen != total:  # pragma: no cover - the notes come from the calls CommDebugMode counted
        notes.append(f"{total - seen} of CommDebugMode's {total} calls have no size or group noted")
    if any(c.group_size is None for c in collectives):
        notes.append("'?' group: the call's process group could not be read from its arguments")
    if any(c.group_size is not None and c.axis is None for c in collectives):
        notes.append("'?' axis: the group matches no axes of the parameters' meshes")
    if any(c.bytes is None for c in collectives):
        notes.append("'?' bytes: the call had no tensor arguments to measure")
    return collectives, counts, total, notes, _regathered(fallbacks)


# -- the entry point --------------------------------------------------------------------


def explain(model: nn.Module, step_fn: Callable[[], Any] | None = None, strict: bool = False) -> Explanation:
    """Explain ``model`` on this process: each parameter's global shape, the mesh axes
    splitting each of its dims, its elements here and in whole, and how forward computes
    with it; with ``step_fn`` (a zero-argument callable running one training step), the
    collectives the step runs, as ``CommDebugMode`` counts them, with their mesh axes
    and bytes per call.

    Parameters annotated over a non-data axis that FSDPv2 gathers whole for compute are
    listed (``gathered_whole``); ``strict=True`` raises ``SpmdError`` naming them (before
    running ``step_fn``).

    For an FSDPv2 model (native engine), where it computes per kind of call decided so far
    (``row_paths``: this process's rows where proven, else the whole batch and why).

    Redistributions DTensor refused and the native engine did as a gather and a split are
    listed (``regathered``): with ``step_fn``, those of the step, with the op, the phase and
    the module; without it, those this process did so far.

    Every process returns its ``Explanation``; rank 0 prints it.
    """
    import torch.distributed as dist

    layouts, whole = _layouts(model)
    if strict and whole:
        raise SpmdError(
            f"explain(strict=True): {', '.join(repr(n) for n in whole)} "
            f"{'is' if len(whole) == 1 else 'are'} annotated over a non-data axis but gathered whole for "
            f"compute inside FSDPv2 (only nn.Linear and nn.Embedding weights compute tensor-parallel); leave "
            f"{'it' if len(whole) == 1 else 'them'} unannotated to let FSDP shard "
            f"{'it' if len(whole) == 1 else 'them'}, or accept the gather"
        )
    result = Explanation(layouts, [], gathered_whole=whole)
    if step_fn is not None:
        result.collectives, result.comm_counts, result.total, result.notes, result.regathered = _collectives(
            model, step_fn)
    else:  # those this process did so far (where, only a step_fn's tracker knows)
        seen = engines.planned().fallbacks_seen()
        result.regathered = _regathered(list(seen), seen)
    paths = getattr(model, "row_paths", None)
    if callable(paths):
        result.row_paths = paths()
        result.pair_paths = model.pair_paths()
        if getattr(model, "per_process", False) is True:
            result.notes.append("FSDPv2(per_process=True): every call computes on this process's rows, unanalysed")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(result, flush=True)
    return result


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]


def _frac(a: int, b: int) -> str:
    if b == 0 or a == b:
        return "all"
    from fractions import Fraction

    f = Fraction(a, b)
    return f"{f.numerator}/{f.denominator}" if f.denominator <= 1024 else f"{a / b:.3f}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
