"""Implicit replication: unannotated tensors are replicated, as in GSPMD.

When a torch function receives a DTensor together with plain tensors (a model's parameters
meeting a batch from ``MpDeviceLoader``), the plain ones enter as replicated DTensors through
``DTensor.from_local``. That is differentiable: the gradient of a plain parameter comes back
as a plain tensor, already summed over the mesh (the all-reduce of data parallelism), so
optimizers keep working on plain tensors. Host reads of sharded values (``.cpu()``,
``.item()``, formatting) see the whole value, and writes into a sharded tensor through
indexing reach every device's block. One ``TorchFunctionMode`` does it, entered for the
process when the native engine starts (``torchspmd.patches.torch.GLOBAL_VIEW_MODE``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from torchspmd.layouts.blocks import block_of
from torchspmd.engines.native.communication import replicas
from torchspmd.engines.native.global_view import sequence_split, early_reductions
from torchspmd.engines.native.start import global_mode
from torchspmd.engines.native.global_view import module_slots as _owners
from torchspmd.engines.native.start.global_mode import resume, suspend
from torchspmd.errors import SpmdError
from torchspmd.patches import torch as torch_patches


def _first_dtensor(args: tuple, kwargs: dict) -> DTensor | None:
    for a in args:
        if isinstance(a, DTensor):
            return a
        if type(a) in (list, tuple):
            for b in a:
                if isinstance(b, DTensor):
                    return b
    for a in kwargs.values():
        if isinstance(a, DTensor):
            return a
    return None


class _ShareOverDataAxes(torch.autograd.Function):
    """A plain tensor lifted to a replicated DTensor whose gradient comes back as this
    process's share over the data axes (summed over the other axes): what FSDP2 sums."""

    @staticmethod
    def forward(ctx, t, mesh, data_dims):
        ctx.mesh, ctx.data_dims = mesh, data_dims
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        mesh = ctx.mesh
        if not isinstance(grad, DTensor):
            return grad, None, None
        # a pending sum over a data axis stays pending (each process's share); over the other
        # axes it is summed; a gradient whole over a data axis is held by its first process
        shares = [p if i in ctx.data_dims and p.is_partial() else Replicate() for i, p in enumerate(grad.placements)]
        local = grad.redistribute(mesh, shares).to_local()
        coordinate = mesh.get_coordinate()
        if any(i in ctx.data_dims and p.is_replicate() and coordinate[i] != 0 for i, p in enumerate(shares)):
            local = torch.zeros_like(local)
        return local, None, None


_SHARES = threading.local()


@contextlib.contextmanager
def gradient_shares(data_dims: list[int]) -> Iterator[None]:
    """Inside: plain tensors that need a gradient are lifted so that their gradient is this
    process's share over ``data_dims`` (FSDPv2's units on a global batch: FSDP2 then sums the
    shares over those axes), not the whole gradient."""
    before = getattr(_SHARES, "dims", None)
    _SHARES.dims = list(data_dims)
    try:
        yield
    finally:
        _SHARES.dims = before


def replicated(t: torch.Tensor, like: DTensor) -> DTensor:
    mesh = like.device_mesh
    dims = getattr(_SHARES, "dims", None)
    if dims is not None and t.requires_grad and torch.is_grad_enabled():
        return _ShareOverDataAxes.apply(t, mesh, tuple(dims))
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _check_replica(t: torch.Tensor) -> None:
    """A plain parameter is replicated: the first time one meets a DTensor, check it holds
    the same value on every process, and copy rank 0's where it does not (as DDP does).
    Every process reaches this at the same point of the same program."""
    if t.requires_grad and t.is_leaf and not replicas.agreed(t):
        replicas.agree_once([t])


def _lift(a: Any, like: DTensor) -> Any:
    if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
        _check_replica(a)
        return replicated(a, like)
    if type(a) in (list, tuple) and any(
        isinstance(b, torch.Tensor) and not isinstance(b, DTensor) for b in a
    ):
        return type(a)(_lift(b, like) for b in a)
    return a


_CAT = {torch.cat, torch.concat, torch.concatenate}
_JOIN = _CAT | {torch.stack}


def _one_mesh(seq):
    """Tensors of several meshes joined into one (the norms of parameters some of which
    FSDPv2 holds on ('fsdp', 'model') and some on 'fsdp' alone, stacked by torch's
    ``clip_grad_norm_``): DTensor cannot; their whole values can."""
    if len({t.device_mesh for t in seq if isinstance(t, DTensor)}) < 2:
        return seq
    return type(seq)(t.full_tensor() if isinstance(t, DTensor) else t for t in seq)


def _without_legacy_empties(seq):
    """torch.cat skips 1-D tensors with no elements beside tensors of more dims (transformers'
    DynamicCache starts from ``torch.tensor([])``); lifted to a DTensor, such a tensor would be
    split on a dim it lacks. Leave them out, as torch does."""
    def empty(t):
        return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == 0
    if any(empty(t) for t in seq) and any(isinstance(t, torch.Tensor) and t.dim() > 1 for t in seq):
        return type(seq)(t for t in seq if not empty(t))
    return seq


class _ReplicateUnannotated(TorchFunctionMode):
    """Lift plain tensors that meet a DTensor to replicated DTensors."""

    def _per_mesh(self, func, types, args, kwargs):
        """A ``_foreach_`` op over tensors of several meshes (parameters FSDPv2 holds on
        ('fsdp', 'model') and on 'fsdp' alone: torch's ``clip_grad_norm_`` scales all their
        gradients by one coefficient), run once per mesh, each with its plain operands lifted
        to that mesh."""
        seq = args[0]
        groups: dict = {}
        for i, t in enumerate(seq):
            groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(i)

        def part(a, idx):
            return type(a)(a[i] for i in idx) if type(a) in (list, tuple) and len(a) == len(seq) else a

        results: list = [None] * len(seq)
        returned = False
        for idx in groups.values():
            out = self.__torch_function__(func, types, tuple(part(a, idx) for a in args),
                                          {k: part(v, idx) for k, v in kwargs.items()})
            if out is not None:
                returned = True
                for j, i in enumerate(idx):
                    results[i] = out[j]
        return results if returned else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        like = _first_dtensor(args, kwargs)
        if like is None:
            return func(*args, **kwargs)
        if func is torch.Tensor.item and len(args) == 1 and not kwargs:
            # A loss whose sum the backward pass reduced already: its value, without
            # passing DTensor's dispatch to reach the same (exact_ops' item handler).
            value = early_reductions.reduced_item(args[0])
            if value is not None:
                return value
        if torch.is_inference_mode_enabled():
            # Under inference mode, composite ops (cross_entropy, ...) reach DTensor whole, and
            # its sharding propagation fails on them: run them as under no_grad, which computes
            # the same values (the results are then ordinary tensors without gradients).
            with torch.inference_mode(False), torch.no_grad():
                return self.__torch_function__(func, types, args, kwargs)
        copy = args[0] if args and _writes_into_a_copy(func, args[0]) else None
        if args and isinstance(args[0], DTensor) and func is torch.Tensor.__setitem__ \
                and _writable_by_blocks(args[0], args[2] if len(args) > 2 else None):
            _setitem(*args[:3])
            if copy is not None:
                _write_through(copy)
            return None
        if func is torch.Tensor.__getitem__ and len(args) > 1 and isinstance(args[0], DTensor) \
                and _plain_tensor_index(args[1]):
            # advanced indexing of a sharded tensor by plain index tensors (transformers' padding
            # mask read at a grid of positions): on the whole value, as one device would
            return _on_the_whole_value(func, args[0], args, kwargs)
        if func in _TO_HOST and args and isinstance(args[0], DTensor) and _leaves_for_host(func, args, kwargs):
            return _whole_on_host(func, args, kwargs)
        if func in _TO_PYTHON and args and isinstance(args[0], DTensor):
            if func is not torch.Tensor.__format__:
                return _whole_on_host(func, args, kwargs)
            if args[0].ndim == 0:  # (a tensor with dims formats as it prints: the DTensor)
                return format(args[0].item(), *args[1:])  # (item(): the global value, pending sums too)
        if getattr(func, "__name__", "").startswith("_foreach_") and args and type(args[0]) in (list, tuple) \
                and len({t.device_mesh for t in args[0] if isinstance(t, DTensor)}) > 1:
            return self._per_mesh(func, types, args, kwargs)
        if func in _JOIN and args and type(args[0]) in (list, tuple):
            seq = _without_legacy_empties(args[0]) if func in _CAT else args[0]
            if func in _CAT and len(seq) == 1 and isinstance(seq[0], DTensor) and "out" not in kwargs:
                # the cat of one tensor is its copy, laid out as it is (DTensor's rule gathers a
                # split cat dim: a sequence split over 'context' entering transformers' cache)
                return seq[0].clone(memory_format=torch.contiguous_format)
            args = (_one_mesh(seq), *args[1:])
            if _first_dtensor(args, kwargs) is None:
                return func(*args, **kwargs)
        if func is torch.nn.functional.batch_norm:
            out = _batch_norm_on_a_mesh(args, kwargs)
            if out is not None:
                return out
        if func is torch.nn.functional.linear and sequence_split.inner_split(args[0] if args else kwargs.get("input")):
            out = sequence_split.linear(tuple(_lift(a, like) for a in args), {k: _lift(v, like) for k, v in kwargs.items()})
            if out is not None:
                return out
        if func is torch.nn.functional.multi_head_attention_forward and isinstance(args[0] if args else None, DTensor):
            out = sequence_split.multi_head_attention(tuple(_lift(a, like) for a in args),
                                                      {k: _lift(v, like) for k, v in kwargs.items()})
            if out is not None:
                return out
        if func is torch.nn.functional.scaled_dot_product_attention and isinstance(args[0] if args else None, DTensor) \
                and sequence_split.split_sequence_axes(args[0]):
            out = sequence_split.attend(tuple(_lift(a, like) for a in args), {k: _lift(v, like) for k, v in kwargs.items()})
            if out is not None:
                return out
        if func not in _NO_LIFT:
            args = tuple(_lift(a, like) for a in args)
            kwargs = {k: _lift(v, like) for k, v in kwargs.items()}
        if func in _NOT_ON_EMPTY_BLOCKS:  # every process computes it whole, as one device would
            args = tuple(_whole_where_a_block_is_empty(a) for a in args)
        if func in _EXTREMA and args and isinstance(args[0], DTensor):
            args, kwargs = _every_dim(args, kwargs)
        if func in _RECURRENT:
            out = _without_onednn(func, args, kwargs)
        elif func in _GATHERED:
            out = _on_the_whole_value(func, like, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func in _VIEWS and isinstance(args[0], DTensor):
            _tag_copies(func, args, kwargs, out)
        elif copy is not None:
            _write_through(copy)
        if args and func in early_reductions.SCALINGS and isinstance(args[0], DTensor):
            early_reductions.derive(func, args, kwargs, out)  # loss / accumulation_steps: item() of the loss's pending sum
        elif func is torch.nn.functional.embedding and isinstance(out, DTensor) and \
                any(p.is_partial() for p in out.placements):
            # A table split over its vocabulary gives each device the rows it holds, a sum
            # pending (DTensor's masked partial). Reduce it at once, as a vocabulary-parallel
            # embedding does: DTensor cannot turn that pending sum into a batch split later.
            out = out.redistribute(out.device_mesh, [Replicate() if p.is_partial() else p for p in out.placements])
        return out


# ``.cpu()`` of a sharded value is its whole value on the host, as torch_xla's ``.cpu()`` of a
# sharded XLA tensor: what a program compares (``torch.allclose(expected, out.cpu())``) or
# saves. ``.to(device)`` does the same when it leaves the mesh's device type (a CUDA mesh's
# value to ``'cpu'``); on a CPU mesh ``.to('cpu')`` is "to the device" (``x.to(xm.xla_device())``
# in a torch_xla program) and changes nothing. A module's parameters and buffers keep their
# layout (``model.cpu()``, ``model.to(device)`` must not unshard a model).
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.to}


def _leaves_for_host(func, args, kwargs) -> bool:
    t = args[0]
    if isinstance(t, torch.nn.Parameter):
        return False

    if _owners.live_slots(t):
        return False
    if func is torch.Tensor.cpu:
        return True
    device = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
    if device is None:
        return False
    return torch.device(device).type == "cpu" and t.device.type != "cpu"


# Reading a sharded value as a Python or NumPy value (``f"{loss:.4f}"`` of a scalar,
# ``tolist()``, ``numpy()``, ``np.asarray``): its whole value, as on one device. (DTensor
# raises for each: ``object.__format__`` and no data to convert.)
_TO_PYTHON = {torch.Tensor.__format__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}


def _whole_on_host(func, args, kwargs) -> torch.Tensor:
    whole = args[0].full_tensor()
    token = suspend()  # the whole value is a plain tensor: nothing to lift
    try:
        return func(whole, *args[1:], **kwargs)
    finally:
        resume(token)


# Functions that legitimately take a DTensor beside plain tensors.
_NO_LIFT = {torch.Tensor.__setitem__, torch.Tensor.__getitem__}

# The recurrent layers (nn.LSTM, nn.GRU, nn.RNN). On CPU torch runs them as oneDNN's fused
# layer (aten.mkldnn_rnn_layer), which DTensor has no rule for; with oneDNN off for the call
# they decompose into matrix products and pointwise steps, which it has. Batch first, the
# decomposed GRU and RNN turn their output around in place (aten.transpose_), which DTensor
# has no rule for either: the call runs time first, between two transposes of our own.
_RECURRENT = {torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu}


def _without_onednn(func, args: tuple, kwargs: dict):
    # (input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
    # the packed-sequence form has no batch_first: (data, batch_sizes, hx, params, ...)
    batch_first = not kwargs and len(args) == 9 and isinstance(args[2], (list, tuple)) and args[8] is True
    if batch_first:
        args = (args[0].transpose(0, 1), *args[1:8], False)
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        out = func(*args, **kwargs)
    finally:
        torch.backends.mkldnn.enabled = previous
    return (out[0].transpose(0, 1), *out[1:]) if batch_first else out

# Functions DTensor cannot run on split values, computed on the whole value instead (every
# process alike, as one device; their backward on plain tensors): cummax, cummin and cumprod,
# whose C++ backward formulas make plain tensors and mix the DTensor gradient in ("aten.scatter_add"
# / "aten.where.self got mixed torch.Tensor and DTensor"); and those whose output size
# depends on the values (nonzero, masked_select, unique: DTensor has no sharding rule).
_GATHERED = {torch.cummax, torch.cummin, torch.Tensor.cummax, torch.Tensor.cummin, torch.cumprod, torch.Tensor.cumprod,
             torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
             torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
             torch.unique_consecutive, torch.Tensor.unique_consecutive}


def _plain_tensor_index(index: Any) -> bool:
    """Whether an indexing key holds a plain (not DTensor) tensor of more than one element."""
    parts = index if type(index) is tuple else (index,)
    return any(isinstance(p, torch.Tensor) and not isinstance(p, DTensor) and p.dim() > 0 for p in parts)


def _on_the_whole_value(func, like: DTensor, args: tuple, kwargs: dict):
    """``func`` on the whole values of its DTensor arguments; tensor results go back into
    ``like``'s layout where they have its shape (differentiable throughout)."""
    mesh = like.device_mesh
    whole = [Replicate()] * mesh.ndim

    def gathered(a):
        return a.redistribute(mesh, whole).to_local() if isinstance(a, DTensor) else a

    token = suspend()  # whole values are plain tensors: nothing to lift
    try:
        out = func(*[gathered(a) for a in args], **{k: gathered(v) for k, v in kwargs.items()})
    finally:
        resume(token)

    def back(t):
        if not isinstance(t, torch.Tensor):
            return t
        d = DTensor.from_local(t, mesh, whole, run_check=False)
        return d.redistribute(mesh, like.placements) if tuple(t.shape) == tuple(like.shape) else d

    if isinstance(out, tuple):  # (a tuple, or torch.return_types' values and indices)
        return type(out)([back(t) for t in out])
    return back(out)


# Batch norm in training mode updating its running statistics (plain buffers) on a mesh of two
# or more axes: DTensor's rule lays the statistics out anew, and the buffers' in-place update is
# lost (found by tests/test_fuzz.py on ('data', 'model')). There it is computed from DTensor
# reductions (the batch's mean and biased variance over every dim but the channels), and the
# buffers are updated from their whole values, as one device's kernel does.
def _batch_norm_on_a_mesh(args: tuple, kwargs: dict):
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    a = dict(zip(names, args), **kwargs)
    x, mean_buf, var_buf = a["input"], a.get("running_mean"), a.get("running_var")
    if not (a.get("training", False) and isinstance(x, DTensor) and x.device_mesh.ndim > 1 and x.ndim > 1
            and isinstance(mean_buf, torch.Tensor) and not isinstance(mean_buf, DTensor)
            and isinstance(var_buf, torch.Tensor) and not isinstance(var_buf, DTensor)):
        return None
    momentum, eps = a.get("momentum", 0.1), a.get("eps", 1e-5)
    dims = [0, *range(2, x.ndim)]
    count = x.numel() // x.shape[1]
    mean = x.mean(dims)
    var = (x - mean.view(1, -1, *[1] * (x.ndim - 2))).pow(2).mean(dims)
    with torch.no_grad():
        whole_mean, whole_var = mean.detach().full_tensor(), var.detach().full_tensor()
        mean_buf.mul_(1 - momentum).add_(whole_mean.to(mean_buf.dtype), alpha=momentum)
        var_buf.mul_(1 - momentum).add_((whole_var * (count / max(count - 1, 1))).to(var_buf.dtype), alpha=momentum)
    shape = (1, -1, *[1] * (x.ndim - 2))
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    if a.get("weight") is not None:
        y = y * _lift(a["weight"], x).view(shape)
    if a.get("bias") is not None:
        y = y + _lift(a["bias"], x).view(shape)
    return y


# amax/amin over every dim (no dim given): their backward sums over ``dim=[]``, which DTensor's
# rule takes as no dim at all, so each process divides by its own count of maxima (NaN where it
# holds none). Given every dim by number, the same reduction has an exact backward.
_EXTREMA = {torch.amax, torch.amin, torch.Tensor.amax, torch.Tensor.amin}


def _every_dim(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else ())
    if x.ndim == 0 or dim not in ((), []):
        return args, kwargs
    kwargs = {k: v for k, v in kwargs.items() if k != "dim"}
    return (x, tuple(range(x.ndim)), *args[2:]), kwargs


# Reductions without an identity: on a process holding no rows they raise ("Expected
# reduction dim to be specified for input.numel() == 0") where the others do not.
_NO_IDENTITY = {torch.max, torch.min, torch.amax, torch.amin, torch.aminmax, torch.argmax, torch.argmin,
                torch.median, torch.nanmedian, torch.Tensor.max, torch.Tensor.min, torch.Tensor.amax,
                torch.Tensor.amin, torch.Tensor.aminmax, torch.Tensor.argmax, torch.Tensor.argmin,
                torch.Tensor.median, torch.Tensor.nanmedian}
# Indexing along a split dim: DTensor's rule indexes each block with the indices moved into
# it and clamped, which raises on a block with no rows ("index 0 is out of bounds for
# dimension 0 with size 0") where the other processes go on.
_NOT_ON_EMPTY_BLOCKS = _NO_IDENTITY | {torch.gather, torch.Tensor.gather, torch.take_along_dim,
                                       torch.Tensor.take_along_dim}


def _some_block_empty(t: DTensor) -> bool:
    """Whether some process holds an empty block of ``t`` (known alike everywhere from the
    global shape and the layout: no communication)."""
    if not any(p.is_shard() for p in t.placements) or t.numel() == 0:
        return False
    mesh_shape = tuple(t.device_mesh.shape)
    return any(length == 0 for coord in itertools.product(*map(range, mesh_shape))
               for _, length in block_of(tuple(t.shape), mesh_shape, t.placements, coord))


def _whole_where_a_block_is_empty(a: Any) -> Any:
    if isinstance(a, DTensor) and _some_block_empty(a):
        return a.redistribute(a.device_mesh, [Replicate() if p.is_shard() else p for p in a.placements])
    return a

# ---------------------------------------------------------------------------
# Writes into a sharded tensor through indexing.
# ---------------------------------------------------------------------------
# A view that cuts a sharded dim (``y[0]``, ``y[2:5]`` of a batch split over its rows) has no
# layout DTensor can express: DTensor gathers and returns a copy. Reading it is exact; an
# in-place write into it would change the copy alone, where one device changes ``y``. So
# such copies remember where they come from, and a write into one (or into a view of one)
# is written through into ``y``'s blocks. Assignments (``y[key] = v``) are done on the
# whole value and written back into each device's block.

#: functions that return a view of their input on one device
_VIEWS = {
    torch.Tensor.__getitem__, torch.Tensor.select, torch.select, torch.Tensor.narrow, torch.narrow,
    torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk, torch.Tensor.unbind, torch.unbind,
    torch.Tensor.tensor_split, torch.tensor_split, torch.Tensor.view, torch.Tensor.transpose,
    torch.transpose, torch.Tensor.t, torch.t, torch.Tensor.permute, torch.permute, torch.Tensor.unsqueeze,
    torch.unsqueeze, torch.Tensor.squeeze, torch.squeeze, torch.Tensor.expand,
    torch.Tensor.diagonal, torch.diagonal, torch.Tensor.movedim, torch.movedim, torch.Tensor.unflatten,
    torch.Tensor.swapaxes, torch.swapaxes,
}
#: in-place methods that do not write values
_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "record_stream", "detach_"}


def _basic_key(key: Any) -> bool:
    """Whether indexing by ``key`` gives a view on one device (ints, slices, None, ...)."""
    items = key if type(key) is tuple else (key,)
    return all(k is None or k is Ellipsis or type(k) in (int, slice) for k in items)


def _storage(t: DTensor) -> int:
    return t._local_tensor.untyped_storage().data_ptr()


def _tag_copies(func, args: tuple, kwargs: dict, out: Any) -> None:
    """Mark the results of a view function that are copies of ``args[0]``'s data (or views
    of such a copy) rather than views of it, with how to find their place in the source."""
    x = args[0]
    if func is torch.Tensor.__getitem__ and not _basic_key(args[1]):
        return  # advanced indexing copies on one device too
    cut = getattr(x, "_torchspmd_cut", None)
    several = isinstance(out, (tuple, list))
    for i, t in enumerate(out if several else (out,)):
        if not isinstance(t, DTensor):
            continue
        step = (func, args[1:], kwargs, i if several else None)
        if cut is not None:
            if _storage(t) == _storage(x):  # a view of the copy: a copy too
                t._torchspmd_cut = (cut[0], [*cut[1], step])
        elif _storage(t) != _storage(x) and any(p.is_shard() for p in x.placements):
            t._torchspmd_cut = (x, [step])


def _writes_into_a_copy(func, t: Any) -> bool:
    if getattr(t, "_torchspmd_cut", None) is None:
        return False
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES)


def _write_through(t: DTensor) -> None:
    """``t`` (a copy of part of a sharded tensor, see ``_tag_copies``) was written in place:
    write its values into the part of the source it stands for, as one device would have."""
    source, chain = t._torchspmd_cut
    if not _writable_by_blocks(source, t):
        raise SpmdError(
            "an in-place write into a part of a sharded tensor that cuts a sharded dim (such as y[0] of a "
            "batch split over its rows) while autograd records it, or into a tensor laid out as a pending sum or "
            "a strided split: not supported; write over the whole tensor (`y.masked_fill_(mask, value)`, "
            "`torch.where`), or under torch.no_grad()")
    full = source.full_tensor()
    view = full
    for func, rest, kwargs, i in chain:  # the same views of the whole value
        view = func(view, *rest, **kwargs)
        if i is not None:
            view = view[i]
    view.copy_(t.full_tensor())
    _keep_block(source, full)


def _keep_block(y: DTensor, full: torch.Tensor) -> None:
    """Each process writes its block of ``full`` (``y``'s whole value) into ``y``."""
    mesh = y.device_mesh
    block = block_of(y.shape, list(mesh.shape), y.placements, list(mesh.get_coordinate()))
    y._local_tensor.copy_(full[tuple(slice(start, start + length) for start, length in block)])


def _writable_by_blocks(y: DTensor, value: Any) -> bool:
    """``y[key] = value`` can be done on the whole value and written back block by block: y is
    split in chunks or replicated (no pending sum, no strided split) and no gradient is involved."""
    if any(p.is_partial() or (p.is_shard() and type(p) is not Shard) for p in y.placements):
        return False
    return not (torch.is_grad_enabled() and (y.requires_grad or getattr(value, "requires_grad", False)))


def _setitem(y: DTensor, key: Any, value: Any) -> None:
    """``y[key] = value`` as one device does it: on the whole value (every process), then
    each process keeps its block."""

    def whole(a):
        if isinstance(a, DTensor):
            return a.full_tensor()
        if type(a) in (tuple, list):
            return type(a)(whole(b) for b in a)
        return a

    full = y.full_tensor()
    full[whole(key)] = whole(value)
    _keep_block(y, full)


def install() -> None:
    """Enter the mode for the process (the engine's start does it)."""
    mode = _ReplicateUnannotated()
    global_mode.set_mode(mode)
    torch_patches.enter_mode(mode)
