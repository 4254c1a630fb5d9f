"""Whether a tensor-parallel pair's activation may stay split between its linears: the proof,
decided on the traced forward.

A pair (``tensor_parallel``) is a column-parallel linear whose output features are split in
``n`` equal contiguous blocks over the tensor-parallel axis (block ``p`` on process ``p``)
and a row-parallel linear that takes such a split input. Keeping the activation split
between them gives one device's result only when everything the forward computes from a
column's output is computed, for each block, from that block alone, and reaches the rows'
linears as the same ``n`` blocks of their input features: an activation, a gating product,
a view into whole heads, attention per head, a norm per head. A softmax, a norm or a sum
over the features, a view into heads of another size, a value sent elsewhere (an output of
the forward, a module that is not the pair's) are not.

Two checks, each of which can only err towards "not proven":

1. **The blocks' flow** (``pair_flow``), on the forward traced with whole weights (the
   program as one device runs it): a column's output is followed as the n blocks of its
   last dim (``row_flow.Rows`` with ``n`` in place of the batch: dim ``dim`` holds
   ``outer * n * inner`` entries, entry ``c`` of block ``(c // inner) % n``), operator by
   operator with ``row_flow``'s rules, and where a rule of the batch does not hold for
   blocks: a whole value may meet the blocks only where it is broadcast over their dim; a
   view must keep each block whole entries of one dim; attention must hold the blocks on
   the heads' dim; a reduction over everything refuses. Each rows' linear's input must be
   the blocks of its last dim; no block may reach the forward's outputs.
2. **The same program on a share** (``same_on_shares``): the forward traced again with each
   process's share of the pairs' weights must run the same operators in the same order, and
   every value held in blocks must have a block's size on their dim (every other value its
   whole size). Sizes the program wrote as numbers (a view into a fixed count of heads)
   fail here, as they would fail, or compute something else, on a share.

A pair whose activation cannot be proven is computed exactly: its column's output gathered,
its row's input sliced (``tensor_parallel``). Pairs share a fate through their rows' linear
(the columns feeding it): the analysis gives, for each such group, None or why not.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from torchspmd.engines.native.global_view.row_flow import (
    Flow,
    Mixes,
    Rows,
    norm_dim,
    same_size,
    shape_of,
    size_product,
    size_quotient,
    value_of,
    where,
)

__all__ = ["pair_flow", "same_on_shares"]

aten = torch.ops.aten

#: factories shaped as their input (a dropout's mask): a share's shape where the input is split
_LIKE = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
         aten.rand_like.default, aten.randn_like.default, aten.randint_like.default}
_FULL = {aten.sum.default, aten.mean.default}
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_flash_attention.default,
              aten._scaled_dot_product_cudnn_attention.default,
              aten._scaled_dot_product_attention_math.default}


class _Failed(Exception):
    def __init__(self, why: str, groups: frozenset):
        super().__init__(why)
        self.why, self.groups = why, groups


def _features(why: str) -> str:
    """``row_flow``'s message, of the blocks instead of the batch."""
    for a, b in (("the batch's rows", "the split features"), ("the batch's dim", "the split features' dim"),
                 ("the batch", "the split features")):
        why = why.replace(a, b)
    return why


class _Blocks(Flow):
    """``row_flow.Flow`` following the ``n`` blocks of the pairs' features."""

    def __init__(self, graph, n: int, seeds: dict, skip: set):
        super().__init__(graph, n, set())
        self.n = n
        self.seeds = seeds  # column output node name -> its group
        self.skip = skip  # nodes the pairs' linears made (their compute is PyTorch's parallel styles')
        self.groups: dict[str, frozenset] = {}  # node name -> the groups whose blocks it holds

    def from_groups(self, node) -> frozenset:
        out: frozenset = frozenset()
        for a in self.tensors_in(node):
            out |= self.groups.get(a.name, frozenset())
        return out

    def run(self) -> tuple:
        for node in self.graph.nodes:
            if node.op == "output":
                for a in pytree.tree_leaves(node.args[0]):
                    if isinstance(a, torch.fx.Node) and self.of(a) is not None:
                        raise _Failed(f"a value computed from the split features ({a.name}) is an output of the "
                                      f"forward", self.groups.get(a.name, frozenset()))
                continue
            if node.op != "call_function":
                if self.rows_args(node):
                    raise _Failed(f"{node.name} is not an operator the analysis knows", self.from_groups(node))
                continue
            if node.name in self.skip:
                if node.name in self.seeds:
                    shape = shape_of(node)
                    self.state[node.name] = Rows(len(shape) - 1, 1, size_quotient(shape[-1], self.n))
                    self.groups[node.name] = frozenset([self.seeds[node.name]])
                continue
            if not self.rows_args(node):
                continue
            try:
                self.step(node)
            except Mixes as e:
                raise _Failed(_features(str(e)), self.from_groups(node)) from None
            if node.name in self.state:
                self.groups[node.name] = self.from_groups(node)
        return ()

    # -- where blocks differ from rows -------------------------------------------------------
    def step(self, node) -> None:
        target = node.target
        if target in _LIKE and isinstance(self.of(node.args[0]), Rows):
            self.set(node, self.of(node.args[0]))  # (a share of the new value on each process)
            return
        if target in _FULL:
            self.fail(node, "reduces over every dim, the split features' included")
        if target in _ATTENTION:
            self.set(node, self.attention(node))
            return
        super().step(node)
        state = self.of(node)
        if isinstance(state, str):  # (a loss reduced over everything)
            self.fail(node, "reduces over every dim, the split features' included")

    def whole_meets(self, node, state: Rows, shape_out) -> None:
        """A value free of the blocks may meet them only broadcast over their dim: on a share,
        a whole value of that size would not fit (or would mix the blocks)."""
        for a in self.tensors_in(node):
            shape = shape_of(a)
            if self.of(a) is not None or shape is None:
                continue
            d = state.dim - (len(shape_out) - len(shape))
            if d >= 0 and not same_size(shape[d], 1):
                self.fail(node, f"combines the split features with a whole value of shape {tuple(shape)}")

    def pointwise(self, node):
        state = super().pointwise(node)
        if isinstance(state, Rows):
            self.whole_meets(node, state, shape_of(node))
        return state

    def view(self, node):
        src = node.args[0]
        s = self.of(src)
        if not isinstance(s, Rows):
            self.fail(node, "meets a value it cannot follow")
        ins, out = shape_of(src), shape_of(node)
        outer = size_product(ins[:s.dim]) * s.outer
        inner = s.inner * size_product(ins[s.dim + 1:])
        for k in range(len(out)):
            new_outer, new_inner = size_quotient(outer, size_product(out[:k])), \
                size_quotient(inner, size_product(out[k + 1:]))
            if new_outer is not None and new_inner is not None and same_size(out[k], new_outer * self.n * new_inner):
                return Rows(k, new_outer, new_inner)
        self.fail(node, f"reshapes the split features {tuple(ins)} -> {tuple(out)} so that a process's share is "
                        f"not whole entries of one dim")

    def cat(self, node):
        found = None
        for t in node.args[0]:
            s = self.of(t)
            if s is None:
                if len(shape_of(t)) == 1 and same_size(shape_of(t)[0], 0):
                    continue
                self.fail(node, "joins the split features with a whole value")
            if found is not None and not (found.dim == s.dim and same_size(found.outer, s.outer)
                                          and same_size(found.inner, s.inner)):
                self.fail(node, "joins values holding the split features in different places")
            found = s
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = norm_dim(dim, len(shape_of(node)))
        if node.target is aten.stack.default:
            return Rows(found.dim + 1 if dim <= found.dim else found.dim, found.outer, found.inner)
        if dim == found.dim:
            self.fail(node, f"joins along dim {dim}, which holds the split features")
        return found

    def matmul(self, node):
        state = super().matmul(node)
        biased = node.target in (aten.addmm.default, aten.baddbmm.default)
        a, b = node.args[1:3] if biased else node.args[:2]
        if node.target in (aten.bmm.default, aten.baddbmm.default) and state.dim == 0 \
                and (self.of(a) is None) != (self.of(b) is None):
            self.fail(node, "multiplies the split features' batch of matrices with a whole one")
        bias, out = (node.args[0], shape_of(node)) if biased else (None, None)
        if bias is not None and self.of(bias) is None and shape_of(bias) is not None:
            d = state.dim - (len(out) - len(shape_of(bias)))
            if d >= 0 and not same_size(shape_of(bias)[d], 1):
                self.fail(node, f"adds a whole value of shape {tuple(shape_of(bias))} to the split features")
        return state

    def attention(self, node):
        q, k, v = node.args[:3]
        states = [self.of(x) for x in (q, k, v)]
        heads = len(shape_of(q)) - 3
        if not all(isinstance(s, Rows) and s.dim == heads and same_size(s.outer, 1) for s in states):
            self.fail(node, "attends with values not split by whole heads (or splits one of query, key and value "
                            "alone)")
        state = states[0]
        for a in self.tensors_in(node):
            if a in (q, k, v):
                continue
            s, shape = self.of(a), shape_of(a)
            if s is not None and not (s.dim == state.dim and same_size(s.inner, state.inner)) \
                    or s is None and shape is not None and len(shape) > heads and not same_size(shape[heads], 1):
                self.fail(node, "masks the split heads with a value not split alike")
        out = value_of(node)
        outs = out if isinstance(out, (tuple, list)) else [out]
        held = tuple(state if isinstance(o, torch.Tensor) and o.dim() > heads
                     and same_size(o.shape[heads], shape_of(q)[heads]) else None for o in outs)
        return held if isinstance(out, (tuple, list)) else held[0]


def pair_flow(graph, n: int, seeds: dict[str, object], ends: dict[str, object], skip: set[str],
              groups: list) -> tuple[dict, dict]:
    """Check 1 on ``graph`` (a ``row_locality.trace_forward`` trace with whole weights):
    ``seeds`` the nodes of the columns' outputs, ``ends`` the nodes of the rows' inputs (each
    -> its group), ``skip`` the nodes made inside the pairs' linears. Returns (each group ->
    None (proven) or why not, each node name -> its blocks' ``Rows`` where it holds them). A
    group that fails is taken out and the rest analysed again."""
    why: dict = {}
    live = list(groups)
    while live:
        flow = _Blocks(graph, n, {k: g for k, g in seeds.items() if g in live}, skip)
        try:
            flow.run()
            for name, g in ends.items():
                if g not in live:
                    continue
                node = next(x for x in graph.nodes if x.name == name)
                s, shape = flow.of(node), shape_of(node)
                if not (isinstance(s, Rows) and shape is not None and s.dim == len(shape) - 1
                        and same_size(s.outer, 1)):
                    raise _Failed(f"the input of its rows' linear{where(node)} is not the split features as "
                                  f"they came (a value computed from them alone, each process's share its own)",
                                  frozenset([g]) | flow.groups.get(name, frozenset()))
        except _Failed as e:
            failed = [g for g in live if g in e.groups] or live
            for g in failed:
                why[g] = e.why
            live = [g for g in live if g not in failed]
            continue
        except Exception as e:  # noqa: BLE001 - a rule that could not read an operator: not proven
            for g in live:
                why[g] = f"the analysis could not follow an operator ({type(e).__name__}: {str(e)[:200]})"
            live = []
            continue
        for g in live:
            why[g] = None
        return why, dict(flow.state)
    return why, {}


def _computing(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _number(d):
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        return int(hint) if hint is not None else str(d)
    return int(d)


def _shapes(node) -> list:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [tuple(_number(d) for d in v.shape) if isinstance(v, torch.Tensor) else None for v in vals]


def same_on_shares(whole, share, n: int, held: dict[str, object], skip: set[str]) -> str | None:
    """Check 2: trace ``share`` (the pairs' weights a process's share) computes what trace
    ``whole`` does, each value held in blocks (``held``: node name of ``whole`` -> its
    ``Rows``) a block of it. None, or where it does not."""
    a, b = _computing(whole), _computing(share)
    if len(a) != len(b):
        return f"its forward runs {len(b)} operators on a process's share of the features, {len(a)} on the whole"
    for x, y in zip(a, b):
        if x.target != y.target:
            return f"its forward runs {y.target} on a process's share where it runs {x.target} on the whole{where(x)}"
        if x.name in skip:
            continue
        states = held.get(x.name)
        states = states if isinstance(states, tuple) else [states] * len(_shapes(x))
        for sx, sy, s in zip(_shapes(x), _shapes(y), states):
            if sx is None or sy is None:
                continue
            expected = list(sx)
            if isinstance(s, Rows):
                if not isinstance(expected[s.dim], int) or expected[s.dim] % n:
                    return f"{x.target}{where(x)} gives {tuple(sx)}, whose split dim {s.dim} has no equal shares"
                expected[s.dim] //= n
            if tuple(expected) != tuple(sy):
                return (f"{x.target}{where(x)} gives {tuple(sy)} on a process's share of the features where a "
                        f"share of its whole value is {tuple(expected)} (a size the program fixed?)")
    return None
