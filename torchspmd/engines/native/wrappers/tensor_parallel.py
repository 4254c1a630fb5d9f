"""Tensor parallelism inside FSDPv2 units, read from the program's sharding annotations.

A parameter annotated (``mark_sharding``) over a mesh axis other than the data axes
(``'fsdp'``, and ``extra_data_axis``) is computed tensor-parallel over that axis, with
PyTorch's own parallel styles (``torch.distributed.tensor.parallel``), as torchtitan
composes them with FSDP2:

* ``nn.Linear`` whose weight is split on dim 0 (output features): column-parallel; on
  dim 1 (input features): row-parallel. A column-parallel linear followed, among its
  siblings, by a row-parallel one is a pair: the activation between them stays split
  over the axis (each process holds its share of the features, or of the heads), and
  the pair costs one all-reduce forward and one backward. A column-parallel linear with
  no row-parallel partner gathers its output (an LM head split over the vocabulary).
* ``nn.Embedding`` split on dim 0 (vocabulary): each process looks up its rows of the
  table and one all-reduce sums them; on dim 1 (hidden): the output is gathered.

What split over the data axes the annotation also asks for is FSDP's part: FSDP2 shards
every parameter over ``'fsdp'`` (on dim 0), on top of the tensor-parallel split, so the
state per process is 1/(fsdp x model) whichever of the two annotation styles is used
(``('model', None)`` or torch_xla's ``('model', 'fsdp')``).

Any other annotated parameter (a norm's weight, ``nn.MultiheadAttention``'s packed
projection, a parameter a module uses directly) keeps its layout for storage and is
gathered whole for compute, with a warning naming it; ``strict_sharding=True`` makes
that an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchspmd.engines.native.start import rng as _rng
from torchspmd.engines.native.start.device_mesh import device_mesh
from torchspmd.engines.native.global_view.module_edges import in_local_compute
from torchspmd.errors import SpmdError
from torchspmd.patches import torch as torch_patches

COL, ROW, MHA = "colwise", "rowwise", "attention"


class GatheredWholeWarning(UserWarning):
    """An annotated parameter is stored sharded but gathered whole for compute."""


def _tp_split(p: DTensor, data_dims: list[int]) -> list[tuple[int, int]]:
    """(mesh axis, tensor dim) of each split of ``p`` over a non-data axis."""
    return [(i, pl.dim) for i, pl in enumerate(p.placements) if i not in data_dims and pl.is_shard()]


def _style_of(owner: nn.Module, name: str, dim: int) -> str | None:
    if isinstance(owner, nn.Linear) and name == "weight":
        return COL if dim == 0 else ROW
    if isinstance(owner, nn.Embedding) and name == "weight":
        return "embedding_vocab" if dim == 0 else "embedding_hidden"
    return None


_NAMES = threading.local()


@contextlib.contextmanager
def naming(fqn: dict):
    """While an FSDPv2 root wraps its units, messages name parameters from the root (the
    model's own names, ``blocks.0.fc1.weight``: ``fqn``, module -> name, taken before
    wrapping), not from the unit being wrapped."""
    outer = getattr(_NAMES, "fqn", None)
    _NAMES.fqn = outer or fqn
    try:
        yield
    finally:
        _NAMES.fqn = outer


def prepare(module: nn.Module, mesh, data_dims: list[int], managed: set, strict: bool = False):
    """Make the tensor-parallel parts of the unit ``module`` (in place, before its
    ``fully_shard``). Returns the annotated parameters left for gathering on use."""
    dmesh = device_mesh(mesh)
    tree = _Tree(module)
    annotated = _annotated(module, dmesh, managed, tree)
    styles, axis_of, leftovers = _styles(annotated, mesh, data_dims, tree, strict)
    if not styles:
        return leftovers
    tp_axes = sorted(set(axis_of.values()))
    if len(tp_axes) > 1:
        raise SpmdError(
            f"FSDPv2: parameters are split over {[mesh.axis_label(a) for a in tp_axes]}; tensor parallelism "
            f"uses one mesh axis: annotate every weight over the same one"
        )
    axis = tp_axes[0]
    axis_name = mesh.axis_label(axis)
    tp_mesh = dmesh[axis_name]
    pairs = _pairs(styles, tree, tp_mesh.size(), axis_name)
    groups = _groups(pairs, tree, tp_mesh)
    ties = _ties(styles)
    for owner, style in styles.items():
        if style == MHA:
            _check_attention(tree.fqn, owner, tp_mesh.size(), axis_name, dmesh, data_dims, mesh)
            _attention_to_tp(owner, tp_mesh)
            owner._torchspmd_tp = owner.out_proj._torchspmd_tp = (axis_name, style, True)
            continue
        _to_tp_mesh(owner, annotated.get(owner, {}), data_dims, axis, tp_mesh, dmesh, style)
        parallelize_module(owner, tp_mesh, _plan(style, owner in pairs.columns, owner in pairs.rows))
        owner._torchspmd_tp = (axis_name, style, owner in pairs.columns or owner in pairs.rows)
    for group in groups:
        for start in group.starts:
            start.register_forward_hook(_enter_split(tp_mesh, group))
            start.register_forward_hook(_gather_unless_split(group))
        for row in group.rows:
            row.register_forward_pre_hook(_slice_unless_split(group), prepend=True)
        group.partner.register_forward_hook(_exit_split(group.partner))
    module._torchspmd_pair_groups = groups
    _retie(ties, tree.fqn)
    return leftovers


class _Tree:
    """The unit's modules: names (as the model names them), parents, and how PEFT adapters
    and ModuleDicts stand in for the linear layers they hold."""

    def __init__(self, module: nn.Module):
        names = dict(module.named_modules())
        self.fqn = {m: n for n, m in names.items()}
        self.fqn.update({m: n for m, n in (getattr(_NAMES, "fqn", None) or {}).items() if m in self.fqn})
        self.parent: dict[nn.Module, nn.Module] = {}
        for m in module.modules():
            for child in m.children():
                self.parent.setdefault(child, m)

    def logical(self, m: nn.Module) -> nn.Module:
        """A linear inside an adapter wrapper (PEFT's LoRA: ``base_layer``, ``lora_A``,
        ``lora_B``) or a ModuleDict stands where its wrapper stands."""
        while m in self.parent and (isinstance(self.parent[m], nn.ModuleDict) or _is_adapter(self.parent[m])):
            m = self.parent[m]
        return m

    def adapter_of(self, m: nn.Module) -> nn.Module:
        """The outermost adapter wrapping linear ``m`` (through its ModuleDicts), else ``m``:
        what runs last of the layer (never a ModuleDict, which is not called)."""
        outer = cur = m
        while cur in self.parent and (isinstance(self.parent[cur], nn.ModuleDict) or _is_adapter(self.parent[cur])):
            cur = self.parent[cur]
            if _is_adapter(cur):
                outer = cur
        return outer


def _linear(m: nn.Module) -> nn.Linear:
    return m if isinstance(m, nn.Linear) else m.base_layer


def _role(m: nn.Module, styles: dict) -> str | None:
    """The style a sibling stands for: its own, or its adapter's base layer's."""
    if isinstance(m, nn.Linear):
        return styles.get(m)
    if _is_adapter(m) and isinstance(m.base_layer, nn.Linear):
        return styles.get(m.base_layer)
    return None


def _normed_whole(col: nn.Linear, after: list) -> bool:
    """A module declared after the column with a weight over its whole output (OLMo2's
    ``q_norm`` over all heads, not per head): a norm over every feature, which a process's
    share is not. (A norm declared before it is taken for the block's input norm.)"""
    return any(not isinstance(s, nn.Linear) and not _is_adapter(s)
               and any(q.shape == (col.out_features,) for q in s.parameters()) for s in after)


def _annotated(module: nn.Module, dmesh, managed: set, tree: _Tree) -> dict[nn.Module, dict[str, DTensor]]:
    """The parameters the program annotated (DTensors FSDP2 does not manage yet), by owner."""
    annotated: dict[nn.Module, dict[str, DTensor]] = {}
    for owner in module.modules():
        for name, p in owner.named_parameters(recurse=False):
            if isinstance(p, DTensor) and p not in managed:
                if p.device_mesh != dmesh:
                    raise SpmdError(
                        f"FSDPv2: parameter {_label(tree.fqn, owner, name)!r} is sharded over another mesh than "
                        f"FSDPv2's; mark it with the same Mesh"
                    )
                annotated.setdefault(owner, {})[name] = p
    return annotated


def _styles(annotated: dict, mesh, data_dims: list[int], tree: _Tree, strict: bool) -> tuple[dict, dict, set]:
    """Each annotated module's tensor-parallel style (column, row, embedding, attention by
    heads) and mesh axis; the parameters that compute whole (left for gathering on use). A
    parameter split over the data axes only is FSDP's part: made whole for FSDP2 to shard."""
    styles: dict[nn.Module, str] = {}
    axis_of: dict[nn.Module, int] = {}
    leftovers: set = set()
    made_whole: dict[int, nn.Parameter] = {}  # a tied parameter stays one
    for owner, params in annotated.items():
        splits = {}
        for name, p in params.items():
            split = _tp_split(p, data_dims)
            if not split:
                if id(p) not in made_whole:
                    made_whole[id(p)] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                owner._parameters[name] = made_whole[id(p)]
            elif len(split) > 1:
                axes = [mesh.axis_label(a) for a, _ in split]
                raise SpmdError(
                    f"FSDPv2: parameter {_label(tree.fqn, owner, name)!r} is split over {axes}: inside FSDPv2 one "
                    f"mesh axis besides the data axes can split a parameter (tensor parallelism is one-dimensional); "
                    f"annotate it over one of them"
                )
            else:
                splits[name] = split[0]
        mha = _attention_of(owner, tree.parent)
        if mha is not None and splits and mha._qkv_same_embed_dim and all(
                (name == "in_proj_weight" and dim == 0) or (name == "in_proj_bias" and dim == 0)
                or (owner is mha.out_proj and name == "weight" and dim == 1) for name, (_, dim) in splits.items()):
            # nn.MultiheadAttention split by heads (its packed projection and out_proj)
            styles[mha] = MHA
            axis_of[mha] = next(iter(splits.values()))[0]
            continue
        style = _style_of(owner, "weight", splits["weight"][1]) if "weight" in splits else None
        if style is not None:
            styles[owner] = style
            axis_of[owner] = splits["weight"][0]
            continue
        for name, (axis, _) in splits.items():
            leftovers.add(owner._parameters[name])
            msg = (
                f"FSDPv2: {_label(tree.fqn, owner, name)!r} ({type(owner).__name__}) is annotated over "
                f"{mesh.axis_label(axis)!r} but is gathered whole for compute: tensor parallelism covers the "
                f"weights of nn.Linear and nn.Embedding and nn.MultiheadAttention's packed projection (dim 0) "
                f"and out_proj (dim 1). It stays stored as annotated; leave it unannotated to let FSDP shard it"
            )
            if strict:
                raise SpmdError(msg + " (strict_sharding=True refuses the gather)")
            warnings.warn(msg + " (strict_sharding=True makes this an error)", GatheredWholeWarning, stacklevel=5)
    return styles, axis_of, leftovers


@dataclasses.dataclass
class _Pairs:
    columns: set  # column-parallel linears whose output stays split
    rows: set  # row-parallel linears taking a split input
    starts: dict  # the column-parallel ones as their parents see them (a linear or its adapter) -> their partner
    ends: set  # the row-parallel partners as their parents see them
    partner_of: dict = dataclasses.field(default_factory=dict)  # column linear -> its partner
    rows_of: dict = dataclasses.field(default_factory=dict)  # partner -> its row-parallel linears


@dataclasses.dataclass(eq=False)
class PairGroup:
    """A row-parallel partner (a linear or its adapter) and the column-parallel linears
    feeding it: their activation stays split over the axis only while ``split`` (proven for
    the current kind of call, ``PairProofs``); else the columns' output is gathered and the
    rows' input sliced, as unpaired layers compute (exact)."""

    name: str
    tp_mesh: object
    partner: nn.Module
    columns: list  # nn.Linear
    rows: list  # nn.Linear
    starts: list  # what runs last of each column: the linear or its adapter
    split: bool = False

    def share_shapes(self) -> dict:
        """{(module, parameter name): shape} of a process's share of the pairs' weights."""
        n = self.tp_mesh.size()
        out = {}
        for c in self.columns:
            out[c, "weight"] = (c.out_features // n, c.in_features)
            if c.bias is not None:
                out[c, "bias"] = (c.out_features // n,)
        for r in self.rows:
            out[r, "weight"] = (r.out_features, r.in_features // n)
        return out


def _groups(pairs: _Pairs, tree: _Tree, tp_mesh) -> list[PairGroup]:
    groups = []
    for partner in pairs.ends:
        columns = [c for c, p in pairs.partner_of.items() if p is partner]
        starts = list(dict.fromkeys(tree.adapter_of(c) for c in columns))
        groups.append(PairGroup(tree.fqn.get(partner, type(partner).__name__), tp_mesh, partner, columns,
                                pairs.rows_of[partner], starts))
    return sorted(groups, key=lambda g: g.name)  # (every process the same order)


def _pairs(styles: dict, tree: _Tree, n: int, axis_name: str) -> _Pairs:
    """Pairs: a column-parallel linear followed among its siblings by a row-parallel one. A
    linear inside an adapter wrapper stands where its wrapper stands: all the wrapper's
    linears of one style are paired alike."""
    pairs = _Pairs(set(), set(), {}, set())
    for owner, style in styles.items():
        if style != COL or not isinstance(owner, nn.Linear) or getattr(owner, "_torchspmd_tp_gather", False):
            continue
        at = tree.logical(owner)
        up = tree.parent.get(at)
        if up is None:
            continue
        siblings = list(up.children())
        after = siblings[siblings.index(at) + 1:]
        partner = next((s for s in after if _role(s, styles) == ROW), None)
        if partner is None:
            continue
        # The activation stays split only where the row-parallel partner takes the
        # column's features as they come: the same count (an MLP's up and down, an
        # attention's query and output), or whole key/value heads of an attention whose
        # query matches it. A packed projection (gate and up in one, q/k/v in one) is cut
        # by the program (`chunk`, `split`) into pieces of the whole features, which a
        # process's share is not: its output is gathered, as an unpaired column's.
        width = _linear(partner).in_features
        cols = [_linear(s) for s in siblings[:siblings.index(partner)] if _role(s, styles) == COL]
        fits = owner.out_features == width or (
            any(c.out_features == width for c in cols) and width % owner.out_features == 0)
        if not fits or _normed_whole(owner, after):
            continue
        pairs.columns.add(owner)
        rows = [m for m in partner.modules() if styles.get(m) == ROW and tree.logical(m) is partner] \
            if partner is not owner else []
        pairs.rows.update(rows or [partner])
        pairs.rows_of[partner] = rows or [partner]
        pairs.partner_of[owner] = partner
        pairs.ends.add(partner)
        pairs.starts.setdefault(tree.adapter_of(owner), partner)
        _check_even(tree.fqn, owner, up, _linear(partner), n, axis_name)
    return pairs


def _plan(style: str, paired_column: bool, paired_row: bool):
    """torch's tensor-parallel style for a module: a paired column keeps its output split for
    its row partner; everything else leaves whole."""
    if style == COL:
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1) if paired_column else Replicate(),
                               use_local_output=True)
    if style == ROW:
        return RowwiseParallel(input_layouts=Shard(-1) if paired_row else Replicate(), output_layouts=Replicate(),
                               use_local_output=True)
    if style == "embedding_vocab":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)
    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)


def _ties(styles: dict) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Tied weights among the styled modules (an embedding and its LM head): (module, name,
    first holder, its name)."""
    first_holder: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for owner in styles:
        for name, p in owner.named_parameters(recurse=False):
            if id(p) in first_holder:
                ties.append((owner, name, *first_holder[id(p)]))
            else:
                first_holder[id(p)] = (owner, name)
    return ties


def _retie(ties: list, fqn: dict) -> None:
    """Tied weights stay one parameter (``parallelize_module`` made each module its own)."""
    for owner, name, first, first_name in ties:
        kept, made = first._parameters[first_name], owner._parameters[name]
        if tuple(kept.placements) != tuple(made.placements):
            raise SpmdError(
                f"FSDPv2: the tied weight {_label(fqn, first, first_name)!r} / {_label(fqn, owner, name)!r} is "
                f"split on a different dim by each of its modules' tensor-parallel styles "
                f"({kept.placements[0]} vs {made.placements[0]}): annotate it on dim 0 (the vocabulary)"
            )
        owner._parameters[name] = kept


def _is_adapter(m: nn.Module) -> bool:
    """A PEFT-style wrapper around a layer: ``base_layer`` beside its adapters."""
    return isinstance(getattr(m, "base_layer", None), nn.Module) and not isinstance(m, (nn.Linear, nn.Embedding))


def _label(fqn: dict, owner: nn.Module, name: str) -> str:
    prefix = fqn.get(owner, "")
    return f"{prefix}.{name}" if prefix else name


def _check_even(fqn, col: nn.Linear, up: nn.Module, row: nn.Linear, n: int, axis: str) -> None:
    """A pair keeps the activation split between its linears: the split must be even
    (DTensor re-enters a local shard assuming equal parts) and, in attention, whole heads."""
    head_dim = getattr(up, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and col.out_features % head_dim == 0:
        heads = col.out_features // head_dim
        if heads % n:
            raise SpmdError(
                f"FSDPv2: {_label(fqn, col, 'weight')!r} projects to {heads} heads, which do not split over the "
                f"{axis!r} axis of size {n}: give the axis a size dividing the number of heads (and of "
                f"key/value heads), or leave the attention unannotated"
            )
    if col.out_features % n:
        raise SpmdError(
            f"FSDPv2: {_label(fqn, col, 'weight')!r} has {col.out_features} output features, which do not split "
            f"evenly over the {axis!r} axis of size {n}; its output stays split into "
            f"{_label(fqn, row, 'weight')!r}, which needs equal parts: choose sizes divisible by {n}, "
            f"or leave the pair unannotated"
        )


def _to_tp_mesh(owner: nn.Module, params: dict, data_dims, axis: int, tp_mesh, dmesh, style: str) -> None:
    """The owner's annotated parameters as DTensors on the tensor-parallel axis alone (what
    the parallel style distributes again without a copy); the others as whole tensors."""
    wanted = {
        COL: {"weight": Shard(0), "bias": Shard(0)},
        ROW: {"weight": Shard(1), "bias": Replicate()},
        "embedding_vocab": {"weight": Shard(0)},
        "embedding_hidden": {"weight": Shard(1)},
    }[style]
    for name, p in list(owner.named_parameters(recurse=False)):
        target = wanted.get(name)
        if isinstance(p, DTensor) and p.device_mesh == dmesh:
            keep = [Replicate()] * dmesh.ndim
            if target is not None and target.is_shard() and p.placements[axis] == target:
                keep[axis] = target
                local = p.redistribute(dmesh, keep).to_local()
                new = DTensor.from_local(local, tp_mesh, [target], run_check=False, shape=p.shape, stride=p.stride())
            else:
                new = p.full_tensor()
            owner._parameters[name] = nn.Parameter(new, requires_grad=p.requires_grad)


# -- nn.MultiheadAttention split by heads ---------------------------------------------------
#
# The packed projection ``in_proj_weight`` (3E x E: q, k, v) is held, on the 'model' axis, as
# this process's heads of each of q, k and v (DTensor's _StridedShard(0, split_factor=3): the
# global value stays the module's own), and FSDP splits it on dim 1 (E) over 'fsdp';
# ``out_proj`` is row-parallel. Forward: q, k, v of the local heads from the whole input
# (whose gradient is summed over 'model'), attention on them, the output projection's
# partial sums reduced once. The packed bias and out_proj's bias stay whole (FSDP's).


def _split_stream_allowed() -> bool:
    """A pair's random stream is switched only where its row-parallel partner follows for
    sure: inside FSDPv2's local compute, or in backward (a checkpointed unit recomputing its
    forward, whose random state ``torch.utils.checkpoint`` has put back)."""

    return in_local_compute() or torch._C._current_graph_task_id() != -1


def _enter_split(tp_mesh, group: PairGroup):
    """A paired column-parallel linear's forward hook (the linear's, or its adapter's: PEFT's
    LoRA drops out the whole input of its ``lora_A`` after the base layer ran, and that mask
    must be the same on every process): random operations from its output on (dropout of
    attention weights or of the MLP's hidden features, each process's own heads or features
    of the same rows) draw from this process's split of the rows' stream, not the one every
    process along the axis shares (which would give every split the same mask)."""
    index, device_type, key = tp_mesh.get_local_rank(), tp_mesh.device_type, id(group.partner)

    def hook(module, args, output):
        if group.split and module.training and _split_stream_allowed():
            _rng.enter_split_stream(index, device_type, key)

    return hook


def _gather_unless_split(group: PairGroup):
    """A column's forward hook (after PyTorch's style, which left this process's share of the
    features): where the pair is not proven, its whole output, as an unpaired column gives it
    (its gradient: this process's share of the output's)."""

    def hook(module, args, output):
        if group.split or not isinstance(output, torch.Tensor):
            return None
        d = output.dim() - 1
        shared = DTensor.from_local(output, group.tp_mesh, [Shard(d)], run_check=False)
        return shared.redistribute(group.tp_mesh, [Replicate()]).to_local()

    return hook


def _slice_unless_split(group: PairGroup):
    """A row-parallel linear's forward pre-hook (before PyTorch's style, which takes this
    process's share of the features): where the pair is not proven, its whole input sliced to
    that share, as an unpaired row does (its gradient gathered whole)."""

    def hook(module, args):
        if group.split or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        whole = DTensor.from_local(x, group.tp_mesh, [Replicate()], run_check=False)
        return (whole.redistribute(group.tp_mesh, [Shard(x.dim() - 1)]).to_local(), *args[1:])

    return hook


@contextlib.contextmanager
def _split_stream(tp_mesh, p: float):  # (the key: any object no pair uses)
    """The attention dropout of this process's heads, from its split of the rows' stream."""
    if not p:
        yield
        return
    _rng.enter_split_stream(tp_mesh.get_local_rank(), tp_mesh.device_type, key=tp_mesh)
    try:
        yield
    finally:
        _rng.exit_split_stream(tp_mesh)


def _exit_split(partner: nn.Module):
    """A row-parallel partner's forward hook (the linear's, or its adapter's: PEFT's LoRA
    drops out the split input of its ``lora_A`` after the base layer ran): back to the rows'
    stream, its output being the same on every process along the axis."""
    key = id(partner)

    def hook(module, args, output):
        _rng.exit_split_stream(key)

    return hook


def _attention_of(owner: nn.Module, parent: dict):
    if isinstance(owner, nn.MultiheadAttention):
        return owner
    up = parent.get(owner)
    if isinstance(up, nn.MultiheadAttention) and owner is up.out_proj:
        return up
    return None


def _check_attention(fqn, mha: nn.MultiheadAttention, n: int, axis: str, dmesh, data_dims, mesh) -> None:
    label = _label(fqn, mha, "in_proj_weight")
    if mha.num_heads % n:
        raise SpmdError(
            f"FSDPv2: {label!r} projects to {mha.num_heads} heads, which do not split over the {axis!r} axis of "
            f"size {n}: give the axis a size dividing the number of heads, or leave the attention unannotated"
        )
    fsdp = dmesh.size(mesh.axis_names.index("fsdp"))
    if mha.embed_dim % fsdp:
        raise SpmdError(
            f"FSDPv2: {label!r} is split over 'fsdp' on dim 1 (its {mha.embed_dim} input features; dim 0 holds "
            f"the heads), which needs a size divisible by the 'fsdp' axis of size {fsdp}; leave the attention "
            f"unannotated, or choose sizes that divide"
        )


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _attention_to_tp(mha: nn.MultiheadAttention, tp_mesh) -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    n, r = tp_mesh.size(), tp_mesh.get_local_rank()
    w = _whole(mha.in_proj_weight)
    local = torch.cat([block.chunk(n)[r] for block in w.chunk(3)])
    new = nn.Parameter(DTensor.from_local(local.contiguous(), tp_mesh, [_StridedShard(0, split_factor=3)],
                                          run_check=False, shape=w.shape, stride=w.stride()),
                       requires_grad=mha.in_proj_weight.requires_grad)
    new._torchspmd_fsdp_dim = 1  # FSDP splits the input features: dim 0 is split by heads already
    mha._parameters["in_proj_weight"] = new
    if mha.in_proj_bias is not None:
        mha._parameters["in_proj_bias"] = nn.Parameter(_whole(mha.in_proj_bias), requires_grad=mha.in_proj_bias.requires_grad)
    out = mha.out_proj
    wo = _whole(out.weight)
    out._parameters["weight"] = nn.Parameter(
        DTensor.from_local(wo.chunk(n, dim=1)[r].contiguous(), tp_mesh, [Shard(1)], run_check=False,
                           shape=wo.shape, stride=wo.stride()), requires_grad=out.weight.requires_grad)
    if out.bias is not None:
        out._parameters["bias"] = nn.Parameter(_whole(out.bias), requires_grad=out.bias.requires_grad)
    torch_patches.replace_attention_forward(mha, functools.partial(_attention_forward, mha, tp_mesh))


def _attention_forward(mha: nn.MultiheadAttention, tp_mesh, query, key, value, key_padding_mask=None,
                       need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False):
    """nn.MultiheadAttention.forward on this process's heads (same arguments, same results)."""
    import torch.nn.functional as F

    n = tp_mesh.size()
    E, H = mha.embed_dim, mha.num_heads
    Hl, d = H // n, E // H
    if not mha.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
    W = mha.in_proj_weight
    local_w = W.to_local().chunk(3)
    b = mha.in_proj_bias
    entered: dict[int, DTensor] = {}

    def project(x, i):
        # the whole input, replicated over 'model': its gradient is the sum over the heads
        if id(x) not in entered:
            entered[id(x)] = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        wi = DTensor.from_local(local_w[i], tp_mesh, [Shard(0)], run_check=False, shape=(E, E), stride=(E, 1))
        bi = None
        if b is not None:
            bi = DTensor.from_local(b[i * E:(i + 1) * E], tp_mesh, [Replicate()], run_check=False).redistribute(
                tp_mesh, [Shard(0)])
        y = F.linear(entered[id(x)], wi, bi).to_local()
        return y.view(y.shape[0], y.shape[1], Hl, d).transpose(1, 2)  # (B, Hl, T, d)

    q, k, v = project(query, 0), project(key, 1), project(value, 2)
    B, T, S = q.shape[0], q.shape[2], k.shape[2]
    mask = _merged_mask(attn_mask, key_padding_mask, B, H, T, S, q.dtype, tp_mesh.get_local_rank() * Hl, Hl)
    p = mha.dropout if mha.training else 0.0
    weights = None
    if need_weights:
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)
        if mask is not None:
            scores = scores + mask
        elif is_causal:
            scores = scores + torch.full((T, S), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        probs = torch.softmax(scores, dim=-1)
        with torch.no_grad():
            # the averaged (or per-head) weights over every head: summed (gathered) over 'model'
            part = probs.sum(1) / H if average_attn_weights else probs
            place = [Partial()] if average_attn_weights else [Shard(1)]
            weights = DTensor.from_local(part.detach(), tp_mesh, place, run_check=False).full_tensor()
            if unbatched:
                weights = weights.squeeze(0)
        with _split_stream(tp_mesh, p):
            attn = F.dropout(probs, p, training=p > 0) @ v
    else:
        with _split_stream(tp_mesh, p):
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                  is_causal=bool(is_causal and mask is None))
    attn = attn.transpose(1, 2).reshape(B, T, Hl * d)
    o = DTensor.from_local(attn, tp_mesh, [Shard(-1)], run_check=False, shape=(B, T, E),
                           stride=(T * E, E, 1))
    out = F.linear(o, mha.out_proj.weight).redistribute(tp_mesh, [Replicate()]).to_local()
    if mha.out_proj.bias is not None:
        out = out + mha.out_proj.bias
    if unbatched:
        out = out.squeeze(0)
    elif not mha.batch_first:
        out = out.transpose(0, 1)
    return out, weights


def _merged_mask(attn_mask, key_padding_mask, B, H, T, S, dtype, first_head, Hl):
    """nn.MultiheadAttention's masks (True or -inf: not attended) as one additive float mask
    for this process's heads, or None."""
    def additive(m):
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    mask = None
    if attn_mask is not None:
        m = additive(attn_mask)
        if m.dim() == 3:  # (B * H, T, S): this process's heads
            m = m.view(B, H, T, S)[:, first_head:first_head + Hl]
        mask = m
    if key_padding_mask is not None:
        kp = additive(key_padding_mask).view(B, 1, 1, S)
        mask = kp if mask is None else mask + kp
    return mask
