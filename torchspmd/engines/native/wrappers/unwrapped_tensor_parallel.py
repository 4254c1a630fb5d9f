"""Tensor parallelism without a wrapper: Pattern 1's weights annotated over ``'model'``.

A program that annotates a linear's or an embedding's weight over ``'model'`` in place
(``mark_sharding(model.fc1.weight, mesh, ('model', None))``) and no wrapper computes through
DTensor's sharding propagation. Left to itself, DTensor picks each op's layout by its own cost
model: on a ``('data', 'model')`` mesh it reduce-scatters a row-parallel output over the rows,
so the next layer's column-parallel linear gathers its weight instead of splitting the
features, and the weight gradients of rows split over both axes meet a redistribution DTensor
refuses (``redistribution``'s fallback: gathered whole). Megatron's layout is fixed here at the
modules' edges instead, as PyTorch's parallel styles fix it (``ColwiseParallel`` /
``RowwiseParallel``), over the ``'model'`` axis only:

* a column-parallel ``nn.Linear`` (weight split on dim 0 over ``'model'``) takes its input whole
  over ``'model'``; its output is split on the features (DTensor's own result);
* a row-parallel ``nn.Linear`` (dim 1) and an ``nn.Embedding`` split over ``'model'`` (either dim)
  give their output whole over ``'model'`` (one all-reduce of the pending sum, or a gather);
* a weight also split over another axis (torch_xla's 2D recipe, ``('model', 'data')``) is
  stored so and gathered over that axis for the call (FSDP's part; its gradient is
  reduce-scattered back by DTensor's autograd).

So the activation between a column-parallel linear and its row-parallel partner is split over
the rows on the data axes and over the features on ``'model'`` (1/(data x model) per process),
the stream between layers is split over the rows only, and no redistribution is refused. The
placements on the other axes are left as DTensor computes them. Only layouts change: every
value is the one DTensor computes, exact against one device (sums over ``'model'`` run in
another order).

The hooks act only where they apply: the input a DTensor on the weight's own mesh, outside a
wrapped module's local compute (an FSDPv2 unit's tensor parallelism is ``tensor_parallel``'s),
the weight still a DTensor split over ``'model'`` with plain per-axis placements (XLA's flat
tiling over several axes is left to DTensor). Anything else runs as before.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchspmd.engines.native.global_view.module_edges import in_local_compute

__all__ = ["MODEL_AXIS", "install_for", "laid_out", "style_of"]

MODEL_AXIS = "model"

_HOOKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_PAIRED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # module -> (weight, paired)


def _axis(w) -> int | None:
    """The mesh dim of ``'model'`` where ``w`` is a DTensor with plain per-axis placements."""
    if not isinstance(w, DTensor):
        return None
    names = w.device_mesh.mesh_dim_names or ()
    if MODEL_AXIS not in names:
        return None
    if any(type(p) not in (Shard, Replicate) for p in w.placements):
        return None
    return names.index(MODEL_AXIS)


def style_of(module: nn.Module) -> str | None:
    """``'colwise'``, ``'rowwise'`` or ``'embedding'`` where the module's weight is split over
    ``'model'`` in a way this path lays out; None otherwise."""
    w = module._parameters.get("weight")
    m = _axis(w)
    if m is None or not w.placements[m].is_shard():
        return None
    dim = w.placements[m].dim
    if isinstance(module, nn.Linear) and w.ndim == 2:
        return "colwise" if dim == 0 else "rowwise"
    if isinstance(module, nn.Embedding) and w.ndim == 2:
        return "embedding"
    return None


def _on_mesh(t, w) -> bool:
    return isinstance(t, DTensor) and t.device_mesh == w.device_mesh


def _with(placements, m: int, p) -> tuple:
    out = list(placements)
    out[m] = p
    return tuple(out)


def _grad_of_local(x_placements, m: int, on_model) -> list:
    """Where a weight computed on this process's rows is used: its local gradient is a pending
    sum over each axis that splits the rows, the same on each that does not, ``on_model`` on
    ``'model'``."""
    out = [Partial() if p.is_shard() else Replicate() for p in x_placements]
    out[m] = on_model
    return out


def _local_colwise(module: nn.Module, x: DTensor, m: int) -> bool:
    """Whether a column-parallel call computes on local tensors (the exact Megatron layout,
    which DTensor's propagation misses for features that do not divide): the input split only
    on dims before the features (no pending sum), whole over ``'model'``; the bias absent or
    split over ``'model'`` alike; the forward nn.Linear's own."""
    if type(module).forward is not nn.Linear.forward:
        return False
    if any(isinstance(p, Partial) or (p.is_shard() and p.dim in (-1, x.ndim - 1)) for p in x.placements):
        return False
    b = module._parameters.get("bias")
    return b is None or (_on_mesh(b, module._parameters["weight"]) and _axis(b) == m
                         and b.placements[m] == Shard(0))


def _pre(module: nn.Module, args):
    if in_local_compute() or not args:
        return None
    style = style_of(module)
    w = module._parameters.get("weight")
    if style is None or not _on_mesh(args[0], w):
        return None
    m = _axis(w)
    x = args[0]
    if style == "colwise":
        # whole over 'model', and so is its gradient (one all-reduce in backward: Megatron's f)
        x = _WholeOverAxis.apply(x, m)
    stored = {}
    for name in ("weight", "bias"):
        p = module._parameters.get(name)
        # A parameter as it computes: split over 'model' only (the other axes' splits are storage).
        if isinstance(p, DTensor) and p.device_mesh == w.device_mesh:
            use = _with([Replicate()] * len(p.placements), m, p.placements[m])
            if tuple(p.placements) != use:
                stored[name] = p
                module._parameters[name] = p.redistribute(p.device_mesh, use)
    if style == "colwise" and _local_colwise(module, x, m):
        for name in ("weight", "bias"):
            p = module._parameters.get(name)
            if p is not None:
                stored.setdefault(name, p)
                module._parameters[name] = p.to_local(grad_placements=_grad_of_local(x.placements, m, Shard(0)))
        out_placements = _with(x.placements, m, Shard(x.ndim - 1))
        module.__dict__["_torchspmd_local_out"] = (x.device_mesh, out_placements,
                                                   tuple(x.shape[:-1]) + (w.shape[0],))
        x = x.to_local(grad_placements=_with(x.placements, m, Partial()))
    if stored:
        module.__dict__["_torchspmd_stored"] = stored
    return (x,) + tuple(args[1:]) if x is not args[0] else None


def _parents(module: nn.Module) -> list[nn.Module]:
    """The modules holding ``module`` as a child, found through the garbage collector (a child's
    ``_modules`` dict is referred to by its owner, or by the owner's ``__dict__``)."""
    found = []
    for d in gc.get_referrers(module):
        if not isinstance(d, dict):
            continue
        for holder in gc.get_referrers(d):
            owners = [holder] if isinstance(holder, nn.Module) else (
                [o for o in gc.get_referrers(holder) if isinstance(o, nn.Module)] if isinstance(holder, dict) else [])
            found.extend(o for o in owners if o.__dict__.get("_modules") is d and o not in found)
    return found


def _paired(module: nn.Module) -> bool:
    """Whether a column-parallel linear has a row-parallel partner: a later sibling (in a module
    that holds it) computing under this path, whose input features are its output features.
    Decided from the structure once per weight (``tensor_parallel``'s rule for FSDPv2's pairs)."""
    w = module._parameters["weight"]
    cached = _PAIRED.get(module)
    if cached is not None and cached[0] is w:
        return cached[1]
    paired = False
    for parent in _parents(module):
        children = list(parent._modules.values())
        later = children[children.index(module) + 1:] if module in children else []
        paired = paired or any(isinstance(c, nn.Linear) and style_of(c) == "rowwise" and c.in_features == w.shape[0]
                               and c._parameters["weight"].device_mesh == w.device_mesh for c in later)
    _PAIRED[module] = (w, paired)
    return paired


def _post(module: nn.Module, args, output):
    for name, p in module.__dict__.pop("_torchspmd_stored", {}).items():
        module._parameters[name] = p
    local = module.__dict__.pop("_torchspmd_local_out", None)
    if local is not None and isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
        dmesh, placements, shape = local
        output = DTensor.from_local(output, dmesh, placements, run_check=False, shape=torch.Size(shape),
                                    stride=torch.empty(shape, device="meta").stride())
    elif in_local_compute():
        return None
    style = style_of(module)
    w = module._parameters.get("weight")
    if style is None or not _on_mesh(output, w):
        return output if local is not None else None
    m = _axis(w)
    if style == "colwise" and _paired(module):
        return output if local is not None else None  # split on the features into its partner
    if isinstance(output.placements[m], (Partial, Shard)):
        return _WholeOverAxis.apply(output, m)
    return output if local is not None else None


class _WholeOverAxis(torch.autograd.Function):
    """``x`` whole over mesh dim ``m`` (a pending sum reduced, a split gathered); its gradient
    whole over ``m`` too. DTensor's own backward would move a gradient pending over ``m`` back
    to the output's placement, which it refuses for an embedding's masked partial: the whole
    gradient is the one DTensor's backward keeps for a pending output anyway."""

    @staticmethod
    def forward(ctx, x, m):
        ctx.m = m
        if isinstance(x.placements[m], Replicate):
            # the same value as a new tensor (a Function returns a new output; DTensor's own view_as
            # would gather rows that do not divide)
            return DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False,
                                      shape=x.shape, stride=x.stride())
        return x.redistribute(x.device_mesh, _with(x.placements, m, Replicate()))

    @staticmethod
    def backward(ctx, grad):
        m = ctx.m
        if isinstance(grad, DTensor) and not isinstance(grad.placements[m], Replicate):
            grad = grad.redistribute(grad.device_mesh, _with(grad.placements, m, Replicate()))
        return grad, None


def install_for(module: nn.Module) -> bool:
    """Lay out ``module``'s calls as above when its weight is split over ``'model'`` (once per
    module; the hooks check at each call that they still apply). True where installed."""
    if module in _HOOKED or style_of(module) is None:
        return module in _HOOKED
    module.register_forward_pre_hook(_pre)
    module.register_forward_hook(_post, always_call=True, prepend=True)  # (the program's hooks see DTensors)
    _HOOKED.add(module)
    return True


def laid_out(module: nn.Module) -> str | None:
    """The style ``module``'s calls are laid out in by this path (None: not installed, or the
    weight no longer split over ``'model'``)."""
    return style_of(module) if module in _HOOKED else None
