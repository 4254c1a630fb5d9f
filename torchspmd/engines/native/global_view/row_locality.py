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
   its own index excepted) the module is not proven. The trace treats every size of 1 or
   more alike (its shape environment does not assume 2 or more, so that ``batch == 1`` is a
   branch too); the branches it took on the batch size (guards of the shape environment, such
   as a convolution's choice of kernel) are conditions each call's sizes must meet, this
   process's, every other process's and the global batch's; a call that does not, or where
   some process holds no rows, runs through DTensor. A forward that cannot be traced (a
   branch on values, an operation without a fake kernel) is not proven.
3. **The rows' flow** (``row_flow``, on the same trace): each value is followed as free of
   the batch or holding its rows on a dim, operator by operator; a reduction, scan, sort or
   product over the rows, a value read on the host, or an operator without a rule is "not
   proven", named. Pipeline stages rely on it (each micro-batch is computed on its own);
   Pattern 1 relies on DTensor's layouts (part 1) instead.

Neither part is numeric: a numeric test can show that a module mixes rows, never that it
does not.
"""

from __future__ import annotations

import contextlib
import operator

import sympy
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from torchspmd.engines.native.global_view.row_flow import row_flow, where
from torchspmd.tree import walk_tensors

__all__ = ["ROW_LOCAL_LAYERS", "BatchSizeProof", "batch_size_proof", "row_local_layer", "trace_forward"]


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


def _class_name(m: nn.Module) -> str:
    """The module's class as the program wrote it (FSDP2 makes ``FSDP<Class>`` subclasses)."""
    cls = type(m)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2 \
            and cls.__bases__[0].__module__.startswith("torch.distributed.fsdp"):
        cls = cls.__bases__[1]
    return cls.__name__


class _ModuleNames:
    """While a forward is traced: each node of the graph records the module whose forward
    made it (``node.meta["torchspmd_module"]``: its name in the traced module, its class), for
    messages."""

    KEY = "torchspmd_module"

    def __init__(self, root: nn.Module):
        self.names = {}
        for name, m in root.named_modules(remove_duplicate=False):
            self.names.setdefault(id(m), (name, _class_name(m)))
        self.stack = [("", _class_name(root))]
        self.handles: list = []

    def _tag(self) -> None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            return
        for node in reversed(mode.tracer.graph.nodes):
            if self.KEY in node.meta:
                break
            node.meta[self.KEY] = self.stack[-1]

    def _pre(self, m, args):
        self._tag()
        self.stack.append(self.names.get(id(m), ("?", type(m).__name__)))

    def _post(self, m, args, output):
        self._tag()
        if len(self.stack) > 1:
            self.stack.pop()

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [register_module_forward_pre_hook(self._pre),
                        register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc):
        self._tag()
        for h in self.handles:
            h.remove()
        self.handles.clear()


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
#: operators whose contract takes the batch size as an argument (at these positions), to shape
#: their input: group norm's ``N``
_BATCH_SIZE_ARGUMENTS = {torch.ops.aten.native_group_norm.default: (3,)}
#: of those, the ones that make a view of a tensor (computations to compare, not sizes)
_VIEWING = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
            torch.ops.aten.expand.default}
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

    def __init__(self, why: str | None, conditions: tuple = (), batch=None, flow=None):
        self.why = why
        self.conditions = conditions  # (sympy relations in the batch size alone: the branches taken)
        self.batch = batch
        #: whether a call of 1 row was traced and computes as the general trace does at 1 row
        self.one_row = False
        #: where the rows go (``row_flow.RowFlow``): whether the trace keeps them apart, decided
        #: on its graph (None where the trace was not made)
        self.flow = flow

    def rows_apart(self, sizes, scalars: tuple = ()) -> str | None:
        """Why computing on a share of the rows may give other rows than computing on all of
        them (None: proven, for shares and batches of every size in ``sizes``): the batch size
        used as a value, rows mixed (``row_flow``; an output that is a mean or sum over the rows
        only where ``scalars`` admits its kind), sizes the trace does not cover."""
        if self.why is not None:
            return self.why
        if self.flow is None:
            return "its forward was not analysed"
        if self.flow.why is not None:
            return self.flow.why
        kinds = [k for k in self.flow.outputs if isinstance(k, str) and k not in scalars]
        if kinds:
            return f"it returns a {kinds[0]} (a scalar computed from every row)"
        if any(n < 1 for n in sizes):
            return "a share without rows: the proof covers 1 row or more"
        if not self.holds(sizes):
            return f"the branches its trace took on the batch size do not hold for {sorted(set(sizes))} rows"
        return None

    def holds(self, sizes) -> bool:
        if self.why is not None:
            return False
        for n in sizes:
            if n < 1:
                return False  # (a share without rows: not traced)
            if n == 1 and self.one_row:
                continue
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


def _symbolic_inputs(tensors: list) -> list:
    """Fake inputs for the trace: every dim a size of its own (as ``make_fx``'s symbolic mode
    gives), dims of size 1 fixed, and the batch size not assumed to be 2 or more (the
    default shape environment specialises 0 and 1 and so decides ``batch == 1`` without a
    guard): every branch the trace takes on the batch size, ``== 1`` included, is a guard."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from torch.utils._sympy.numbers import int_oo

    shape_env = ShapeEnv(specialize_zero_one=False)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
    out = []
    for t in tensors:
        dims = [DimDynamic.STATIC if i and int(d) <= 1 else DimDynamic.DUCK for i, d in enumerate(t.shape)]
        fake = mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))
        for i, size in enumerate(fake.shape):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if isinstance(expr, sympy.Symbol):
                # the batch: 1 row or more; the other sizes, as the default environment has them
                shape_env.constrain_symbol_range(expr, 1 if i == 0 else 2, int_oo)
        out.append(fake)
    return out


def _trace(module: nn.Module, flat: list, spec, tensor_at: list[int], size: int, layers=None, watch=None):
    """``module.forward`` traced with fake inputs of ``size`` rows, the batch a symbol
    (``_symbolic_inputs``); the module's real buffers are left as they were."""
    from torch.fx.experimental.proxy_tensor import make_fx

    traced_inputs = [flat[i].new_zeros((size, *flat[i].shape[1:])) if flat[i].dim() else flat[i] for i in tensor_at]

    def forward(*tensors):
        values = list(flat)
        for i, t in zip(tensor_at, tensors):
            values[i] = t
        a, k = pytree.tree_unflatten(values, spec)
        leaves: list = []  # (its tensors: an output object such as transformers' need not be traceable)
        walk_tensors(module.forward(*a, **k), leaves.append)
        return leaves

    # (real buffers a forward updates in place, e.g. BatchNorm's count, are updated by the trace)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[]), _NoCollectives(), (layers or contextlib.nullcontext()), \
                (watch or contextlib.nullcontext()), _ModuleNames(module):
            return make_fx(forward, tracing_mode="symbolic", _allow_non_fake_inputs=True)(
                *_symbolic_inputs(traced_inputs))
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


#: views that give their input back when the shapes are equal (a trace may leave such a
#: one out where it knows the sizes are equal: compared as their input)
_IDENTITY_WHEN_SAME_SHAPE = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default,
                             torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
                             torch.ops.aten.expand.default, torch.ops.aten.alias.default}


#: operators that copy their input's values (a trace makes one where the layout needs it:
#: reshaping an expanded tensor with some sizes but not others)
_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.contiguous.default}
#: views that read their input's values alike (compared as one operator)
_AS_VIEW = {torch.ops.aten._unsafe_view.default: torch.ops.aten.view.default,
            torch.ops.aten.reshape.default: torch.ops.aten.view.default}


def _computations(gm, env: dict) -> tuple[list, dict]:
    """The graph's nodes that compute (operators on tensors; not sizes, not placeholders),
    and the views among them that give their input back (node -> its input)."""
    out, same = [], {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) \
                or node.target in _SHAPING and node.target not in _VIEWING:
            continue  # (a size or size arithmetic)
        if node.target in _COPIES and isinstance(node.args[0], torch.fx.Node):
            same[node] = node.args[0]  # (a copy: the values of its input, in another layout)
            continue
        if node.target in _IDENTITY_WHEN_SAME_SHAPE and isinstance(node.args[0], torch.fx.Node):
            src = node.args[0].meta.get("val")
            val = node.meta.get("val")
            if isinstance(src, torch.Tensor) and isinstance(val, torch.Tensor) and len(src.shape) == len(val.shape) \
                    and all(_concrete(x, env) == _concrete(y, env) for x, y in zip(src.shape, val.shape)) \
                    and (node.target is not torch.ops.aten.slice.Tensor or len(node.args) < 5 or node.args[4] == 1):
                same[node] = node.args[0]
                continue
        out.append(node)
    return out, same


def _hints(shape_env) -> dict:
    """The traced value of each size symbol (``backed_var_to_val`` on newer torch)."""
    hints = getattr(shape_env, "backed_var_to_val", None)
    return hints if hints is not None else shape_env.var_to_val


def _concrete(value, env: dict):
    expr = getattr(getattr(value, "node", None), "expr", value)
    if isinstance(expr, sympy.Basic):
        expr = expr.xreplace(env)
        return int(expr) if expr.is_Integer else expr
    return value


def _same_computation(general, batch, one) -> bool:
    """Whether trace ``one`` (made with 1 row) computes what trace ``general`` computes with
    its batch size set to 1: the same operators in the same order on the same arguments
    (sizes compared as numbers, the other sizes at their traced values)."""
    envs = []
    for gm, sym in ((general, batch), (one, None)):
        shape_env = next((v.node.shape_env for n in gm.graph.nodes
                          for v in [n.meta.get("val")] if isinstance(v, torch.SymInt)), None)
        if shape_env is None:
            for n in gm.graph.nodes:
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor):
                    for d in v.shape:
                        if isinstance(d, torch.SymInt):
                            shape_env = d.node.shape_env
                            break
                if shape_env is not None:
                    break
        env = {} if shape_env is None else {k: sympy.Integer(int(v)) for k, v in _hints(shape_env).items()}
        if sym is not None:
            env[sym] = sympy.Integer(1)  # (in the 1-row trace every size is at its traced value)
        envs.append(env)
    (a, same_a), (b, same_b) = _computations(general, envs[0]), _computations(one, envs[1])
    if len(a) != len(b):
        return False
    index_a = {n: i for i, n in enumerate(a)}
    index_b = {n: i for i, n in enumerate(b)}
    places_a = {n: i for i, n in enumerate(n for n in general.graph.nodes if n.op == "placeholder")}
    places_b = {n: i for i, n in enumerate(n for n in one.graph.nodes if n.op == "placeholder")}

    def key(leaf, gm, index, places, env):
        if isinstance(leaf, torch.fx.Node):
            while leaf in same_a or leaf in same_b:
                leaf = same_a.get(leaf, same_b.get(leaf))
            if leaf in index:
                return ("node", index[leaf])
            if leaf.op == "placeholder":
                return ("input", places[leaf])
            if leaf.op == "get_attr":
                value = getattr(gm, leaf.target)
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.numel() <= 64:
                    # a constant the forward made (torch.tensor(...)): a new tensor in each trace
                    return ("constant", value.dtype, tuple(value.shape), tuple(value.detach().flatten().tolist()))
                return ("attr", id(value))
            return ("value", _concrete(leaf.meta.get("val"), env))  # (a size: a number in the other trace)
        return ("value", _concrete(leaf, env))

    def shapes(node, env):
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        return [tuple(_concrete(d, env) for d in v.shape) if isinstance(v, torch.Tensor) else None for v in vals]

    for x, y in zip(a, b):
        # the same operator on the same arguments giving the same shapes (squeeze() drops a
        # dim of 1 row: the shapes tell)
        if _AS_VIEW.get(x.target, x.target) != _AS_VIEW.get(y.target, y.target) \
                or shapes(x, envs[0]) != shapes(y, envs[1]):
            return False
        lx = pytree.tree_leaves((x.args, x.kwargs))
        ly = pytree.tree_leaves((y.args, y.kwargs))
        if len(lx) != len(ly):
            return False
        for u, v in zip(lx, ly):
            if key(u, general, index_a, places_a, envs[0]) != key(v, one, index_b, places_b, envs[1]):
                return False
    return True


def _trace_inputs(args: tuple, kwargs: dict) -> tuple:
    """(flat inputs, their tree, where the tensors are, the traced batch size): a size no
    other input dim has, so that the trace gives the batch a symbol of its own."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    others = [d for i in tensor_at for d in flat[i].shape[1:]]
    return flat, spec, tensor_at, max([3, *[int(d) + 1 for d in others]])


def trace_forward(module: nn.Module, args: tuple, kwargs: dict, watch=None):
    """``module.forward(*args, **kwargs)`` traced as ``batch_size_proof`` traces it (fake
    inputs, the batch a symbol; nothing runs), with ``watch`` (a context manager, e.g. hooks
    recording nodes) entered around it. Raises what the trace raises."""
    flat, spec, tensor_at, hint = _trace_inputs(args, kwargs)
    return _trace(module, flat, spec, tensor_at, hint, watch=watch)


def batch_size_proof(module: nn.Module, args: tuple, kwargs: dict, rows: int, one_row: bool = False,
                     watch=None) -> BatchSizeProof:
    """Whether ``module.forward(*args, **kwargs)`` (this process's rows: every tensor input
    has ``rows`` rows on dim 0) computes alike for every batch size, as far as the batch size
    goes: the sizes of 1 row or more that satisfy the branches the trace took on it (torch's
    own kernel choices among them, e.g. a convolution's). The caller checks each call's sizes,
    every process's and the global batch's, with ``holds``. With ``one_row``, a call of 1 row
    is also traced and compared: where it computes what the general trace computes at 1 row,
    1 row is covered whatever the branches. The module's hooks are not run. ``watch``: as
    ``trace_forward``'s; the trace is left on it as ``watch.graph``."""
    # The batch a symbol of its own; the branches the trace takes are checked for the real sizes below.
    flat, spec, tensor_at, hint = _trace_inputs(args, kwargs)
    for i in tensor_at:
        if flat[i].dim() and flat[i].shape[0] != rows:
            return BatchSizeProof(f"an input of shape {tuple(flat[i].shape)} does not have the batch's {rows} rows "
                                  f"on dim 0")
    layers = _LayerSpans(module)
    try:
        graph = _trace(module, flat, spec, tensor_at, hint, layers, watch)
    except _Collective as e:
        return BatchSizeProof(f"its forward calls torch.distributed ({e})")
    except Exception as e:  # noqa: BLE001 - a forward the trace cannot follow is not proven
        return BatchSizeProof(f"its forward could not be traced with a symbolic batch size "
                              f"({type(e).__name__}: {str(e)[:200]})")
    if watch is not None:
        watch.graph = graph  # (the trace, for another analysis of the same forward)
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
    row_indices = _row_indices(graph.graph, batch)
    exempt = layers.nodes(graph.graph) | row_indices
    flow = row_flow(graph.graph, batch, row_indices)
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.name in exempt:
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace in _COLLECTIVE_NAMESPACES:
            return BatchSizeProof(f"its forward calls the collective {target}{where(node)}")
        if target in _SHAPING or _size_arithmetic(target):
            continue
        sized = _BATCH_SIZE_ARGUMENTS.get(target, ())
        for arg in pytree.tree_leaves(([a for i, a in enumerate(node.args) if i not in sized], node.kwargs)):
            if isinstance(arg, torch.fx.Node) and not isinstance(arg.meta.get("val"), torch.Tensor) \
                    and batch in _symbols(arg.meta.get("val")):
                return BatchSizeProof(f"it uses the batch size as a value ({target}{where(node)})")
    # Every batch size of 1 or more is alike to the trace: a branch on the batch size (``== 1``
    # included) is a guard, and the trace holds for the sizes that meet the guards only.
    conditions = []
    for guard in shape_env.guards:
        symbols = guard.expr.free_symbols
        if batch in symbols:
            if symbols != {batch}:  # (with another size, e.g. the sequence's, which may change between calls)
                return BatchSizeProof(f"it branches on the batch size with another size ({guard.expr})")
            conditions.append(guard.expr)
    proof = BatchSizeProof(None, tuple(conditions), batch, flow)
    if one_row and not proof.holds([1]):
        try:
            single = _trace(module, flat, spec, tensor_at, 1)
        except Exception:  # noqa: BLE001 - (then 1 row is not covered)
            return proof
        proof.one_row = _same_computation(graph, batch, single)
    return proof
