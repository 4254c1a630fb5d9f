"""Exact losses, means and per-shard randomness on DTensors: the native engine's op handlers.

DTensor's own rules for ``mse_loss``, ``smooth_l1_loss``, ``nll_loss`` (so ``cross_entropy``)
and friends average per-device means, which is wrong when devices hold different numbers of
rows (or different numbers of ignored labels), and some refuse uneven splits. Here each
device sums its part, the sum stays a pending ``Partial`` reduction, and the division uses
the global element count (or the global weight of non-ignored targets): the loss and its
gradients equal one device's. Random ops on sharded values draw each shard's own numbers;
``view`` of unevenly split rows, ``mean`` and ``item()`` are exact too; batch norm with
running statistics normalizes each device's rows. The handlers go into
DTensor's table of custom op handlers (``torchspmd.patches.dtensor.OP_HANDLERS``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from torchspmd.layouts.blocks import contiguous_stride as _contiguous_stride
from torchspmd.engines.native.global_view import early_reductions
from torchspmd.engines.native.start import rng
from torchspmd.engines.native.global_view.implicit_replication import replicated
from torchspmd.patches import dtensor as dtensor_patches

aten = torch.ops.aten

_MEAN, _SUM, _NONE = 1, 2, 0



def _uneven(x: DTensor) -> bool:
    """Whether some sharded dim does not split evenly over its mesh axes."""
    mesh = x.device_mesh
    ways: dict[int, int] = {}
    for axis, p in enumerate(x.placements):
        if p.is_shard():
            ways[p.dim] = ways.get(p.dim, 1) * mesh.size(axis)
    return any(x.shape[d] % k for d, k in ways.items())


def _wrap(local: torch.Tensor, mesh, placements, shape: tuple[int, ...]) -> DTensor:
    spec = DTensorSpec(
        mesh,
        tuple(placements),
        tensor_meta=TensorMeta(torch.Size(shape), _contiguous_stride(tuple(shape)), local.dtype),
    )
    return DTensor(local, spec, requires_grad=local.requires_grad)


def _settle(t: DTensor) -> DTensor:
    """Resolve pending reductions (Partial) so the local values are plain data."""
    if any(p.is_partial() for p in t.placements):
        t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
    return t


def _align(t: Any, ref: DTensor) -> Any:
    """``t`` laid out like ``ref`` (same mesh, same placements) when it has ``ref``'s
    shape; a tensor of another shape (a weight broadcast over rows) whole."""
    if t is None or not isinstance(t, torch.Tensor):
        return t
    if tuple(t.shape) != tuple(ref.shape):
        return t.full_tensor() if isinstance(t, DTensor) else t
    if not isinstance(t, DTensor):
        t = replicated(t, ref)
    if t.device_mesh != ref.device_mesh:
        raise ValueError(
            f"torchspmd: loss inputs live on different meshes ({t.device_mesh} and {ref.device_mesh}); "
            f"put both on one mesh"
        )
    if tuple(t.placements) != tuple(ref.placements):
        t = t.redistribute(ref.device_mesh, ref.placements)
    return t


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _splits(p) -> bool:
    """Whether placement ``p`` splits a dim: ``Shard``, or ``_StridedShard`` (not a ``Shard``
    on every torch version)."""
    return p.is_shard() or isinstance(p, _StridedShard)


def _sum_placements(x: DTensor) -> list:
    """Placements of a full reduction of ``x``: pending sums over its shard axes."""
    return [Partial("sum") if _splits(p) else Replicate() for p in x.placements]


def _group_sum(value: torch.Tensor, x: DTensor) -> torch.Tensor:
    """Sum a local scalar over the mesh axes that shard ``x`` (a real all-reduce)."""
    value = value.clone()
    mesh = x.device_mesh
    for dim, p in enumerate(x.placements):
        if _splits(p) and mesh.size(dim) > 1:
            dist.all_reduce(value, group=mesh.get_group(dim))
    return value


def _pointwise_loss_forward(n_inputs: int) -> Callable:
    """Handler for ``op(self, target, [weight,] reduction, *extra)``: one loss value per
    element, then none / sum / mean over all elements."""

    def handler(op, args, kwargs):
        args = list(args)
        schema_names = [a.name for a in op._schema.arguments]
        values = dict(zip(schema_names, args))
        values.update(kwargs)
        x = _settle(values["self"])
        reduction = values.get("reduction", _MEAN)
        tensors = {name: _local(_align(values.get(name), x)) for name in schema_names[1:n_inputs]}
        call = {n: (tensors[n] if n in tensors else _local(values[n])) for n in schema_names if n in values}
        call["self"] = x.to_local()
        if reduction == _NONE:
            call["reduction"] = _NONE
            out = op(**call)
            return _wrap(out, x.device_mesh, x.placements, tuple(x.shape))
        call["reduction"] = _SUM
        out = op(**call)
        if reduction == _MEAN:
            out = out / x.numel()
        loss = _wrap(out, x.device_mesh, _sum_placements(x), ())
        early_reductions.pend(loss, values["self"])
        return loss

    return handler


def _pointwise_loss_backward(n_inputs: int) -> Callable:
    """Handler for ``op_backward(grad_output, self, target, [weight,] reduction, *extra)``."""

    def handler(op, args, kwargs):
        args = list(args)
        schema_names = [a.name for a in op._schema.arguments]
        values = dict(zip(schema_names, args))
        values.update(kwargs)
        early_reductions.start(values["self"])
        x = _settle(values["self"])
        reduction = values.get("reduction", _MEAN)
        call = {n: _local(values[n]) for n in schema_names if n in values}
        call["self"] = x.to_local()
        for name in schema_names[2 : n_inputs + 1]:
            call[name] = _local(_align(values.get(name), x))
        grad = values["grad_output"]
        if reduction == _NONE:
            call["grad_output"] = _local(_align(grad, x))
            out = op(**call)
        else:
            g = _local(_settle(grad) if isinstance(grad, DTensor) else grad)
            call["grad_output"] = g
            call["reduction"] = _SUM
            out = op(**call)
            if reduction == _MEAN:
                out = out / x.numel()
        return _wrap(out, x.device_mesh, x.placements, tuple(x.shape))

    return handler


def _channel_dim(x: DTensor) -> int:
    return 0 if x.ndim == 1 else 1


def _nll_prepare(values: dict) -> tuple[DTensor, DTensor, Any]:
    x = _settle(values["self"])
    cdim = _channel_dim(x)
    if any(p.is_shard(cdim) for p in x.placements) and x.ndim > 1:
        # Sharded classes (vocabulary parallelism): gather them; loss_parallel() is the
        # specialised tool for that layout.
        x = x.redistribute(x.device_mesh, [Replicate() if p.is_shard(cdim) else p for p in x.placements])
    if any(isinstance(p, _StridedShard) for p in x.placements) and not _rows_alike(x, values["target"]):
        # Rows split over two axes in an order a plain split of the targets does not give
        # (logits (batch, seq) split over 'data' and 'model', flattened, beside targets laid
        # out otherwise): gather those.
        x = x.redistribute(x.device_mesh, [Replicate() if isinstance(p, _StridedShard) else p for p in x.placements])
    elif any(isinstance(p, _StridedShard) for p in x.placements):
        # Logits (rows, classes) and targets (rows,) flattened alike from (batch, seq) split
        # over 'fsdp' and 'context': each process holds the same rows of both, so each
        # computes its rows' losses; the sums and the weight are pending over both axes.
        return x, values["target"], _whole_weight(values.get("weight"))
    target_placements = []
    for p in x.placements:
        if p.is_shard():
            d = p.dim if p.dim < cdim or x.ndim == 1 else p.dim - 1
            target_placements.append(Shard(d))
        else:
            target_placements.append(Replicate())
    target = values["target"]
    if not isinstance(target, DTensor):
        target = replicated(target, x)
    if tuple(target.placements) != tuple(target_placements):
        target = target.redistribute(x.device_mesh, target_placements)
    return x, target, _whole_weight(values.get("weight"))


def _whole_weight(weight: Any) -> Any:
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def _rows_alike(x: DTensor, target: Any) -> bool:
    """Whether ``target`` (rows,) is laid out as the rows of ``x`` (rows, classes): a DTensor
    on the same mesh with the same placement on every mesh axis, so that each process holds
    the targets of its own rows in their order (the classes not split)."""
    return (isinstance(target, DTensor) and x.ndim == 2 and target.ndim == 1
            and target.device_mesh == x.device_mesh and target.shape[0] == x.shape[0]
            and tuple(target.placements) == tuple(x.placements)
            and all(_splits(p) and p.dim == 0 or p.is_replicate() for p in x.placements))


def _nll_forward(op, args, kwargs):
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    reduction, ignore_index = values["reduction"], values["ignore_index"]
    # The global count of ignored targets, when the loader has it reduced already.
    ignored = early_reductions.ignored(values["target"]) if (
        reduction == _MEAN and values.get("weight") is None and ignore_index == early_reductions.IGNORE_INDEX) else None
    x, target, weight = _nll_prepare(values)
    out, total_weight = op(x.to_local(), target.to_local(), weight, _SUM if reduction == _MEAN else reduction, ignore_index)
    mesh = x.device_mesh
    if reduction == _NONE:
        return (
            _wrap(out, mesh, target.placements, tuple(target.shape)),
            _wrap(total_weight, mesh, [Replicate()] * mesh.ndim, ()),
        )
    if reduction == _SUM:  # the weight is not needed: it stays a pending sum
        weight_out = _wrap(total_weight, mesh, _sum_placements(x), ())
    else:
        if ignored is not None:
            global_weight = total_weight.new_tensor(float(target.numel() - ignored))
        else:
            global_weight = _group_sum(total_weight, x)
        out = out / global_weight
        weight_out = _wrap(global_weight, mesh, [Replicate()] * mesh.ndim, ())
    loss = _wrap(out, mesh, _sum_placements(x), ())
    early_reductions.pend(loss, weight_out)
    return loss, weight_out


def _nll_backward(op, args, kwargs):
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    x, target, weight = _nll_prepare(values)
    reduction, ignore_index = values["reduction"], values["ignore_index"]
    grad = values["grad_output"]
    total_weight = values["total_weight"]
    early_reductions.start(total_weight)
    if isinstance(total_weight, DTensor):  # (read by a mean only, where it is replicated)
        total_weight = _local(_settle(total_weight) if reduction == _MEAN else total_weight)
    if reduction == _NONE:
        g = _local(_align(grad, target))
    else:
        g = _local(_settle(grad)) if isinstance(grad, DTensor) else grad
    out = op(g, x.to_local(), target.to_local(), weight, reduction, ignore_index, total_weight)
    return _wrap(out, x.device_mesh, x.placements, tuple(x.shape))


def _reduced_dims(ndim: int, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    return sorted({d % max(ndim, 1) for d in dim})


def _mean(op, args, kwargs):
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    x = _settle(values["self"])
    dims = _reduced_dims(x.ndim, values.get("dim"))
    keepdim = bool(values.get("keepdim", False))
    dtype = values.get("dtype")
    local = x.to_local()
    if dims:
        out = torch.sum(local, dim=dims, keepdim=keepdim, dtype=dtype)
    else:
        out = local.to(dtype) if dtype is not None else local.clone()
    count = math.prod(x.shape[d] for d in dims) if dims else 1
    if not (out.is_floating_point() or out.is_complex()):
        raise RuntimeError(f"mean(): could not infer output dtype; input dtype {x.dtype}")
    out = out / count
    placements = []
    for p in x.placements:
        if p.is_shard() and p.dim in dims:
            placements.append(Partial("sum"))
        elif p.is_shard():
            shift = 0 if keepdim else sum(1 for d in dims if d < p.dim)
            placements.append(Shard(p.dim - shift))
        else:
            placements.append(Replicate())
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)] if keepdim else [
        s for d, s in enumerate(x.shape) if d not in dims
    ]
    return _wrap(out, x.device_mesh, placements, tuple(shape))


def _item(op, args, kwargs):
    """``tensor.item()``: the global value, whatever the layout (DTensor returns the local
    value of a pending sum otherwise)."""
    (x,) = args
    mesh = x.device_mesh
    # (a plain pending sum only: a Partial subclass, such as a norm's, reduces otherwise)
    if all(p.is_replicate() or (type(p) is Partial and p.reduce_op == "sum") for p in x.placements):
        value = early_reductions.reduced(x)  # reduced already, in the backward pass
        if value is not None:
            return op(value)
        value = x.to_local()
        for dim, p in enumerate(x.placements):  # one all-reduce per axis that holds a pending sum
            if p.is_partial() and mesh.size(dim) > 1:
                value = value.clone()
                dist.all_reduce(value, group=mesh.get_group(dim))
        return op(value)
    return op(x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local())


def _whole_comparison(op, args, kwargs):
    """``allclose`` / ``equal`` (a Python bool): the whole values compared, whatever their
    layouts (DTensor has no rule for them across layouts). The same answer on every process."""
    def whole(x):
        if isinstance(x, DTensor):
            return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
        return x

    return op(*[whole(a) for a in args], **kwargs)


def _per_row(op, args, kwargs):
    """Ops that treat each batch row on its own (CPU flash attention and its backward):
    with inputs split on dim 0 (or replicated), each device computes its rows."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, DTensor)]
    ref = max(tensors, key=lambda t: sum(p.is_shard() for p in t.placements))
    mesh = ref.device_mesh
    placements = [Shard(0) if p.is_shard() else Replicate() for p in ref.placements]

    def local(a):
        if not isinstance(a, DTensor):
            return a
        if a.ndim == 0 or a.shape[0] != ref.shape[0]:  # a mask shared by all rows
            return _settle(a).redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        return a.redistribute(mesh, placements).to_local()

    out = op(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()})
    rows = ref.shape[0]

    def wrap(t):
        return _wrap(t.contiguous(), mesh, placements, (rows, *t.shape[1:])) if isinstance(t, torch.Tensor) else t

    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def _rows_split(x: Any) -> bool:
    """Whether ``x`` is a DTensor split on dim 0 only (replicated over its other axes)."""
    return isinstance(x, DTensor) and x.ndim > 0 and any(p.is_shard(0) for p in x.placements) \
        and all(p.is_shard(0) or p.is_replicate() for p in x.placements)


def _whole(x: Any) -> Any:
    if isinstance(x, DTensor):
        return _settle(x).redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
    return x


def _batch_norm_eval(op, args, kwargs):
    """Batch norm with running statistics (``native_batch_norm`` with ``training=False``,
    ``_native_batch_norm_legit_no_training``) on rows split over the devices: each row on its
    own, so each device normalizes its rows. (DTensor's own rule moves the split to the
    channels, which the convolution after it mishandles.)"""
    x = args[0]
    training = op is aten.native_batch_norm.default and (len(args) < 6 or args[5])
    if kwargs or training or not _rows_split(x):
        return _default(op, args, kwargs)
    out, *stats = op(x.to_local(), *[_whole(a) for a in args[1:]])
    mesh = x.device_mesh
    wrapped = _wrap(out, mesh, x.placements, tuple(x.shape))
    return (wrapped, *(_wrap(t, mesh, [Replicate()] * mesh.ndim, tuple(t.shape)) for t in stats))


def _batch_norm_eval_backward(op, args, kwargs):
    """The backward of batch norm with running statistics (``train=False``) on rows split over
    the devices: each device's rows' input gradient; the weight's and bias's gradients are
    sums over the rows, pending (``Partial``) until reduced."""
    grad_out, x, train = args[0], args[1], args[7]
    if kwargs or train or not (_rows_split(x) and _rows_split(grad_out)) \
            or tuple(grad_out.placements) != tuple(x.placements):
        return _default(op, args, kwargs)
    grad_x, grad_w, grad_b = op(grad_out.to_local(), x.to_local(), *[_whole(a) for a in args[2:]])
    mesh = x.device_mesh
    sums = _sum_placements(x)
    return (None if grad_x is None else _wrap(grad_x, mesh, x.placements, tuple(x.shape)),
            None if grad_w is None else _wrap(grad_w, mesh, sums, tuple(grad_w.shape)),
            None if grad_b is None else _wrap(grad_b, mesh, sums, tuple(grad_b.shape)))


def _default(op, args, kwargs):
    """DTensor's own handling of ``op`` (bypassing the handler registered here)."""
    with dtensor_patches.without_handler(op):
        return op(*args, **kwargs)


def _cat(op, args, kwargs):
    """``cat`` of DTensors with plain tensors among them: the zeros autograd makes for the
    unused outputs of a split DTensor (``q, k, v = proj(x).chunk(3)`` with ``k`` unused; the
    split's backward concatenates them with the others' gradients). A plain tensor at this
    level holds its whole value: it enters as replicated."""
    seq = args[0]
    like = next((t for t in seq if isinstance(t, DTensor)), None)
    if like is not None and any(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) for t in seq):
        seq = [t if isinstance(t, DTensor) else replicated(t, like) for t in seq]
        args = (seq, *args[1:])
    return _default(op, args, kwargs)


def _split_twice_strided(x: DTensor) -> bool:
    """Whether a dim is split over two or more mesh axes, one of them a ``_StridedShard`` (a
    (sequence, batch) pair flattened with the batch split over 'data' and 'model'). DTensor's
    view rule gives such an input an output layout holding the wrong number of elements per
    process (torch 2.13: ``(24, 16)`` as ``(_StridedShard(0, sf=6),) * 2`` on a (2, 2) mesh, viewed
    as ``(6, 16, 4)``, comes out split in 2 instead of 4, and the local view fails)."""
    splits: dict[int, list] = {}
    for p in x.placements:
        if p.is_shard() or isinstance(p, _StridedShard):
            splits.setdefault(p.dim, []).append(p)
    return any(len(ps) > 1 and any(isinstance(p, _StridedShard) for p in ps) for ps in splits.values())


# (op, input layout, sizes) -> (output layout, this process's local sizes) of views made here
_VIEWS: dict = {}
_VIEWS_KEPT = 256


def _view_key(op, x: DTensor, args, kwargs):
    """What decides a view's layout and local sizes: the op, the input's layout (its
    ``DTensorSpec``: mesh, placements, global shape, stride, dtype) and the sizes asked for;
    None where that cannot be a key (symbolic sizes while compiling, keyword arguments)."""
    if kwargs or torch.compiler.is_compiling() or len(args) != 2:
        return None
    sizes = args[1]
    if not all(type(v) is int for v in sizes):
        return None
    return op, x._spec, tuple(sizes)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is a view of ``b``'s memory (DTensor computed the view locally, without
    moving the input first). Tensors without memory (meta, fake ones under ``explain``)
    are never taken for views."""
    if a.device.type == "meta":
        return False
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # (a fake tensor's storage has no data pointer)
        return False


def _keeps_uneven_dims(x: DTensor, shape) -> bool:
    """Whether the view of ``x`` as ``shape`` keeps each unevenly split dim as a dim of its own
    (only other dims merged or split: a sequence split unevenly over 'context' while the
    features split into heads). Each such dim's blocks are then the view's blocks, a layout
    DTensor expresses; the rest is DTensor's rule as for an even split."""
    if not isinstance(shape, (list, tuple, torch.Size)) or not all(isinstance(n, int) for n in shape):
        return False
    try:
        new = tuple(torch.empty(tuple(x.shape), device="meta").view(tuple(shape)).shape)
    except RuntimeError:
        return False
    mesh = x.device_mesh
    ways: dict[int, int] = {}
    for axis, p in enumerate(x.placements):
        if p.is_shard():
            ways[p.dim] = ways.get(p.dim, 1) * mesh.size(axis)
    old = tuple(x.shape)
    for d, k in ways.items():
        if old[d] % k == 0:
            continue
        before, upto = math.prod(old[:d]), math.prod(old[:d + 1])
        if not any(math.prod(new[:e]) == before and math.prod(new[:e + 1]) == upto and new[e] == old[d]
                   for e in range(len(new))):
            return False
    return True


# view keys whose DTensor layout _inverse_of_a_flatten has checked: True (exact) or False
_UNFLATTENS: dict = {}


def _inverse_of_a_flatten(op, x: DTensor, args, kwargs) -> DTensor | None:
    """DTensor's view of ``x`` (a dim split twice with a ``_StridedShard`` among the splits),
    where it is proven exact, else None. Such layouts come from flattening a tensor split on
    two dims (logits (batch, seq) over 'fsdp' and 'context' viewed as rows); their view back
    (the gradient's) is exact when DTensor's answer, flattened again by DTensor's rule for a
    flatten (the direction it gets right, on meta tensors: nothing moves), is ``x``'s layout
    and its local view holds this process's elements. Decided per layout and shapes, the
    same on every process (the local shapes checked are the ones every process computes
    from the global layout)."""
    key = _view_key(op, x, args, kwargs)
    if key is not None and _UNFLATTENS.get(key) is False:
        return None
    try:
        out = _default(op, args, kwargs)
    except RuntimeError:
        _UNFLATTENS[key] = False
        return None
    if key is not None and _UNFLATTENS.get(key):
        early_reductions.carry(x, out)
        return out
    try:
        meta = DTensor.from_local(torch.empty(out._local_tensor.shape, dtype=x.dtype, device="meta"), out.device_mesh,
                                  out.placements, run_check=False, shape=out.shape, stride=out.stride())
        back = _default(aten.view.default, (meta, list(x.shape)), {})
        exact = (tuple(back.placements) == tuple(x.placements) and tuple(back.shape) == tuple(x.shape)
                 and tuple(back._local_tensor.shape) == tuple(x._local_tensor.shape)
                 and out._local_tensor.numel() == x._local_tensor.numel())
    except RuntimeError:
        exact = False
    if key is not None:
        if len(_UNFLATTENS) >= _VIEWS_KEPT:
            _UNFLATTENS.clear()
        _UNFLATTENS[key] = exact
    if not exact:
        return None
    early_reductions.carry(x, out)
    return out


def _view(op, args, kwargs):
    """Views of an unevenly split tensor (``logits.view(-1, V)`` on 5 rows over 2
    devices, attention heads folded into an odd batch) have no torch.chunk layout
    DTensor can express: gather the uneven dims first (correct, but it moves the tensor).
    A dim split twice with a ``_StridedShard`` among the splits is gathered too (DTensor's rule
    gets its layout wrong: ``_split_twice_strided``). Both are decided from the global layout,
    the same on every process."""
    x = args[0]
    if _split_twice_strided(x):
        out = _inverse_of_a_flatten(op, x, args, kwargs)
        if out is not None:
            return out
        mesh = x.device_mesh
        whole = x.redistribute(mesh, [Replicate() if p.is_shard() or isinstance(p, _StridedShard) else p
                                      for p in x.placements])
        out = _default(op, (whole, *args[1:]), kwargs)
        early_reductions.carry(x, out)
        return out
    if not _uneven(x) or _keeps_uneven_dims(x, args[1] if len(args) > 1 else None):
        key = _view_key(op, x, args, kwargs)
        known = _VIEWS.get(key) if key is not None else None
        if known is not None:  # this view of this layout was made before: its local view, laid out alike
            spec, local_shape = known
            out = DTensor(op(x._local_tensor, local_shape), spec, requires_grad=False)
            early_reductions.carry(x, out)
            return out
        try:
            out = _default(op, args, kwargs)
            early_reductions.carry(x, out)
            if key is not None and _same_storage(out._local_tensor, x._local_tensor):
                if len(_VIEWS) >= _VIEWS_KEPT:
                    _VIEWS.clear()
                _VIEWS[key] = (out._spec, tuple(out._local_tensor.shape))
            return out
        except RuntimeError as e:
            # A view DTensor has no layout for (a split dim unflattened into pieces the mesh
            # does not divide: nn.MultiheadAttention's q, k, v out of a projection split over
            # 'model'): gather the split dims, as for an uneven split.
            if "redistribute" not in str(e) and "Sharding propagation failed" not in str(e):
                raise
    mesh = x.device_mesh
    whole = x.redistribute(mesh, [Replicate() if p.is_shard() else p for p in x.placements])
    out = _default(op, (whole, *args[1:]), kwargs)
    early_reductions.carry(x, out)
    return out


def _random(op, args, kwargs):
    """Random operations on a sharded DTensor where DTensor has no RNG tracker (a CPU mesh):
    each shard draws from a stream of its own (processes holding the same shard draw the
    same numbers), so no shard repeats another's mask; on a replicated DTensor every
    process draws the same numbers from the shared stream. On CUDA, DTensor's own
    offset-based tracker does this."""
    x = args[0]
    mesh = x.device_mesh
    if mesh.device_type != "cpu" or any(p.is_partial() for p in x.placements):
        return _default(op, args, kwargs)
    shard_dims = [d for d, p in enumerate(x.placements) if p.is_shard()]

    def local(a):
        return a.to_local() if isinstance(a, DTensor) else a

    local_args = [local(a) for a in args]
    local_kwargs = {k: local(v) for k, v in kwargs.items()}
    if shard_dims:
        index = rng.shard_index(list(mesh.get_coordinate()), list(mesh.shape), shard_dims)
        with rng.local_stream(index, "cpu"):
            out = op(*local_args, **local_kwargs)
    else:
        out = op(*local_args, **local_kwargs)
    if op._schema.name.endswith("_"):  # in place: the DTensor's local tensor was filled
        return x

    def wrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        spec = DTensorSpec(mesh, x.placements, tensor_meta=TensorMeta(x.shape, x.stride(), t.dtype))
        return DTensor(t, spec, requires_grad=False)

    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def _empty_like(op, args, kwargs):
    """A new tensor shaped like a pending sum holds no sum: it is laid out replicated (its
    values are unset). Dropout fills ``empty_like(x)`` with its mask in place; shaped as a
    pending sum (the output of a row-parallel layer), the in-place fill could not be laid out."""
    out = _default(op, args, kwargs)
    if not any(p.is_partial() for p in out.placements):
        return out
    placements = [Replicate() if p.is_partial() else p for p in out.placements]
    spec = DTensorSpec(out.device_mesh, tuple(placements), tensor_meta=out._spec.tensor_meta)
    return DTensor(out._local_tensor, spec, requires_grad=out.requires_grad)


def _below_autograd(handler: Callable) -> Callable:
    """Handlers run under the autograd kernel; their internal redistributions must not
    record a graph of their own."""

    def run(op, args, kwargs):
        with torch.no_grad():
            return handler(op, args, kwargs)

    return run


_HANDLERS: dict = {
    aten._local_scalar_dense.default: _item,
    aten.empty_like.default: _empty_like,
    aten.mse_loss.default: _pointwise_loss_forward(2),
    aten.mse_loss_backward.default: _pointwise_loss_backward(2),
    aten.smooth_l1_loss.default: _pointwise_loss_forward(2),
    aten.smooth_l1_loss_backward.default: _pointwise_loss_backward(2),
    aten.huber_loss.default: _pointwise_loss_forward(2),
    aten.huber_loss_backward.default: _pointwise_loss_backward(2),
    aten.soft_margin_loss.default: _pointwise_loss_forward(2),
    aten.soft_margin_loss_backward.default: _pointwise_loss_backward(2),
    aten.binary_cross_entropy.default: _pointwise_loss_forward(3),
    aten.binary_cross_entropy_backward.default: _pointwise_loss_backward(3),
    aten.binary_cross_entropy_with_logits.default: _pointwise_loss_forward(4),
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss2d_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten.nll_loss2d_backward.default: _nll_backward,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.cat.default: _cat,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _per_row,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _per_row,
    aten.mean.default: _mean,
    aten.mean.dim: _mean,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_eval,
    aten.native_batch_norm.default: _batch_norm_eval,
    aten.native_batch_norm_backward.default: _batch_norm_eval_backward,
    aten.allclose.default: _whole_comparison,
    aten.equal.default: _whole_comparison,
}
_HANDLERS.update(dict.fromkeys([
    aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli_.float, aten.uniform_.default,
    aten.normal_.default, aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.randint_like.low_dtype, aten.exponential_.default, aten.log_normal_.default, aten.geometric_.default,
], _random))
_HANDLERS = {op: _below_autograd(h) for op, h in _HANDLERS.items()}


def install() -> None:
    """Add the handlers to DTensor's table (the engine's start does it)."""
    dtensor_patches.add_op_handlers(_HANDLERS)
