"""Pipeline stages' graph edits: the traced split made runnable stage by stage (skip
connections relayed through the stages between, the trace's metadata checks dropped, a
vocabulary-split lookup's pending sum reduced at once)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["relay_skip_connections", "drop_metadata_checks", "reduce_lookups_at_once"]


def _stage_calls(graph) -> dict:
    """The traced split's top-level stage calls: node -> stage index."""
    import re

    calls = {}
    for node in graph.nodes:  # (torch names them submod_<k>, or submod_pp_<k> on newer versions)
        found = re.fullmatch(r"submod_(?:[a-z]+_)?(\d+)", node.target) if node.op == "call_module" else None
        if found:
            calls[node] = int(found.group(1))
    return calls


def _source_call(node):
    """The stage call whose output ``node`` is (through getitem), or None."""
    import operator

    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node if node.op == "call_module" else None


def relay_skip_connections(split_gm) -> None:
    """Make every value a stage sends to a stage two or more further on travel through the
    stages between instead (each takes it as an input and returns a copy as one more
    output): torch's schedules with several stages per process send only between adjacent
    stages. A transformers decoder's rotary position embeddings, computed once before the
    layers, are such values. The values and their gradients are the same: a copy passes the
    gradient back unchanged."""

    graph = split_gm.graph
    calls = _stage_calls(graph)
    by_index = {k: node for node, k in calls.items()}
    relayed: dict = {}  # (value node, stage) -> the node of that stage's output carrying it
    changed = False
    for dst in sorted(by_index):
        call = by_index[dst]
        dst_inputs = [n for n in split_gm.get_submodule(call.target).graph.nodes if n.op == "placeholder"]
        for i, arg in enumerate(list(call.args)):
            source = _source_call(arg) if hasattr(arg, "op") else None
            if source is None or dst - calls[source] <= 1:
                continue
            value = arg
            for k in range(calls[source] + 1, dst):
                key = (arg, k)
                if key not in relayed:
                    relayed[key] = _relay_through(split_gm, by_index[k], value, dst_inputs[i].meta)
                value = relayed[key]
            args = list(call.args)  # (as a relay left them: a stage's whole output may now be its item 0)
            args[i] = value
            call.args = tuple(args)
            changed = True
    if changed:
        graph.lint()
        split_gm.recompile()


def _relay_through(split_gm, call, value, meta: dict):
    """Stage ``call`` takes ``value`` (a top-level node) as an input, unless it already does,
    and returns a copy of it as its last output; returns the top-level node of that output."""
    import operator

    import torch.fx as fx

    graph = split_gm.graph
    sub = split_gm.get_submodule(call.target)
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if value in call.args:
        held = inputs[list(call.args).index(value)]
    else:
        with sub.graph.inserting_after(inputs[-1]):
            held = sub.graph.placeholder(f"relayed_{value.name}")
        held.meta = dict(meta)
        call.args = (*call.args, value)
    output = next(n for n in sub.graph.nodes if n.op == "output")
    with sub.graph.inserting_before(output):
        copy = sub.graph.call_function(torch.ops.aten.clone.default, (held,))
    copy.meta = dict(meta)
    outs = output.args[0]
    several = isinstance(outs, (tuple, list))
    output.args = ((*outs, copy) if several else (outs, copy),)
    sub.graph.lint()
    sub.recompile()
    getitems = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
    if not several:  # its one output was used whole: now item 0 of two
        users = list(call.users)
        with graph.inserting_after(call):
            first = graph.call_function(operator.getitem, (call, 0))
        for u in users:
            u.replace_input_with(call, first)
        getitems, count = [first], 1
    else:
        count = len(outs)
    # (torch's stage numbers its outputs by the order of these getitem nodes: this one last)
    last = max(getitems, key=lambda n: list(graph.nodes).index(n)) if getitems else call
    with graph.inserting_after(last):
        out: fx.Node = graph.call_function(operator.getitem, (call, count))
    return out


def _edit_graphs(stage: nn.Module, edit: Callable[[torch.fx.Graph], bool]) -> None:
    """Apply ``edit`` to each graph of a stage's modules (the stage's and its outlined
    submodules'); a graph it changed (``edit`` returns True) is regenerated."""
    for m in stage.modules():
        graph = getattr(m, "graph", None)
        if isinstance(graph, torch.fx.Graph) and edit(graph):
            if isinstance(m, torch.fx.GraphModule):
                m.recompile()
            elif callable(getattr(m, "finalize", None)):  # torch.export's InterpreterModule
                m.finalize()


def drop_metadata_checks(stage: nn.Module) -> None:
    """Remove the trace's ``aten._assert_tensor_metadata`` nodes (checks of a tensor's dtype
    and device, results unused) from a stage's graphs: DTensor has no rule for them, and the
    stage computes with DTensors where weights are split over 'model'."""
    check = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    if check is None:
        return

    def drop(graph) -> bool:
        found = [n for n in graph.nodes if n.op == "call_function" and n.target is check.default and not n.users]
        for node in found:
            graph.erase_node(node)
        return bool(found)

    _edit_graphs(stage, drop)


class _Summed(torch.autograd.Function):
    """A DTensor with pending sums carried out; its gradient whole (pending sums of the
    gradient carried out too), which an embedding lookup's backward takes for any table
    layout (the gradient of a table split by vocabulary is then laid out as the table by
    ``_gradients_laid_out_as_parameters``)."""

    @staticmethod
    def forward(ctx, t):
        return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
        return grad


def _whole_if_partial(t):
    """``t`` with a pending sum over 'model' carried out (an embedding split by vocabulary)."""
    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        return _Summed.apply(t)
    return t


def reduce_lookups_at_once(stage: nn.Module) -> None:
    """After each embedding lookup of a stage's graphs, its pending sum is carried out: a
    lookup in a table split by vocabulary leaves each process's rows masked and a sum
    pending, whose mask DTensor keeps for one reduction only, and the traced graph may use
    the lookup twice (transformers' decoders: the residual and the norm)."""

    def reduce(graph) -> bool:
        found = [n for n in graph.nodes
                 if n.op == "call_function" and n.target is torch.ops.aten.embedding.default and n.users]
        for node in found:
            with graph.inserting_after(node):
                whole = graph.call_function(_whole_if_partial, (node,))
            node.replace_all_uses_with(whole, delete_user_cb=lambda user, whole=whole: user is not whole)
        return bool(found)

    _edit_graphs(stage, reduce)
