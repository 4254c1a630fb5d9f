"""Where the batch's rows go through a traced forward: whether every output row is computed
from its own input row alone (the program's rows kept apart), decided on the graph.

The graph is a forward traced with a symbolic batch size (``row_locality.batch_size_proof``
makes it): the batch is the symbol on dim 0 of every tensor input. Each value of the graph
is followed as one of:

- **free**: computed without the batch's values (parameters, constants, factories, sizes);
- **rows** ``Rows(dim, outer, inner)``: dim ``dim`` holds the batch, as ``outer * batch *
  inner`` entries, and entry ``c`` belongs to row ``(c // inner) % batch``; each entry of the
  value is computed from its own row's inputs and free values alone;
- **a scalar mean or sum over the rows** (``MEAN``, ``SUM``): the whole mean (or sum) of a
  rows value, a program's loss; only an output may be one (the caller weighs it as such).

Every operator has a rule that says how its outputs follow from its inputs; an operator
without a rule that meets a rows value, a rule's condition not met (a reduction, scan,
sort, softmax, matrix product or index over the batch's dim; a view that interleaves the
rows; a value read on the host; batch data written into a free tensor in place) ends the
analysis with the reason, naming the operator and the module that called it. The analysis
can therefore only err towards "mixes rows": whatever it does not know, it refuses.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.utils._pytree as pytree

__all__ = ["MEAN", "SUM", "Flow", "Mixes", "Rows", "RowFlow", "norm_dim", "row_flow", "same_size", "shape_of",
           "size_product", "size_quotient", "value_of", "where"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """The batch on dim ``dim``: ``outer * batch * inner`` entries there, entry ``c`` of row
    ``(c // inner) % batch``."""

    dim: int
    outer: object = 1
    inner: object = 1

    def plain(self) -> bool:
        return self.dim == 0 and same_size(self.outer, 1) and same_size(self.inner, 1)


MEAN = "mean over the rows"
SUM = "sum over the rows"


class Mixes(Exception):
    """A rule not met: the message names the operator and the module that called it."""


@dataclass
class RowFlow:
    """``why``: None when every output is free, rows on dim 0 (``Rows(0)``) or a scalar mean or
    sum over the rows (``outputs`` says which, in the order of the graph's outputs)."""

    why: str | None
    outputs: tuple = ()


def _expr(size):
    return getattr(getattr(size, "node", None), "expr", size)


def same_size(a, b) -> bool:
    try:
        return sympy.expand(sympy.sympify(_expr(a)) - sympy.sympify(_expr(b))) == 0
    except (TypeError, sympy.SympifyError):
        return False


def size_product(sizes):
    out = sympy.Integer(1)
    for s in sizes:
        out = out * sympy.sympify(_expr(s))
    return out


def size_quotient(a, b):
    """``a / b`` when it is a polynomial (b divides a for every size), else None."""
    q = sympy.cancel(sympy.sympify(a) / sympy.sympify(b))
    num, den = sympy.fraction(q)
    return q if den == 1 else None


def value_of(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def shape_of(node) -> tuple | None:
    v = value_of(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# -- operator classes ----------------------------------------------------------------------

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SAME_LAYOUT = {  # each output entry is the input's entry at the same coordinates
    aten.clone.default, aten.contiguous.default, aten.detach.default, aten.alias.default,
    aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.lift_fresh_copy.default,
    aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli_.float,
    aten.bernoulli_.Tensor, aten.dropout.default, aten.feature_dropout.default,
}
_FACTORIES_LIKE = {  # a new value shaped as its input, not computed from it
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.new_empty.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty_strided.default,
}
#: reductions over the dims of argument 1 (all dims when it is None or empty), keepdim at ``keep``
_REDUCE_DIMS = {
    aten.sum.dim_IntList: 2, aten.mean.dim: 2, aten.amax.default: 2, aten.amin.default: 2,
    aten.any.dims: 2, aten.all.dims: 2, aten.logsumexp.default: 2, aten.var.correction: 3,
    aten.std.correction: 3, aten.var_mean.correction: 3, aten.std_mean.correction: 3,
    aten.linalg_vector_norm.default: 3, aten.norm.ScalarOpt_dim: 3, aten.prod.dim_int: 2,
    aten.max.dim: 2, aten.min.dim: 2, aten.argmax.default: 2, aten.argmin.default: 2, aten.any.dim: 2,
    aten.all.dim: 2, aten.var.dim: 3, aten.std.dim: 3, aten.median.dim: 2, aten.mode.default: 2,
    aten.nanmedian.dim: 2, aten.kthvalue.default: 3, aten.count_nonzero.dim_IntList: -1,
}
#: operators along one dim (argument ``1`` unless stated) that keep the shape's other dims
_ALONG_DIM = {
    aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
    aten._safe_softmax.default,
    aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default,
    aten.logcumsumexp.default, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
    aten.topk.default, aten.glu.default,
}
_DIM_ARG = {aten.sort.stable: "dim", aten.argsort.stable: "dim", aten.topk.default: 2}
_FULL_REDUCTIONS = {aten.sum.default: SUM, aten.mean.default: MEAN}
_NORMS = {aten.native_layer_norm.default, aten.rms_norm.default}


class Flow:
    """The walk over a graph, one rule per operator (``_RULES``: a method name, so that a
    subclass following another dim than the batch's overrides it)."""

    def __init__(self, graph, batch, row_index_nodes: set[str]):
        self.graph = graph
        self.batch = batch
        self.rows_index = row_index_nodes
        self.state: dict[str, object] = {}

    # -- helpers ---------------------------------------------------------------------------
    def of(self, arg):
        if isinstance(arg, torch.fx.Node):
            return self.state.get(arg.name)
        return None

    def has_batch(self, size) -> bool:
        return self.batch in getattr(sympy.sympify(_expr(size)), "free_symbols", ())

    def fail(self, node, why: str):
        raise Mixes(f"{_op_name(node.target)}{where(node)} {why}")

    def tensors_in(self, node):
        return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]

    def rows_args(self, node):
        return [(a, self.of(a)) for a in self.tensors_in(node) if self.of(a) is not None]

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> tuple:
        outputs = ()
        for node in self.graph.nodes:
            if node.op == "placeholder":
                v = value_of(node)
                if isinstance(v, torch.Tensor) and v.dim() and self.has_batch(v.shape[0]):
                    self.state[node.name] = Rows(0)
                continue
            if node.op == "get_attr":
                continue
            if node.op == "output":
                outputs = tuple(self.output_kind(node, a) for a in pytree.tree_leaves(node.args[0])
                                if isinstance(a, torch.fx.Node))
                continue
            if node.op != "call_function":
                if self.rows_args(node):
                    self.fail(node, "is not an operator the analysis knows")
                continue
            self.step(node)
        return outputs

    def output_kind(self, node, arg):
        s = self.of(arg)
        if s is None or s in (MEAN, SUM):
            return s
        if not (isinstance(s, Rows) and s.plain()):
            raise Mixes(f"an output ({arg.name}) holds the batch's rows on dim {s.dim} rather than as its dim 0")
        return s

    def set(self, node, state):
        if state is not None:
            self.state[node.name] = state

    def step(self, node) -> None:
        target = node.target
        ins = self.rows_args(node)
        if node.name in self.rows_index:
            return  # torch.arange(batch size) picking each row by its own index: free
        if node.target in (aten.unsqueeze.default, aten.add.Tensor, aten.slice.Tensor) and any(
                a.name in self.rows_index for a in self.tensors_in(node)):
            self.rows_index.add(node.name)  # (the same index on its way to picking the rows)
            return
        if not ins:
            return  # free: computed without the batch's values
        if target is operator.getitem:
            src, i = node.args
            s = self.of(src)
            if isinstance(s, tuple):
                self.set(node, s[i])
                return
            self.fail(node, "indexes a value of the batch")
        if target in _FACTORIES_LIKE:
            return
        if target is aten._local_scalar_dense.default or target is aten.item.default:
            self.fail(node, "reads a value of the batch on the host (a branch or a size from the batch's values)")
        scalar = [s for _, s in ins if s in (MEAN, SUM)]
        if scalar:
            self.scalar_step(node, ins)
            return
        if _mutates(target) and not self._mutation_ok(node):
            self.fail(node, "writes values of the batch's rows into a tensor in place")
        handler = _RULES.get(target)
        if handler is not None:
            self.set(node, getattr(self, handler)(node) if isinstance(handler, str) else handler(self, node))
            return
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            self.set(node, self.pointwise(node))
            return
        if target in _SAME_LAYOUT:
            self.set(node, self.of(node.args[0]) if self.of(node.args[0]) is not None else None)
            if isinstance(value_of(node), tuple):  # (native_dropout: the output and its mask)
                self.set(node, (self.of(node.args[0]), self.of(node.args[0])))
            return
        if target in _REDUCE_DIMS:
            self.set(node, self.reduce(node))
            return
        if target in _ALONG_DIM:
            self.set(node, self.along(node))
            return
        if target in _FULL_REDUCTIONS:
            (src, s), = ins
            self.set(node, _FULL_REDUCTIONS[target])
            return
        self.fail(node, "has no rule here (it may combine the batch's rows)")

    def _mutation_ok(self, node) -> bool:
        written = node.args[0]
        s = self.of(written)
        return isinstance(s, Rows)  # (into a free tensor: batch data would appear where none is followed)

    def scalar_step(self, node, ins) -> None:
        states = [s for _, s in ins]
        kind = states[0]
        others = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)
                  and self.of(a) is None]
        if node.target in (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar) \
                and len(ins) == 1 and ins[0][0] is node.args[0] and not others:
            self.set(node, kind)  # a mean (sum) times a number the program chose
            return
        if node.target in (aten.add.Tensor, aten.sub.Tensor) and len(ins) == 2 and states[0] == states[1] \
                and len(node.args) == 2:
            self.set(node, kind)
            return
        if node.target in (aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default):
            self.set(node, kind)
            return
        self.fail(node, f"computes further with a {kind} (only a mean or sum as the output is followed)")

    # -- rules -------------------------------------------------------------------------------
    def pointwise(self, node):
        out = shape_of(node)
        if out is None:
            self.fail(node, "gives no tensor")
        found = None
        for a in self.tensors_in(node):
            s = self.of(a)
            shape = shape_of(a)
            if shape is None:
                continue
            if s is None:
                continue
            if not isinstance(s, Rows):
                self.fail(node, "meets a value it cannot follow")
            d = s.dim + len(out) - len(shape)
            if not same_size(shape[s.dim], out[d]):
                self.fail(node, "broadcasts the batch's dim")
            mapped = Rows(d, s.outer, s.inner)
            if found is not None and not (found.dim == d and same_size(found.outer, s.outer)
                                          and same_size(found.inner, s.inner)):
                self.fail(node, "combines values holding the batch in different places")
            found = mapped
        return found

    def reduce(self, node):
        (src, s), = [(a, t) for a, t in self.rows_args(node)] or [(None, None)]
        if not isinstance(s, Rows) or src is not node.args[0]:
            self.fail(node, "reduces with a value of the batch")
        ndim = len(shape_of(src))
        target = node.target
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if target is aten.kthvalue.default:
            dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
        if target in (aten.mode.default,) and dims is None:
            dims = -1
        if dims is None or dims == []:
            self.fail(node, "reduces over every dim, the batch's included")
        dims = [dims] if isinstance(dims, int) else list(dims)
        dims = sorted(norm_dim(d, ndim) for d in dims)
        if s.dim in dims:
            self.fail(node, f"reduces over dim {s.dim}, which holds the batch's rows")
        keep_at = _REDUCE_DIMS[target]
        if target is aten.kthvalue.default:
            keep = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
        elif keep_at < 0:
            keep = False
        else:
            keep = node.args[keep_at] if len(node.args) > keep_at else node.kwargs.get("keepdim", False)
        d = s.dim if keep else s.dim - sum(1 for x in dims if x < s.dim)
        state = Rows(d, s.outer, s.inner)
        return tuple([state] * len(value_of(node))) if isinstance(value_of(node), (tuple, list)) else state

    def along(self, node):
        src = node.args[0]
        s = self.of(src)
        if not isinstance(s, Rows) or len(self.rows_args(node)) != 1:
            self.fail(node, "meets a value it cannot follow")
        key = _DIM_ARG.get(node.target, 1)
        if isinstance(key, str):
            dim = node.kwargs.get(key, -1)
        else:
            dim = node.args[key] if len(node.args) > key else node.kwargs.get("dim", -1)
        if node.target in (aten.sort.default, aten.argsort.default) and len(node.args) <= 1:
            dim = node.kwargs.get("dim", -1)
        dim = norm_dim(dim, len(shape_of(src)))
        if dim == s.dim:
            self.fail(node, f"works along dim {dim}, which holds the batch's rows")
        out = value_of(node)
        return tuple([s] * len(out)) if isinstance(out, (tuple, list)) else s

    def view(self, node):
        src = node.args[0]
        s = self.of(src)
        if not isinstance(s, Rows):
            self.fail(node, "meets a value it cannot follow")
        ins, out = shape_of(src), shape_of(node)
        outer = size_product(ins[:s.dim]) * sympy.sympify(_expr(s.outer))
        inner = sympy.sympify(_expr(s.inner)) * size_product(ins[s.dim + 1:])
        holding = [k for k, size in enumerate(out) if self.has_batch(size)]
        if len(holding) != 1:
            self.fail(node, "reshapes the batch's dim into several dims")
        k = holding[0]
        new_outer = size_quotient(outer, size_product(out[:k]))
        new_inner = size_quotient(inner, size_product(out[k + 1:]))
        if new_outer is None or new_inner is None \
                or not same_size(out[k], new_outer * self.batch * new_inner):
            self.fail(node, "reshapes the batch's rows into other rows (interleaving them)")
        return Rows(k, new_outer, new_inner)

    def expand(self, node):
        src = node.args[0]
        s = self.of(src)
        ins, out = shape_of(src), shape_of(node)
        d = s.dim + len(out) - len(ins)
        if not same_size(ins[s.dim], out[d]):
            self.fail(node, "expands the batch's dim")
        return Rows(d, s.outer, s.inner)

    def permute(self, node):
        s = self.of(node.args[0])
        ndim = len(shape_of(node.args[0]))
        if node.target is aten.permute.default:
            order = [norm_dim(d, ndim) for d in node.args[1]]
        elif node.target is aten.t.default:
            order = [1, 0] if ndim == 2 else [0]
        else:  # transpose
            a, b = (norm_dim(d, ndim) for d in node.args[1:3])
            order = list(range(ndim))
            order[a], order[b] = order[b], order[a]
        return Rows(order.index(s.dim), s.outer, s.inner)

    def unsqueeze(self, node):
        s = self.of(node.args[0])
        ndim = len(shape_of(node.args[0])) + 1
        d = norm_dim(node.args[1], ndim)
        return Rows(s.dim + 1 if d <= s.dim else s.dim, s.outer, s.inner)

    def squeeze(self, node):
        s = self.of(node.args[0])
        ins, out = shape_of(node.args[0]), shape_of(node)
        removed = [i for i in range(len(ins)) if i < len(ins) and same_size(ins[i], 1)]
        if node.target is not aten.squeeze.default:
            dims = node.args[1] if len(node.args) > 1 else []
            dims = [dims] if isinstance(dims, int) else list(dims)
            removed = [i for i in (norm_dim(d, len(ins)) for d in dims) if same_size(ins[i], 1)]
        if len(ins) - len(removed) != len(out):
            self.fail(node, "squeezes dims it cannot tell")
        return Rows(s.dim - sum(1 for i in removed if i < s.dim), s.outer, s.inner)

    def select(self, node):
        s = self.of(node.args[0])
        ndim = len(shape_of(node.args[0]))
        dim = norm_dim(node.args[1], ndim)
        if dim == s.dim:
            self.fail(node, f"picks an entry of dim {dim}, which holds the batch's rows")
        return Rows(s.dim - (1 if dim < s.dim else 0), s.outer, s.inner)

    def slice(self, node):
        s = self.of(node.args[0])
        ins = shape_of(node.args[0])
        dim = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(ins))
        if dim == s.dim:
            start = node.args[2] if len(node.args) > 2 else 0
            end = node.args[3] if len(node.args) > 3 else None
            step = node.args[4] if len(node.args) > 4 else 1
            whole = (start in (0, None) and step == 1 and (end is None or isinstance(end, int) and end >= 2**62
                                                              or same_size(_expr(value_of(end)), ins[dim])))
            if not whole:
                self.fail(node, f"slices dim {dim}, which holds the batch's rows")
        return s

    def split(self, node):
        s = self.of(node.args[0])
        ndim = len(shape_of(node.args[0]))
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if node.target is aten.unbind.int:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = norm_dim(dim, ndim)
        if dim == s.dim:
            self.fail(node, f"splits dim {dim}, which holds the batch's rows")
        if node.target is aten.unbind.int:
            s = Rows(s.dim - (1 if dim < s.dim else 0), s.outer, s.inner)
        return tuple([s] * len(value_of(node)))

    def cat(self, node):
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        out = shape_of(node)
        found = None
        for t in tensors:
            s = self.of(t)
            if s is None:
                if len(shape_of(t)) == 1 and same_size(shape_of(t)[0], 0):
                    continue  # (an empty 1-D tensor, which cat skips)
                if any(self.has_batch(x) for x in shape_of(t)):
                    continue  # (a free value shaped as the batch: the same for every row)
                self.fail(node, "joins the batch's rows with values that have none")
            if not isinstance(s, Rows) or (found is not None and (found.dim != s.dim or not same_size(found.outer, s.outer)
                                                                    or not same_size(found.inner, s.inner))):
                self.fail(node, "joins values holding the batch in different places")
            found = s
        dim = norm_dim(dim, len(out))
        if node.target is aten.stack.default:
            return Rows(found.dim + 1 if dim <= found.dim else found.dim, found.outer, found.inner)
        if dim == found.dim:
            self.fail(node, f"joins along dim {dim}, which holds the batch's rows")
        return found

    def matmul(self, node):
        t = node.target
        if t in (aten.addmm.default, aten.baddbmm.default):
            bias, a, b = node.args[:3]
        else:
            bias, (a, b) = None, node.args[:2]
        sa, sb = self.of(a), self.of(b)
        batched = t in (aten.bmm.default, aten.baddbmm.default)
        if batched:
            if sa is not None and sb is not None:
                if sa.dim == 0 and sb.dim == 0 and same_size(sa.outer, sb.outer) and same_size(sa.inner, sb.inner):
                    state = sa
                else:
                    self.fail(node, "multiplies values holding the batch in different places")
            elif sa is not None:
                if sa.dim == 2:
                    self.fail(node, "contracts over the batch's dim")
                state = sa
            else:
                if sb.dim == 1:
                    self.fail(node, "contracts over the batch's dim")
                state = sb
        else:
            if sa is not None and sb is not None:
                self.fail(node, "multiplies two values of the batch")
            if sa is not None:
                if sa.dim != 0:
                    self.fail(node, "contracts over the batch's dim")
                state = sa
            else:
                if sb.dim != 1:
                    self.fail(node, "contracts over the batch's dim")
                state = sb
        if bias is not None and self.of(bias) is not None:
            sbias, bshape = self.of(bias), shape_of(bias)
            d = sbias.dim + len(shape_of(node)) - len(bshape)
            if not (d == state.dim and same_size(sbias.outer, state.outer) and same_size(sbias.inner, state.inner)):
                self.fail(node, "adds values holding the batch in different places")
        return state

    def first_dim_op(self, node, ndim_needed=None):
        """Operators computing each entry of dim 0 of their first argument (the batch of a
        convolution, a pooling, a normalisation per entry) from that entry alone."""
        src = node.args[0]
        s = self.of(src)
        others = [a for a, t in self.rows_args(node) if a is not src]
        if others or not isinstance(s, Rows) or s.dim != 0:
            self.fail(node, "meets the batch outside its input's dim 0")
        if ndim_needed is not None and len(shape_of(src)) != ndim_needed:
            self.fail(node, "gets an input without a batch dim")
        out = value_of(node)
        return tuple([s] * len(out)) if isinstance(out, (tuple, list)) else s

    def conv(self, node):
        w = shape_of(node.args[1])
        return self.first_dim_op(node, len(w))

    def pool(self, node, spatial: int):
        return self.first_dim_op(node, spatial + 2)

    def norm(self, node):
        src = node.args[0]
        s = self.of(src)
        if len(self.rows_args(node)) != 1 or not isinstance(s, Rows):
            self.fail(node, "normalises with a value of the batch")
        normalized = len(node.args[1])
        if s.dim >= len(shape_of(src)) - normalized:
            self.fail(node, "normalises over the batch's dim")
        out = value_of(node)
        return tuple([s] * len(out)) if isinstance(out, (tuple, list)) else s

    def embedding(self, node):
        weight, indices = node.args[:2]
        if self.of(weight) is not None:
            self.fail(node, "looks up in a table computed from the batch")
        return self.of(indices)

    def index(self, node):
        src, indices = node.args[:2]
        s = self.of(src)
        idx_states = [self.of(i) if i is not None else None for i in indices]
        if s is None:
            # a free table indexed by the batch (an embedding as x[ids]): one index, on dim 0
            if len(indices) == 1 and isinstance(idx_states[0], Rows):
                return idx_states[0]
            self.fail(node, "indexes with values of the batch")
        if s.dim != 0 or not s.plain():
            self.fail(node, "indexes a value holding the batch off its dim 0")
        first = indices[0] if indices else None
        if first is None or not isinstance(first, torch.fx.Node) or first.name not in self.rows_index:
            self.fail(node, "indexes the batch's dim")
        for i, st in zip(indices[1:], idx_states[1:]):
            if st is not None and not (isinstance(st, Rows) and st.dim == 0 and st.plain()):
                self.fail(node, "indexes with values of the batch held off dim 0")
        return Rows(0)

    def attention(self, node):
        q, k, v = node.args[:3]
        states = [self.of(x) for x in (q, k, v)]
        rows = [s for s in states if s is not None]
        if any(not isinstance(s, Rows) or not s.plain() for s in rows) or len(rows) != 3:
            self.fail(node, "attends across the batch's rows")
        for a, st in self.rows_args(node):
            if a in (q, k, v):
                continue
            if not (isinstance(st, Rows) and st.plain()):
                self.fail(node, "masks with values holding the batch off dim 0")
        out = value_of(node)
        return tuple(Rows(0) if isinstance(o, torch.Tensor) and o.dim() and self.has_batch(o.shape[0]) else None
                     for o in out) if isinstance(out, (tuple, list)) else Rows(0)

    def nll(self, node):
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        if reduction != 0:
            self.fail(node, "reduces the loss over the batch with class weights or ignored targets")
        x, target = node.args[:2]
        sx, st = self.of(x), self.of(target)
        if node.args[2] is not None and self.of(node.args[2]) is not None:
            self.fail(node, "weighs classes with values of the batch")
        if not (isinstance(sx, Rows) and sx.dim == 0 and (st is None or isinstance(st, Rows) and st.dim == 0)):
            self.fail(node, "meets the batch off dim 0")
        return (sx, None)

    def sizes(self, node):
        return None  # a size of a value of the batch: not its values

    def gather(self, node):
        src, dim, index = node.args[:3]
        s, si = self.of(src), self.of(index)
        if s is None:
            return si  # (each entry read by its own index)
        dim = norm_dim(dim, len(shape_of(src)))
        if not (isinstance(s, Rows) and isinstance(si, Rows) and s.dim == si.dim and dim != s.dim
                and same_size(s.outer, si.outer) and same_size(s.inner, si.inner)
                and same_size(shape_of(src)[s.dim], shape_of(index)[si.dim])):
            self.fail(node, "gathers across the batch's rows")
        return s

    def index_select(self, node):
        src, dim, index = node.args[:3]
        s, si = self.of(src), self.of(index)
        dim = norm_dim(dim, len(shape_of(src)))
        if si is not None:
            if s is not None or not isinstance(si, Rows):
                self.fail(node, "selects across the batch's rows")
            return Rows(dim, si.outer, si.inner)
        if dim == s.dim:
            self.fail(node, f"selects along dim {dim}, which holds the batch's rows")
        return s

    def pad(self, node):
        s = self.of(node.args[0])
        pads = list(node.args[1])
        ndim = len(shape_of(node.args[0]))
        for i in range(0, len(pads), 2):
            d = ndim - 1 - i // 2
            if d == s.dim and (pads[i] != 0 or pads[i + 1] != 0):
                self.fail(node, f"pads dim {d}, which holds the batch's rows")
        return s

    def pointwise_loss(self, node):
        """A loss of each entry against its target (``reduction``: 0 none, 1 mean, 2 sum)."""
        names = [a.name for a in node.target._schema.arguments]
        at = names.index("reduction")
        reduction = node.args[at] if len(node.args) > at else node.kwargs.get("reduction", 1)
        state = self.pointwise(node) if reduction == 0 else self._aligned(node)
        return state if reduction == 0 else {1: MEAN, 2: SUM}.get(reduction) or self.fail(node, "reduces oddly")

    def _aligned(self, node):
        """The rows arguments of a reducing elementwise operator hold the batch alike."""
        found = None
        for a, s in self.rows_args(node):
            if not isinstance(s, Rows):
                self.fail(node, "meets a value it cannot follow")
            if found is not None and (len(shape_of(a)) - s.dim != found[0] or not same_size(s.outer, found[1].outer)
                                      or not same_size(s.inner, found[1].inner)):
                self.fail(node, "combines values holding the batch in different places")
            found = (len(shape_of(a)) - s.dim, s)
        return found[1]

    def where_index(self, node):
        self.fail(node, "picks entries by the batch's values (a data-dependent shape)")


def where(node) -> str:
    """`` in module 'name' (Class)``: the module whose forward made ``node`` (recorded by the trace)."""
    path, cls = node.meta.get("torchspmd_module") or ("", None)
    return f" in module {path!r} ({cls})" if path else (f" in {cls}'s forward" if cls else "")


def _mutates(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    args = schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


_RULES = {
    **{t: "view" for t in _VIEWS},
    aten.expand.default: "expand",
    aten.permute.default: "permute", aten.transpose.int: "permute", aten.t.default: "permute",
    aten.unsqueeze.default: "unsqueeze",
    aten.squeeze.default: "squeeze", aten.squeeze.dim: "squeeze", aten.squeeze.dims: "squeeze",
    aten.select.int: "select", aten.slice.Tensor: "slice",
    aten.split.Tensor: "split", aten.split_with_sizes.default: "split", aten.unbind.int: "split",
    aten.chunk.default: "split",
    aten.cat.default: "cat", aten.stack.default: "cat",
    aten.mm.default: "matmul", aten.addmm.default: "matmul", aten.bmm.default: "matmul",
    aten.baddbmm.default: "matmul",
    aten.convolution.default: "conv",
    aten.max_pool2d_with_indices.default: lambda f, n: f.pool(n, 2),
    aten.max_pool1d.default: lambda f, n: f.pool(n, 1),
    aten.avg_pool2d.default: lambda f, n: f.pool(n, 2), aten.avg_pool1d.default: lambda f, n: f.pool(n, 1),
    aten._adaptive_avg_pool2d.default: lambda f, n: f.pool(n, 2),
    aten.adaptive_avg_pool1d.default: lambda f, n: f.pool(n, 1),
    aten._native_batch_norm_legit_no_training.default: "first_dim_op",
    aten.native_group_norm.default: "first_dim_op",
    **{t: "norm" for t in _NORMS},
    aten.embedding.default: "embedding",
    aten.index.Tensor: "index",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attention",
    aten._scaled_dot_product_efficient_attention.default: "attention",
    aten._scaled_dot_product_flash_attention.default: "attention",
    aten._scaled_dot_product_cudnn_attention.default: "attention",
    aten._scaled_dot_product_attention_math.default: "attention",
    aten.nll_loss_forward.default: "nll",
    **{t: "pointwise_loss" for t in (
        aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
        aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default,
        aten.soft_margin_loss.default)},
    aten.sym_size.int: "sizes", aten.sym_numel.default: "sizes", aten.sym_stride.int: "sizes",
    aten.sym_storage_offset.default: "sizes",
    aten.copy_.default: "pointwise", aten.copy.default: "pointwise",
    aten.gather.default: "gather", aten.index_select.default: "index_select",
    aten.constant_pad_nd.default: "pad",
    aten.nonzero.default: "where_index", aten.masked_select.default: "where_index",
}


def row_flow(graph, batch, row_index_nodes: set[str] = frozenset()) -> RowFlow:
    """Follow the batch's rows through ``graph`` (a ``make_fx`` trace whose tensor inputs hold
    the batch, the symbol ``batch``, on dim 0); see the module's docstring."""
    flow = Flow(graph, batch, set(row_index_nodes))
    try:
        outputs = flow.run()
    except Mixes as e:
        return RowFlow(str(e))
    except Exception as e:  # noqa: BLE001 - a rule that could not read an operator's arguments: not proven
        return RowFlow(f"the analysis could not follow an operator ({type(e).__name__}: {str(e)[:200]})")
    return RowFlow(None, outputs)
