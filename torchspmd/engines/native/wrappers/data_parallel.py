"""The native engine's data parallelism with replicated parameters, as fast as DDP: ``replicate``
and the automatic path.

The module computes on each process's rows of the global batch; its gradients are summed
in buckets by PyTorch's own DistributedDataParallel reducer, with ``gradient_sums``' hook
(through shared memory on one machine). Inputs and outputs stay global DTensors.

The same path is taken without the wrapper (``auto``): a module whose parameters are
all plain (replicated) and that is called with a batch split over the data axes runs on
this process's rows only once ``row_locality``'s proof holds for that kind of call: its
first call runs through DTensor, which records every redistribution (none may be needed,
except inside torch's layers listed as row-local by type, and every output must be split
as the batch), then its local forward is traced with a symbolic batch size (the size only
shapes views, and every branch on it holds for the local and the global batch). Later
calls of that kind compute locally with DDP's reducer and give the same values (a call
whose sizes the proof does not cover, such as one where a process would have fewer than 2
rows, runs on DTensor); a kind of call not proven stays on DTensor (exact).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from torchspmd import accelerators, patches
from torchspmd.engines.native.communication import gradient_sums
from torchspmd.engines.native.global_view import row_locality
from torchspmd.engines.native.start import global_mode
from torchspmd.engines.native.start.device_mesh import device_mesh
from torchspmd.engines.native.global_view.module_edges import (
    inputs_to_local,
    local_rows_stream,
    outputs_to_global,
    shares,
)
from torchspmd.errors import SpmdError
from torchspmd.patches import dtensor as dtensor_patches
from torchspmd.patches import torch as torch_patches
from torchspmd.tree import map_tensors, walk_tensors

__all__ = ["replicate", "set_auto_replicate"]


def _data_group(dmesh, data_dims: list[int], axis_names):
    if len(data_dims) == 1:
        return dmesh.get_group(data_dims[0])
    names = [axis_names[d] for d in data_dims]
    return dmesh[tuple(names)]._flatten().get_group()


class _Accumulation:
    """Gradients accumulated over several backward passes stay exact.

    DDP's reducer all-reduces what a parameter's ``.grad`` holds after the backward
    pass: with a sum (our losses already divide by the global batch) a gradient left
    from an earlier backward, the same on every process, would be counted once per
    process. Just before this backward's gradient is accumulated, the earlier one is
    set aside; when the backward (and DDP's reduction) is over it is added back.
    """

    def __init__(self, params: list[torch.Tensor]):
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.queued = False
        for p in params:
            p.register_hook(self._hook(weakref.ref(p)))

    def _hook(self, ref):
        def hook(grad):
            p = ref()
            if p is not None and p.grad is not None:
                self.saved[id(p)] = (p, p.grad)
                p.grad = None
                if not self.queued:
                    self.queued = True
                    # Runs at the end of this backward; it queues the restore behind every
                    # callback queued meanwhile, DDP's finalization (which writes .grad) among them.
                    torch.autograd.Variable._execution_engine.queue_callback(self._after)
            return grad

        return hook

    def _after(self):
        torch.autograd.Variable._execution_engine.queue_callback(self._restore)

    def _restore(self):
        saved, self.saved, self.queued = self.saved, {}, False
        with torch.no_grad():
            for p, old in saved.values():
                if p.grad is None:
                    p.grad = old
                else:
                    p.grad.add_(old)


class _ReplicateState:
    def __init__(self, module, mesh, data_dims: list[int], shard_output, ddp_kwargs):
        dmesh = device_mesh(mesh)
        group = _data_group(dmesh, data_dims, mesh.axis_names)
        params = [p for p in module.parameters() if p.requires_grad]
        self.ddp = DistributedDataParallel(nn.ParameterList(params), process_group=group, **ddp_kwargs)
        self.gradient_sums = gradient_sums.register(self.ddp, group, params)
        self.accumulation = _Accumulation(params)
        self.dmesh = dmesh
        self.mesh = mesh
        self.data_dims = data_dims
        self.shard_output = shard_output
        self.layout = None
        self.suspended = None
        self.stream = None

    def pre(self, module, args, kwargs):
        args, kwargs, self.layout = inputs_to_local(args, kwargs, self.dmesh, self.data_dims, "replicate")
        self.suspended = global_mode.suspend()  # local compute: no lifting needed (see global_mode)
        self.stream = local_rows_stream(self.layout, self.data_dims)  # dropout: this process's rows' own stream
        self.stream.__enter__()
        DistributedDataParallel._active_ddp_module = self.ddp
        return self.ddp._pre_forward(*args, **kwargs)

    def leave_local(self, module, args, kwargs, output):
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.__exit__(None, None, None)
        global_mode.resume(self.suspended)
        self.suspended = None

    def post(self, module, args, kwargs, output):
        DistributedDataParallel._active_ddp_module = None
        output = self.ddp._post_forward(output)
        if self.shard_output is not None:
            return self.shard_output(output, self.mesh) or output
        return outputs_to_global(output, self.layout, "replicate")


def replicate(module: nn.Module, mesh, dims: list[int], shard_output: Callable | None, ddp_kwargs: dict) -> nn.Module:
    """See ``torchspmd.replicate`` (arguments checked there)."""
    if getattr(module, "_torchspmd_replicate", None) is not None:
        raise SpmdError("replicate: this module is already replicated")
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            raise SpmdError(
                f"replicate: parameter {name!r} is sharded (annotated with mark_sharding, or sharded by FSDPv2); "
                f"replicate is for models whose parameters are all whole. Leave it out: an FSDPv2 model, or one "
                f"with annotated parameters, reduces its own gradients"
            )
    state = _ReplicateState(module, mesh, dims, shard_output, ddp_kwargs)
    module._torchspmd_replicate = state
    module.register_forward_pre_hook(state.pre, with_kwargs=True)
    module.register_forward_hook(state.leave_local, with_kwargs=True, always_call=True)
    module.register_forward_hook(state.post, with_kwargs=True)
    return module


# ---------------------------------------------------------------------------
# The automatic path: a program without a wrapper at DDP's speed.
# ---------------------------------------------------------------------------

#: ``set_auto_replicate``'s choice; None: the environment's, read when the path is asked (a
#: forked worker imported this module in the launcher, before its program set the variable)
_AUTO: dict = {"enabled": None}


def _auto_enabled() -> bool:
    chosen = _AUTO["enabled"]
    return os.environ.get("TORCHSPMD_AUTO_REPLICATE", "1") != "0" if chosen is None else chosen


_TLS = threading.local()
_STATES: "weakref.WeakKeyDictionary[nn.Module, _AutoState]" = weakref.WeakKeyDictionary()
_OWNED: "weakref.WeakValueDictionary[int, _AutoState]" = weakref.WeakValueDictionary()
_INSTALLED: list = []
_UNEVEN_CHECKS = 3  # a kind of call only ever seen unevenly split is then left on DTensor


def set_auto_replicate(enabled: bool | None) -> bool | None:
    """See ``torchspmd.set_auto_replicate``."""
    previous = _AUTO["enabled"]
    _AUTO["enabled"] = None if enabled is None else bool(enabled)
    return previous


def auto_path(module: nn.Module) -> dict:
    """See ``torchspmd.auto_path``."""
    state = _STATES.get(module)
    return dict(state.decided) if state is not None else {}


def _stack() -> list:
    stack = getattr(_TLS, "stack", None)
    if stack is None:
        stack = _TLS.stack = []
    return stack


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _eligible_module(module: nn.Module) -> bool:
    """Plain (replicated) parameters and buffers, some trainable, none already reduced by
    another wrapper or another module's automatic path."""
    if getattr(module, "_torchspmd_replicate", None) is not None:
        return False
    trainable = False
    for p in module.parameters():
        if isinstance(p, DTensor):
            return False
        owner = _OWNED.get(id(p))
        if owner is not None and owner.module() is not module:
            return False
        trainable = trainable or p.requires_grad
    if not trainable:
        return False
    return not any(isinstance(b, DTensor) for b in module.buffers())


def _inputs(module: nn.Module, args: tuple, kwargs: dict):
    """The kind of call (a hashable signature) and the batch layout ``(device mesh,
    placements, data dims, rows)``, or ``(None, None)`` when the inputs are not one batch
    split on dim 0 over some mesh axes (and replicated over the others)."""
    parts: list = []
    dtensors: list[DTensor] = []
    bad = []

    def tensor(t):
        if isinstance(t, DTensor):
            if t.dim() == 0:
                bad.append(t)
            dtensors.append(t)
            parts.append(("D", t.dim(), tuple(t.placements), t.dtype))
        else:
            if t.dim() > 0:
                bad.append(t)  # a plain tensor is a replicated value, not this process's rows
            parts.append(("T", t.dim(), t.dtype))
        return t

    def other(v):
        parts.append(v if v is None or isinstance(v, (bool, str)) else type(v).__name__)
        return v

    map_tensors((args, kwargs), tensor, other)
    if bad or not dtensors:
        return None, None
    first = dtensors[0]
    placements = tuple(first.placements)
    rows = first.shape[0]
    if any(t.device_mesh != first.device_mesh or tuple(t.placements) != placements or t.shape[0] != rows
           for t in dtensors):
        return None, None
    data_dims = [i for i, p in enumerate(placements) if p.is_shard(0)]
    if not data_dims or any(not (p.is_replicate() or p.is_shard(0)) for p in placements):
        return None, None
    dmesh = first.device_mesh
    if len(data_dims) > 1 and dmesh.mesh_dim_names is None:
        return None, None
    autocast = tuple(torch.is_autocast_enabled(d) for d in {accelerators.CPU, first.device.type})
    sig = (module.training, torch.is_grad_enabled(), autocast, len(args), tuple(sorted(kwargs)), tuple(parts))
    return sig, (dmesh, placements, data_dims, rows)


class _Redistributions:
    """Counts DTensor redistributions (implicit ones in the dispatcher, explicit ones, and
    those of torchspmd's own handlers) while a checked forward runs. Those inside a layer
    ``row_locality.ROW_LOCAL_LAYERS`` lists are held apart (``hold``/``release``): they do not
    count when the call is row-local by the table."""

    def __init__(self):
        self.count = 0
        self.held: list[int] = []
        self.stack = contextlib.ExitStack()

    def _seen(self) -> None:
        if self.held:
            self.held[-1] += 1
        else:
            self.count += 1

    def hold(self) -> None:
        self.held.append(0)

    def release(self, row_local: bool) -> None:
        n = self.held.pop()
        if not row_local:
            if self.held:
                self.held[-1] += n
            else:
                self.count += n

    def start(self) -> "_Redistributions":
        self.stack.enter_context(dtensor_patches.counting_redistributions(self._seen))
        return self

    def stop(self) -> None:
        self.stack.close()


def _batch_layout_of(args: tuple):
    """(device mesh, placements) of the first DTensor among ``args`` when it is split on
    dim 0 only (a batch), else None."""
    found = []
    walk_tensors(args, lambda t: found.append(t) if isinstance(t, DTensor) else None)
    if not found:
        return None
    first = found[0]
    if not any(p.is_shard(0) for p in first.placements) or \
            any(not (p.is_replicate() or p.is_shard(0)) for p in first.placements):
        return None
    return first.device_mesh, tuple(first.placements), first.shape[0]


def _checking_recorder() -> "_Redistributions | None":
    stack = _stack()
    state = _STATES.get(stack[0]) if stack else None
    return state.checking if state is not None else None


def _table_layer_pre(module: nn.Module) -> None:
    """A layer row-local by type, inside a checked forward: its redistributions held apart."""
    recorder = _checking_recorder()
    if recorder is not None:
        recorder.hold()
        module._torchspmd_held = recorder


def _table_layer_post(module: nn.Module, args: tuple, kwargs: dict, output):
    """The end of a layer row-local by type inside a checked forward: its redistributions do
    not count when its call is row-local by the table, and its outputs (DTensor may have
    gathered the batch inside) are put back in the batch's layout, as the local path has them."""
    recorder = module.__dict__.pop("_torchspmd_held", None)
    if recorder is None:
        return None
    layout = _batch_layout_of(args)
    row_local = output is not None and layout is not None and row_locality.row_local_layer(module, args, kwargs)
    if row_local:
        dmesh, placements, rows = layout

        def back(t):
            if isinstance(t, DTensor) and t.device_mesh == dmesh and t.dim() and t.shape[0] == rows \
                    and tuple(t.placements) != placements:
                return t.redistribute(dmesh, placements)
            return t

        output = map_tensors(output, back)
    recorder.release(row_local)
    return output if row_local else None


def _reached_params(output) -> set[int] | None:
    """The ids of the leaf tensors the autograd graph of ``output`` accumulates into."""
    roots = []
    walk_tensors(output, lambda t: roots.append(t.grad_fn) if t.grad_fn is not None else None)
    if not roots:
        return None
    seen, found, todo = set(), set(), list(roots)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            found.add(id(var))
        todo.extend(n for n, _ in node.next_functions)
    return found


class _AutoState:
    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)
        self.decided: dict = {}
        self.proofs: dict = {}  # kind of call -> row_locality.BatchSizeProof
        self.sizes_held: dict = {}  # (kind of call, global rows) -> whether its proof holds for them
        self.uneven_checks: dict = {}
        self.checking: _Redistributions | None = None
        self.find_unused: bool | None = None
        self.ddp: DistributedDataParallel | None = None
        self.dmesh = None
        self.data_dims: list[int] = []
        self.layout = None
        self.suspended = None
        self.stream = None
        self.local = False  # this call computes locally
        self.hooks_aside = None
        self.converting = False  # its outputs are to be made global
        self.using_ddp = None
        module.register_forward_pre_hook(self.pre, with_kwargs=True)
        module.register_forward_hook(self.leave_local, with_kwargs=True, always_call=True)
        module.register_forward_hook(self.post, with_kwargs=True)

    # -- the check (a call of a kind not seen before runs through DTensor) --

    def begin_check(self) -> None:
        self.checking = _Redistributions().start()

    def end_check(self, module, args, kwargs, output) -> None:
        recorder, self.checking = self.checking, None
        recorder.stop()
        if output is None:  # the forward raised
            return
        sig, info = _inputs(module, args, kwargs)
        if sig is None:
            return
        dmesh, placements, data_dims, rows = info
        ok = recorder.count == 0 and _eligible_module(module)
        seen = []

        def out_tensor(t):
            seen.append(t)
            return t

        def out_other(v):
            if not (v is None or isinstance(v, (bool, int, float, str))):
                seen.append(None)  # an object whose tensors cannot be followed
            return v

        map_tensors(output, out_tensor, out_other)
        if not seen or any(t is None or not isinstance(t, DTensor) or t.device_mesh != dmesh
                           or t.dim() == 0 or t.shape[0] != rows for t in seen):
            ok = False
        elif ok and any(tuple(t.placements) != placements for t in seen):
            ok = False  # (no redistribution, yet an output not split as the batch: not row-local)
        if ok:
            # DTensor's layouts prove the values; the batch size the program read was the global
            # one: prove the local forward does not depend on it (row_locality's docstring), and
            # that the check's global batch took the branches the trace took (each call's sizes,
            # the processes' shares among them, are checked when it comes: _proven_for).
            proof = _batch_size_proof(module, args, kwargs, dmesh, data_dims)
            ok = proof.holds([rows])
            self.proofs[sig] = proof
        if ok and torch.is_grad_enabled():
            reached = _reached_params(output)
            trainable = [p for p in module.parameters() if p.requires_grad]
            unused = reached is None or any(id(p) not in reached for p in trainable)
            if self.ddp is None:
                self.find_unused = bool(self.find_unused) or unused
            elif unused and not self.find_unused:
                ok = False  # DDP's reducer expects every parameter's gradient
        # Every process decides the same (one program); agree anyway, it is once per kind.
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
        ways = 1
        for d in data_dims:
            ways *= dmesh.size(d)
        if not ok and rows % ways:
            # On an uneven split DTensor itself regathers some views (torchspmd's exact
            # global view does): that says nothing about the program. Check an even batch.
            self.uneven_checks[sig] = self.uneven_checks.get(sig, 0) + 1
            if self.uneven_checks[sig] < _UNEVEN_CHECKS:
                return
        self.decided[sig] = ok
        if ok:
            self.dmesh, self.data_dims = dmesh, data_dims

    # -- the local path --

    def _reducer(self, module) -> DistributedDataParallel:
        if self.ddp is None:
            group = _data_group(self.dmesh, self.data_dims, self.dmesh.mesh_dim_names)
            params = [p for p in module.parameters() if p.requires_grad]
            # Replicas were checked to agree when the parameters first met the batch; no
            # broadcast (init_sync=False): it would change tensors a live graph saved.
            self.ddp = DistributedDataParallel(nn.ParameterList(params), process_group=group, init_sync=False,
                                               find_unused_parameters=bool(self.find_unused))
            self.gradient_sums = gradient_sums.register(self.ddp, group, params)
            self.accumulation = _Accumulation(params)
            for p in params:
                _OWNED[id(p)] = self
        return self.ddp

    def _proven_for(self, sig, rows: int) -> bool:
        """Whether the kind's proof holds for a batch of ``rows`` (every process's share too)."""
        held = self.sizes_held.get((sig, rows))
        if held is None:
            proof = self.proofs.get(sig)
            held = proof is not None and proof.holds([rows, *shares(rows, self.dmesh, self.data_dims)])
            if len(self.sizes_held) < 1024:
                self.sizes_held[(sig, rows)] = held
        return held

    def pre(self, module, args, kwargs):
        self.local = self.converting = False
        self.using_ddp = None
        stack = _stack()
        if not (_auto_enabled() and len(stack) == 1 and stack[0] is module) or _in_backward():
            return None
        sig, info = _inputs(module, args, kwargs)
        if sig is None:
            return None
        decision = self.decided.get(sig)
        if decision is None:
            if _eligible_module(module):
                self.begin_check()
            return None
        if not decision or not _eligible_module(module):
            return None
        if torch.is_grad_enabled() and self.ddp is None and self.find_unused is None:
            return None  # no grad-enabled call was checked yet: its check decides the reducer
        if not self._proven_for(sig, info[3]):
            return None  # sizes beyond the proof (fewer than 2 rows somewhere, another branch): DTensor
        args, kwargs, self.layout = inputs_to_local(args, kwargs, self.dmesh, self.data_dims, "torchspmd")
        self.suspended = global_mode.suspend()  # local compute: nothing to lift
        self.stream = local_rows_stream(self.layout, self.data_dims)
        self.stream.__enter__()
        self.local = self.converting = True
        self.hooks_aside = _global_hooks_aside()
        if torch.is_grad_enabled():
            ddp = self._reducer(module)
            DistributedDataParallel._active_ddp_module = ddp
            self.using_ddp = ddp
            args, kwargs = ddp._pre_forward(*args, **kwargs)
        return args, kwargs

    def leave_local(self, module, args, kwargs, output):
        if self.local:
            self.local = False
            _global_hooks_back(self.hooks_aside)
            self.hooks_aside = None
            stack = _stack()  # (what this module's own _global_post, set aside, would do)
            if stack and stack[-1] is module:
                stack.pop()
            stream, self.stream = self.stream, None
            stream.__exit__(None, None, None)
            global_mode.resume(self.suspended)
            self.suspended = None

    def post(self, module, args, kwargs, output):
        if not self.converting:
            return None
        self.converting = False
        if self.using_ddp is not None:
            DistributedDataParallel._active_ddp_module = None
            output = self.using_ddp._post_forward(output)
            self.using_ddp = None
        return outputs_to_global(output, self.layout, "torchspmd (automatic data parallelism)")


def _batch_size_proof(module: nn.Module, args: tuple, kwargs: dict, dmesh,
                      data_dims: list[int]) -> row_locality.BatchSizeProof:
    """``row_locality.batch_size_proof`` on this process's rows."""
    local_args, local_kwargs, layout = inputs_to_local(args, kwargs, dmesh, data_dims, "torchspmd")
    if layout is None:
        return row_locality.BatchSizeProof("no batch")
    aside = _global_hooks_aside()
    suspended = global_mode.suspend()
    try:
        return row_locality.batch_size_proof(module, local_args, local_kwargs, layout.local_rows)
    finally:
        global_mode.resume(suspended)
        _global_hooks_back(aside)


def _global_pre(module, args):
    if torch.compiler.is_compiling():
        return None
    stack = _stack()
    stack.append(module)
    if len(stack) > 1 and type(module) in row_locality.ROW_LOCAL_LAYERS:
        _table_layer_pre(module)
    if len(stack) == 1 and _auto_enabled() and module not in _STATES and not _in_backward() \
            and _eligible_module(module):
        # First call: its hooks act from the next call on; this one is checked (its end,
        # which sees the keyword arguments too, tells whether it was one split batch).
        state = _STATES[module] = _AutoState(module)
        state.begin_check()
    return None


def _global_post(module, args, *rest):
    # (module, args, kwargs, output); after a forward that raised, torch calls a global
    # always-called hook without the keyword arguments: (module, args, output).
    if torch.compiler.is_compiling():
        return None
    kwargs, output = rest if len(rest) == 2 else ({}, None)
    replaced = None
    if "_torchspmd_held" in module.__dict__:
        replaced = _table_layer_post(module, args, kwargs, output)
    stack = _stack()
    if stack and stack[-1] is module:
        stack.pop()
    if not stack:
        state = _STATES.get(module)
        if state is not None and state.checking is not None:
            state.end_check(module, args, kwargs, output)
    return replaced


def _global_hooks_aside() -> list:
    """Take this path's global module hooks out while a module computes locally: inside
    it no module is a new root, and with no global hook the submodules' calls take
    ``Module.__call__``'s fast path (no hook bookkeeping per call), as under DDP. The
    module's own hooks put them back (``leave_local``), before its post hooks, after a
    raise too."""
    aside = []
    for handle, table in zip(_INSTALLED, torch_patches.global_forward_hook_tables()):
        if handle.id in table:
            aside.append((table, list(table), handle.id, table.pop(handle.id)))
    return aside


def _global_hooks_back(aside: list | None) -> None:
    for table, order, mine, hook in aside or ():
        now = dict(table)  # (others' hooks, some maybe added or removed meanwhile)
        now[mine] = hook
        table.clear()
        table.update((k, now.pop(k)) for k in order if k in now)  # the order they had
        table.update(now)  # then those registered meanwhile


def install_auto() -> None:
    """Install the module hooks of the automatic path (once; the engine's start does it)."""
    if not patches.is_active(torch_patches.MODULE_FORWARD_HOOKS.name):
        _INSTALLED[:] = torch_patches.global_forward_hooks(_global_pre, _global_post)
