"""Where an FSDPv2 model computes: on this process's rows, only where that is proven to give
one device's result, else on the whole batch (the global view).

The outermost FSDPv2 wrapper receives global batches. Computing the wrapped model on this
process's rows alone (FSDP2's and DDP's way) gives one device's result only when every
output row depends on its own input row alone and the batch size is not used as a value.
That is proven per kind of call (the inputs' global shapes and dtypes, training mode, whether
gradients are recorded) by ``row_locality.batch_size_proof`` on the model's forward, traced
with FSDP2's hooks set aside and each sharded parameter stood in for by a tensor of its
whole shape that holds one element (nothing is gathered, nothing runs). Every process
decides alike (one program); the decision is agreed once per kind.

Where it is not proven, the model runs on the **global view**: every process computes the
whole batch (its inputs gathered whole, FSDP2 gathering the parameters as usual), then keeps
its own rows of each output. The result is one device's, at the cost of computing the whole
batch on every process:

- an output with the global batch on dim 0 leaves as the global DTensor made of each
  process's rows; its gradient reaches each process's computation for its own rows, so the
  parameters' gradients are shares of the whole gradient, which FSDP2 sums;
- any other output (a loss computed inside) is the same whole value on every process: it
  leaves as a pending sum of that value over the processes of the data axes, each holding
  ``1 / n`` of it, so that the gradient each process computes from it is ``1 / n`` of the whole
  and FSDP2's sum gives it once;
- random operations draw from the stream every process shares, so that every process
  computes the same whole batch (dropout masks are one draw for the whole batch).

``per_process=True`` on the wrapper skips the proof and computes on this process's rows
whatever the model does: FSDP2's and DDP's semantics (a batch statistic is then each
process's own), by name only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchspmd.engines.native.global_view import row_locality
from torchspmd.engines.native.global_view.module_edges import BatchLayout, output_to_global, shares
from torchspmd.engines.native.global_view.row_flow import MEAN
from torchspmd.tree import map_tensors, walk_tensors

__all__ = ["RowPaths", "call_kind", "kind_text", "outputs_from_whole", "traceable", "whole_inputs"]


def call_kind(args: tuple, kwargs: dict) -> tuple:
    """What a decision holds for: the inputs' global shapes and dtypes, in order, the mode."""
    parts: list = []
    walk_tensors((args, kwargs), lambda t: parts.append((tuple(t.shape), t.dtype)))
    return tuple(parts), torch.is_grad_enabled()


#: where the hooks that only lay values out come from: FSDP2's (gathering parameters), DTensor's
#: parallel styles' (tensor parallelism over 'model': DTensor computes exactly what the whole
#: weights compute), and torchspmd's own for the same two (``fsdp``, ``tensor_parallel``)
_LAYOUT_HOOK_MODULES = ("torch.distributed.fsdp", "torch.distributed.tensor", "torchspmd.engines.native.wrappers.fsdp",
                        "torchspmd.engines.native.wrappers.tensor_parallel")


def _lays_out(fn) -> bool:
    fn = getattr(fn, "func", fn)  # (functools.partial)
    owner = getattr(fn, "__self__", None)
    modules = (getattr(fn, "__module__", None) or "", type(owner).__module__ if owner is not None else "")
    return any(m.startswith(_LAYOUT_HOOK_MODULES) for m in modules)


@contextlib.contextmanager
def traceable(model: nn.Module, param_dtype: torch.dtype | None, shapes: dict | None = None):
    """While the model is traced: the hooks and forwards that only lay values out set aside
    (FSDP2's gathering parameters, tensor parallelism's over 'model'), a forward
    ``torch.compile`` compiled traced as written, and each DTensor parameter stood in for by a tensor of its whole shape holding one
    element (expanded), in the dtype the model computes in. ``shapes`` ({(module, name):
    shape}) gives some of them another shape (a process's share of a tensor-parallel pair's
    weights, ``tensor_parallel``)."""
    saved_hooks = []
    for m in model.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(m, attr)
            found = [k for k, h in hooks.items() if _lays_out(h)]
            if found:
                saved_hooks.append((m, attr, dict(hooks)))
                for k in found:
                    del hooks[k]
    compiled = []
    for m in model.modules():
        forward = m.__dict__.get("forward")
        orig = getattr(forward, "_torchdynamo_orig_callable", None)
        if orig is not None:  # (FSDPv2(compile=...): the forward torch.compile compiles, traced as written)
            compiled.append((m, forward))
            m.forward = orig
        elif forward is not None and _lays_out(forward):
            compiled.append((m, forward))  # (tensor-parallel attention: the class's own forward, whole weights)
            del m.forward
    swapped, standing = [], {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if isinstance(p, DTensor):
                shape = (shapes or {}).get((m, name), p.shape)
                if (id(p), tuple(shape)) not in standing:
                    dtype = param_dtype if param_dtype is not None and p.dtype.is_floating_point else p.dtype
                    standing[id(p), tuple(shape)] = nn.Parameter(
                        torch.zeros((), dtype=dtype, device=p.device.type if p.device.type != "meta" else "cpu"
                                    ).expand(shape), requires_grad=p.requires_grad)
                swapped.append((m, name, p))
                m._parameters[name] = standing[id(p), tuple(shape)]
    try:
        yield
    finally:
        for m, forward in compiled:
            m.forward = forward
        for m, name, p in swapped:
            m._parameters[name] = p
        for m, attr, hooks in saved_hooks:
            current = getattr(m, attr)
            current.clear()
            current.update(hooks)


class RowPaths:
    """The decisions of one FSDPv2 root: kind of call -> None (this process's rows, proven)
    or why not (the global view)."""

    def __init__(self, per_process: bool = False):
        self.per_process = per_process
        self.decided: dict = {}

    def local(self, model: nn.Module, kind, args: tuple, kwargs: dict, layout: BatchLayout | None,
              data_dims: list[int], param_dtype, watch=None) -> bool:
        """Whether this call computes on this process's rows (deciding the kind once). The
        forward traced to decide is left on ``watch`` (``row_locality.trace_forward``)."""
        if self.per_process or layout is None:
            return True
        if kind not in self.decided:
            sizes = [layout.global_rows, *shares(layout.global_rows, layout.device_mesh, data_dims)]
            if any(n < 1 for n in sizes):
                why = "a process holds no rows of this batch"
            else:
                try:
                    with traceable(model, param_dtype):
                        proof = row_locality.batch_size_proof(model, args, kwargs, layout.local_rows,
                                                              one_row=1 in sizes, watch=watch)
                    why = proof.rows_apart(sizes, scalars=(MEAN,))
                except Exception as e:  # noqa: BLE001 - not proven
                    why = f"its forward could not be analysed ({type(e).__name__}: {str(e)[:200]})"
            # One program: every process decides alike; agreed anyway, once per kind, over the
            # processes of the model's mesh.
            flag = torch.tensor([0 if why is None else 1], dtype=torch.int32, device=layout.device_mesh.device_type)
            if dist.is_initialized():
                for d in range(layout.device_mesh.ndim):
                    if layout.device_mesh.size(d) > 1:
                        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=layout.device_mesh.get_group(d))
            if why is None and flag.item():
                why = "another process could not prove it"
            self.decided[kind] = why
        return self.decided[kind] is None

    def describe(self) -> list[tuple[str, str | None]]:
        """(kind of call as text, None or why it computes on the global view), each kind decided."""
        return [(kind_text(kind), why) for kind, why in self.decided.items()]


def kind_text(kind) -> str:
    """A kind of call (``call_kind`` and the training mode) as text."""
    (shapes, grad), training = kind
    text = ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d in shapes)
    mode = "training" if training else "eval"
    return f"inputs {text} ({mode}{'' if grad else ', no gradients'})"


def whole_inputs(args: tuple, kwargs: dict, layout: BatchLayout, data_dims: list[int]):
    """The inputs as whole values on every process: a DTensor gathered (its gradient a share
    of a sum over the data axes: each process computed with the whole value), a plain tensor
    as it is (it holds the whole value)."""
    def whole(t: torch.Tensor):
        if not isinstance(t, DTensor):
            return t
        full = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
        return full.to_local(grad_placements=[Partial() if i in data_dims else Replicate()
                                              for i in range(t.device_mesh.ndim)])

    return map_tensors(args, whole), map_tensors(kwargs, whole)


def outputs_from_whole(output: Any, layout: BatchLayout, data_dims: list[int], who: str) -> Any:
    """The outputs of the whole batch's computation (the same on every process) as global
    values (see the module's docstring): rows as this process's rows of a global DTensor,
    anything else as a pending sum of ``1 / n`` of it over the data axes."""
    mesh = layout.device_mesh
    n = 1
    for d in data_dims:
        n *= mesh.size(d)
    placements = [Partial("sum") if i in data_dims else Replicate() for i in range(mesh.ndim)]

    def convert(t: torch.Tensor):
        if isinstance(t, DTensor):
            return t
        if t.dim() and t.shape[0] == layout.global_rows:
            return output_to_global(t.narrow(0, layout.local_start, layout.local_rows), layout, who)
        if not t.is_floating_point():
            return t  # (integers: no gradient; the same whole value everywhere)
        return DTensor.from_local(t / n, mesh, placements, run_check=False)

    return map_tensors(output, convert)
