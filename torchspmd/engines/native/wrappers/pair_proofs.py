"""Which tensor-parallel pairs of an FSDPv2 model keep their activation split, per kind of call.

A pair (``tensor_parallel.PairGroup``: a row-parallel linear and the column-parallel ones
feeding it) is formed from the modules' structure; whether what the forward does between its
linears lets the activation stay split is proven on the forward itself (``feature_flow``),
once per kind of call (the one ``unit_rows`` decides rows for: inputs' shapes and dtypes,
training mode, gradients), on the trace ``unit_rows`` makes (or one of its own where it made
none) and a second trace with each process's share of the pairs' weights. Every process
decides alike, agreed once per kind. A pair not proven computes exactly: its columns' output
gathered, its rows' input sliced.

The decision holds from the root's forward on: where gradients are recorded it stays after
the forward, so that a checkpointed unit recomputing that forward in backward computes it as
it did (a forward of another kind with gradients, run before that backward, would change
it; recomputation then stops with torch's checkpoint error, never another result).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from torchspmd.engines.native.global_view import feature_flow, row_locality
from torchspmd.engines.native.wrappers.tensor_parallel import PairGroup
from torchspmd.engines.native.global_view.unit_rows import kind_text, traceable

__all__ = ["PairProofs", "pair_groups"]


def pair_groups(root: nn.Module) -> list[PairGroup]:
    """The pair groups of every unit under ``root`` (``tensor_parallel.prepare`` made them)."""
    found: dict[int, PairGroup] = {}
    for m in root.modules():
        for g in m.__dict__.get("_torchspmd_pair_groups", ()):
            found.setdefault(id(g), g)
    return list(found.values())


def _node_name(t) -> str | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor):
        return None
    slot = get_proxy_slot(t, mode.tracer, None)
    return None if slot is None else slot.proxy.node.name


def _last() -> str | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    last = None if mode is None else next(iter(reversed(mode.tracer.graph.nodes)), None)
    return None if last is None else last.name


class _Watch:
    """While the forward is traced: the nodes of the columns' outputs (``seeds``), of the rows'
    inputs (``ends``) and those made inside the pairs' linears (``skip``, after the trace)."""

    def __init__(self, groups: list[PairGroup]):
        self.groups = groups
        self.seeds: dict[str, PairGroup] = {}
        self.ends: dict[str, PairGroup] = {}
        self.spans: list[tuple[str | None, str | None]] = []
        self.open: list = []
        self.handles: list = []
        self.graph = None

    def __enter__(self):
        for g in self.groups:
            for c in g.columns:
                self.handles.append(c.register_forward_pre_hook(self._pre))
                self.handles.append(c.register_forward_hook(self._seed(g)))
            for r in g.rows:
                self.handles.append(r.register_forward_pre_hook(self._end(g)))
                self.handles.append(r.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, module, args):
        self.open.append(_last())

    def _post(self, module, args, output):
        self.spans.append((self.open.pop(), _last()))

    def _seed(self, group):
        def hook(module, args, output):
            self._post(module, args, output)
            name = _node_name(output)
            if name is not None:
                self.seeds[name] = group
        return hook

    def _end(self, group):
        def hook(module, args):
            self._pre(module, args)
            name = _node_name(args[0]) if args else None
            self.ends[name if name is not None else f"(no input node: {group.name})"] = group
        return hook

    def skip(self) -> set[str]:
        inside: set[str] = set()
        order = [n.name for n in self.graph.graph.nodes]
        where = {name: i for i, name in enumerate(order)}
        for start, end in self.spans:
            lo = where.get(start, -1) + 1 if start is not None else 0
            hi = where.get(end, -1)
            inside.update(order[lo:hi + 1])
        return inside


class PairProofs:
    """The pair decisions of one FSDPv2 root: kind of call -> {group: None (split, proven) or
    why not}."""

    def __init__(self, root: nn.Module):
        self.groups = pair_groups(root)
        self.decided: dict = {}

    def watch(self, kind) -> _Watch | None:
        """Hooks for the trace of a kind not decided yet (None: nothing to decide)."""
        return _Watch(self.groups) if self.groups and kind not in self.decided else None

    def decide(self, kind, model: nn.Module, args: tuple, kwargs: dict, watch: _Watch | None, param_dtype,
               device_mesh) -> None:
        if watch is None:
            return
        n = self.groups[0].tp_mesh.size()
        why: dict = {}
        try:
            if watch.graph is None:  # (unit_rows did not trace this kind)
                with traceable(model, param_dtype):
                    watch.graph = row_locality.trace_forward(model, args, kwargs, watch)
        except Exception as e:  # noqa: BLE001 - a forward that cannot be traced: no pair proven
            why = {g: f"its forward could not be traced ({type(e).__name__}: {str(e)[:200]})" for g in self.groups}
        if not why:
            skip = watch.skip()
            why, held = feature_flow.pair_flow(watch.graph.graph, n, watch.seeds, watch.ends, skip, self.groups)
            proven = [g for g in self.groups if why[g] is None]
            if proven:
                shapes = {k: v for g in proven for k, v in g.share_shapes().items()}
                try:
                    with traceable(model, param_dtype, shapes):
                        share = row_locality.trace_forward(model, args, kwargs)
                    differs = feature_flow.same_on_shares(watch.graph, share, n, held, skip)
                except Exception as e:  # noqa: BLE001 - (the program fails on a share)
                    differs = f"its forward fails on a process's share of the features ({type(e).__name__}: " \
                              f"{str(e)[:200]})"
                if differs is not None:
                    why.update({g: differs for g in proven})
        # One program: every process decides alike; agreed anyway, once per kind.
        flags = torch.tensor([0 if why[g] is None else 1 for g in self.groups], dtype=torch.int32,
                             device=device_mesh.device_type)
        if dist.is_initialized():
            for d in range(device_mesh.ndim):
                if device_mesh.size(d) > 1:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=device_mesh.get_group(d))
        for g, flag in zip(self.groups, flags.tolist()):
            if why[g] is None and flag:
                why[g] = "another process could not prove it"
        self.decided[kind] = why

    @contextlib.contextmanager
    def in_effect(self, kind):
        """The pairs split as decided for ``kind`` (kept after a forward that records
        gradients, for its recomputation in backward)."""
        why = self.decided.get(kind, {})
        before = [g.split for g in self.groups]
        for g in self.groups:
            g.split = why.get(g, "undecided") is None
        try:
            yield
        finally:
            if not torch.is_grad_enabled():
                for g, b in zip(self.groups, before):
                    g.split = b

    def describe(self) -> list[tuple[str, str, str | None]]:
        """(kind of call, pair, None or why its activation is gathered), each kind decided."""
        return [(kind_text(kind), g.name, w) for kind, why in self.decided.items() for g, w in why.items()]
