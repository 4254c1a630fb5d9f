"""Whether a module computes each row of its batch from that row alone: the proof the
automatic data-parallel path (``data_parallel``) needs before it runs a module on this
process's rows.

The proof has two parts, each of which can only err towards "not proven":

1. **Layouts** (``data_parallel``): the module's first call of a kind runs through DTensor
   with the batch split on dim 0. DTensor computes the global view exactly; when it needed
   no redistribution and every output is still split as the batch, each process's output
   rows were computed from its own input rows. A branch on batch values reads them on the
   host, which is a redistribution too. A layer DTensor's layouts cannot express as
   row-local (``nn.MultiheadAttention`` returning its weights reshapes through a
   ``(sequence * batch)`` view) may be listed in ``ROW_LOCAL_LAYERS``: torch's own layers,
   by their exact type and arguments, never a subclass; the redistributions inside one are
   not counted, and its outputs are put back in the batch's layout.
2. **The batch size** (``batch_size_proof``): under DTensor the program sees the global
   batch size, locally it would see its own rows' count. The module's local forward is
   traced once with a symbolic batch size (``make_fx``, fake tensors: nothing runs, no
   buffer or random stream changes). The batch size may only shape views of the batch
   (``view``, ``reshape``, ``expand``); used in any other way (a scale, an ``arange``, a
   slice length, a new tensor's size; ``torch.arange(batch size)`` only to pick each row by
   its own index excepted) the module is not proven. The trace treats every size of 2 or
   more alike; the branches it took on the batch size (guards of the shape environment, such
   as a convolution's choice of kernel) are conditions each call's sizes must meet, this
   process's, every other process's and the global batch's; a call that does not, or where
   some process would have fewer than 2 rows, runs through DTensor. A forward that cannot be
   traced (a branch on values, an operation without a fake kernel) is not proven.

Neither part is numeric: a numeric test can show that a module mixes rows, never that it
does not.
"""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from torchspmd.tree import walk_tensors

__all__ = ["ROW_LOCAL_LAYERS", "BatchSizeProof", "batch_size_proof", "row_local_layer"]


def _mha_row_local(m: nn.MultiheadAttention, args: tuple, kwargs: dict) -> bool:
    # batch first: (batch, sequence, features); masks per batch row or one for all rows
    if not m.batch_first:
        return False
    mask = kwargs.get("attn_mask", args[4] if len(args) > 4 else None)
    return mask is None or mask.dim() == 2  # a 3-D mask merges the batch with the heads


def _rnn_row_local(m: nn.RNNBase, args: tuple, kwargs: dict) -> bool:
    # batch first, no initial state (its batch is on dim 1), no packed sequence
    return m.batch_first and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)


#: torch layers row-local by their type whose layouts DTensor cannot express: exact type ->
#: whether a call (its arguments) is row-local. A subclass is never listed (its forward may
#: differ).
ROW_LOCAL_LAYERS = {
    nn.MultiheadAttention: _mha_row_local,
    nn.RNN: _rnn_row_local,
    nn.LSTM: _rnn_row_local,
    nn.GRU: _rnn_row_local,
}


def row_local_layer(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module(*args, **kwargs)`` is row-local by ``ROW_LOCAL_LAYERS``."""
    rule = ROW_LOCAL_LAYERS.get(type(module))
    return rule is not None and rule(module, args, kwargs)


class _LayerSpans:
    """While a forward is traced: the graph's nodes each call of a layer row-local by
    ``ROW_LOCAL_LAYERS`` made (their use of the batch size is the layer's own, row-local)."""

    def __init__(self, module: nn.Module):
        self.layers = [m for m in module.modules() if type(m) in ROW_LOCAL_LAYERS]
        self.spans: list[tuple[str | None, str | None]] = []
        self.open: list = []
        self.handles: list = []

    @staticmethod
    def _last() -> str | None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            return None
        last = next(iter(reversed(mode.tracer.graph.nodes)), None)
        return None if last is None else last.name

    def _pre(self, m, args, kwargs):
        self.open.append((self._last(), row_local_layer(m, args, kwargs)))

    def _post(self, m, args, kwargs, output):
        start, row_local = self.open.pop()
        end = self._last()
        if row_local and start is not None and end != start:  # (a call that made no node: nothing to exempt)
            self.spans.append((start, end))

    def __enter__(self):
        for m in self.layers:
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def nodes(self, graph) -> set[str]:
        """The names of the nodes made inside row-local calls of listed layers."""
        starts = {start: end for start, end in self.spans}
        inside: set[str] = set()
        end = None
        for node in graph.nodes:
            if end is not None:
                inside.add(node.name)
                if node.name == end:
                    end = None
            if end is None and node.name in starts:  # (a span may start where one ends)
                end = starts[node.name]
        return inside


class _Collective(Exception):
    """A traced forward asked for a collective."""


class _NoCollectives(TorchFunctionMode):
    """``torch.distributed``'s functions raise instead of running while a forward is traced
    on this process alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__module__", None) or "").startswith("torch.distributed"):
            raise _Collective(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


#: operators that may take the batch size: they reshape the batch (the global view's and the
#: local rows' shapes correspond), or read a size
_SHAPING = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
    torch.ops.aten.expand.default, torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_stride.int,
}
#: Python's arithmetic on sizes (the result is checked where it is used)
_SIZE_ARITHMETIC_MODULES = ("_operator", "operator", "torch", "math", "torch.fx.experimental.sym_node")
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional")


def _symbols(value) -> set:
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    return set(getattr(expr, "free_symbols", ()))


def _size_arithmetic(target) -> bool:
    if getattr(target, "__module__", None) in _SIZE_ARITHMETIC_MODULES and not isinstance(target, torch._ops.OpOverload):
        return True
    return target in (operator.mul, operator.add, operator.sub, operator.floordiv, operator.truediv, operator.neg,
                      operator.mod, operator.pow)


_FULL = 2**62  # a slice's end at least this: to the end


class BatchSizeProof:
    """What ``batch_size_proof`` found: ``why`` it is not proven (None: proven for the batch
    sizes its ``conditions`` admit; ``holds(sizes)`` says whether every size given does)."""

    def __init__(self, why: str | None, conditions: tuple = (), batch=None):
        self.why = why
        self.conditions = conditions  # (sympy relations in the batch size alone: the branches taken)
        self.batch = batch

    def holds(self, sizes) -> bool:
        if self.why is not None:
            return False
        for n in sizes:
            if n < 2:
                return False  # (sizes 0 and 1 the trace would have specialised)
            for expr in self.conditions:
                try:
                    if not bool(expr.xreplace({self.batch: n})):
                        return False
                except TypeError:
                    return False
        return True


def _expr(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
    return getattr(getattr(val, "node", None), "expr", val)


def _row_indices(graph, batch) -> set[str]:
    """``torch.arange(batch size)`` nodes used only to pick each batch row by its own index
    (``x[torch.arange(b)[:, None], ...]`` with ``x``'s dim 0 the batch, as transformers' mask
    functions do): row ``i`` of the result reads row ``i`` of ``x``, for any batch size."""
    found = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (torch.ops.aten.arange.default,
                                                             torch.ops.aten.arange.start):
            continue
        bounds = node.args if node.target is torch.ops.aten.arange.start else (0, *node.args)
        if len(bounds) != 2 or bounds[0] != 0 or _expr(bounds[1]) != batch:
            continue
        if all(_indexes_rows(user, node, batch) for user in node.users):
            found.add(node.name)
    return found


def _indexes_rows(user, value, batch) -> bool:
    """Whether ``user`` of the row index ``value`` (batch on its dim 0, unit dims after) only
    indexes the batch's rows with it, through unit dims added after dim 0 and whole slices."""
    aten = torch.ops.aten
    t, args = user.target, user.args
    if t is aten.add.Tensor and args[0] is value and args[1] == 0 \
            or t is aten.unsqueeze.default and args[0] is value and args[1] >= 1 \
            or t is aten.slice.Tensor and args[0] is value and len(args) >= 4 and args[2] == 0 \
            and isinstance(args[3], int) and args[3] >= _FULL and (len(args) < 5 or args[4] == 1):
        return all(_indexes_rows(u, user, batch) for u in user.users)
    if t is aten.index.Tensor and args[0] is not value and args[1] and args[1][0] is value \
            and all(i is not value for i in args[1][1:]):
        src = args[0].meta.get("val")
        return isinstance(src, torch.Tensor) and src.dim() > 0 and _expr(src.shape[0]) == batch
    return False


def batch_size_proof(module: nn.Module, args: tuple, kwargs: dict, rows: int) -> BatchSizeProof:
    """Whether ``module.forward(*args, **kwargs)`` (this process's rows: every tensor input
    has ``rows`` rows on dim 0) computes alike for every batch size, as far as the batch size
    goes: the sizes of 2 rows or more that satisfy the branches the trace took on it (torch's
    own kernel choices among them, e.g. a convolution's). The caller checks each call's sizes,
    every process's and the global batch's, with ``holds``. The module's hooks are not run."""
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    others = [d for i in tensor_at for d in flat[i].shape[1:]]
    # A size no other input dim has, so the trace gives the batch a symbol of its own (sizes 0
    # and 1 would be specialized); the branches it takes are checked for the real sizes below.
    hint = max([3, *[int(d) + 1 for d in others]])
    traced_inputs = [flat[i].new_zeros((hint, *flat[i].shape[1:])) if flat[i].dim() else flat[i] for i in tensor_at]
    for i in tensor_at:
        if flat[i].dim() and flat[i].shape[0] != rows:
            return BatchSizeProof(f"an input of shape {tuple(flat[i].shape)} does not have the batch's {rows} rows "
                                  f"on dim 0")

    def forward(*tensors):
        values = list(flat)
        for i, t in zip(tensor_at, tensors):
            values[i] = t
        a, k = pytree.tree_unflatten(values, spec)
        leaves: list = []  # (its tensors: an output object such as transformers' need not be traceable)
        walk_tensors(module.forward(*a, **k), leaves.append)
        return leaves

    layers = _LayerSpans(module)
    # (real buffers a forward updates in place, e.g. BatchNorm's count, are updated by the trace)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[]), _NoCollectives(), layers:
            graph = make_fx(forward, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*traced_inputs)
    except _Collective as e:
        return BatchSizeProof(f"its forward calls torch.distributed ({e})")
    except Exception as e:  # noqa: BLE001 - a forward the trace cannot follow is not proven
        return BatchSizeProof(f"its forward could not be traced with a symbolic batch size "
                              f"({type(e).__name__}: {str(e)[:200]})")
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    batch = None
    shape_env = None
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() and batch is None:
                size = val.shape[0]
                if not isinstance(size, torch.SymInt):
                    return BatchSizeProof("the trace fixed the batch size")
                batch = next(iter(_symbols(size)), None)
                shape_env = size.node.shape_env
    if batch is None:
        return BatchSizeProof("no input with the batch")
    exempt = layers.nodes(graph.graph) | _row_indices(graph.graph, batch)
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.name in exempt:
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace in _COLLECTIVE_NAMESPACES:
            return BatchSizeProof(f"its forward calls the collective {target}")
        if target in _SHAPING or _size_arithmetic(target):
            continue
        for arg in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, torch.fx.Node) and not isinstance(arg.meta.get("val"), torch.Tensor) \
                    and batch in _symbols(arg.meta.get("val")):
                return BatchSizeProof(f"it uses the batch size as a value ({target})")
    # Sizes of 2 and more are alike to the trace (0 and 1 it would specialise): a branch on the
    # batch size it could not decide from that alone is a guard, and the trace would hold for
    # some batch sizes only.
    conditions = []
    for guard in shape_env.guards:
        symbols = guard.expr.free_symbols
        if batch in symbols:
            if symbols != {batch}:  # (with another size, e.g. the sequence's, which may change between calls)
                return BatchSizeProof(f"it branches on the batch size with another size ({guard.expr})")
            conditions.append(guard.expr)
    return BatchSizeProof(None, tuple(conditions), batch)
