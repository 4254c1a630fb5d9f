"""What makes the global view exact on DTensor.

Two things, installed once by ``use_spmd()``:

1. Unannotated tensors are replicated, as in GSPMD. When a torch function receives a
   DTensor together with plain tensors (a model's parameters meeting a batch from
   ``MpDeviceLoader``), the plain ones enter as replicated DTensors through
   ``DTensor.from_local``. That is differentiable: the gradient of a plain parameter
   comes back as a plain tensor, already summed over the mesh (the all-reduce of data
   parallelism), so optimizers keep working on plain tensors.

2. Losses and means over a batch-sharded DTensor are exact. DTensor's own rules for
   ``mse_loss``, ``smooth_l1_loss``, ``nll_loss`` (so ``cross_entropy``) and friends average
   per-device means, which is wrong when devices hold different numbers of rows (or
   different numbers of ignored labels), and some refuse uneven splits. Here each
   device sums its part, the sum stays a pending ``Partial`` reduction, and the
   division uses the global element count (or the global weight of non-ignored
   targets): the loss and its gradients equal one device's.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode

from torchspmd import _early, _replicas, _rng
from torchspmd._chunks import block_of
from torchspmd._errors import SpmdError
from torchspmd._chunks import contiguous_stride as _contiguous_stride

aten = torch.ops.aten

_MEAN, _SUM, _NONE = 1, 2, 0

# ---------------------------------------------------------------------------
# 1. Implicit replication of plain tensors, with differentiable entry.
# ---------------------------------------------------------------------------


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


def _replicated(t: torch.Tensor, like: DTensor) -> DTensor:
    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _check_replica(t: torch.Tensor) -> None:
    """A plain parameter is replicated: the first time one meets a DTensor, check it holds
    the same value on every process, and copy rank 0's where it does not (as DDP does).
    Every process reaches this at the same point of the same program."""
    if t.requires_grad and t.is_leaf and not _replicas.agreed(t):
        _replicas.agree_once([t])


def _lift(a: Any, like: DTensor) -> Any:
    if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
        _check_replica(a)
        return _replicated(a, like)
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
            args = (_one_mesh(seq), *args[1:])
            if _first_dtensor(args, kwargs) is None:
                return func(*args, **kwargs)
        if func not in _NO_LIFT:
            args = tuple(_lift(a, like) for a in args)
            kwargs = {k: _lift(v, like) for k, v in kwargs.items()}
        if func in _NO_IDENTITY:  # every process computes it whole, as one device would
            args = tuple(_whole_where_a_block_is_empty(a) for a in args)
        out = func(*args, **kwargs)
        if func in _VIEWS and isinstance(args[0], DTensor):
            _tag_copies(func, args, kwargs, out)
        elif copy is not None:
            _write_through(copy)
        if args and func in _early._SCALINGS and isinstance(args[0], DTensor):
            _early.derive(func, args, kwargs, out)  # loss / accumulation_steps: item() of the loss's pending sum
        elif func is torch.nn.functional.embedding and isinstance(out, DTensor) and \
                any(p.is_partial() for p in out.placements):
            # A table split over its vocabulary gives each device the rows it holds, a sum
            # pending (DTensor's masked partial). Reduce it at once, as a vocabulary-parallel
            # embedding does: DTensor cannot turn that pending sum into a batch split later.
            out = out.redistribute(out.device_mesh, [Replicate() if p.is_partial() else p for p in out.placements])
        return out


def _uneven(x: DTensor) -> bool:
    """Whether some sharded dim does not split evenly over its mesh axes."""
    mesh = x.device_mesh
    ways: dict[int, int] = {}
    for axis, p in enumerate(x.placements):
        if p.is_shard():
            ways[p.dim] = ways.get(p.dim, 1) * mesh.size(axis)
    return any(x.shape[d] % k for d, k in ways.items())




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
    from torchspmd import _owners

    if _owners._live_slots(t):
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

# Reductions without an identity: on a process holding no rows they raise ("Expected
# reduction dim to be specified for input.numel() == 0") where the others do not.
_NO_IDENTITY = {torch.max, torch.min, torch.amax, torch.amin, torch.aminmax, torch.argmax, torch.argmin,
                torch.median, torch.nanmedian, torch.Tensor.max, torch.Tensor.min, torch.Tensor.amax,
                torch.Tensor.amin, torch.Tensor.aminmax, torch.Tensor.argmax, torch.Tensor.argmin,
                torch.Tensor.median, torch.Tensor.nanmedian}


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


_MODE: _ReplicateUnannotated | None = None


def suspend():
    """Step the lifting mode aside while it is the innermost mode; return what ``resume``
    needs to put it back (None when nothing was stepped aside)."""
    if _MODE is not None and torch._C._len_torch_function_stack() > 0 and \
            torch.overrides._get_current_function_mode() is _MODE:
        return torch._C._pop_torch_function_stack()
    return None


def resume(token) -> None:
    if token is not None:
        torch._C._push_on_torch_function_stack(token)


@contextlib.contextmanager
def local_region() -> Iterator[None]:
    """Inside a wrapped module's local compute there are no DTensors to meet: no operation
    there should pay for the lifting mode."""
    token = suspend()
    try:
        yield
    finally:
        resume(token)


def _all_plain(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    """Whether an optimizer step can meet no DTensor: no closure (a closure runs the
    program's forward), and plain parameters, gradients and state."""
    if any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values()):
        return False
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(p, DTensor) or isinstance(p.grad, DTensor):
                return False
    return not any(isinstance(v, DTensor) for state in opt.state.values() for v in state.values())


def _plain_steps_step_aside(profile_hook_step: Callable) -> Callable:
    """``Optimizer.profile_hook_step`` (what wraps each optimizer class's ``step`` the first
    time one is built) with the step itself run without the lifting mode when it can meet no
    DTensor: a data-parallel program's optimizer (plain replicated parameters) then pays no
    Python call per operation, as under DDP. The step hooks still run under the mode."""

    def hook_step(func: Callable) -> Callable:
        @functools.wraps(func)
        def step(*args, **kwargs):
            if torch.compiler.is_compiling():  # a compiled step: left to torch.compile as it is
                return func(*args, **kwargs)
            token = suspend()  # (reading p.grad under the mode would be a call of its own)
            if token is not None and not _all_plain(args[0], args, kwargs):
                resume(token)
                token = None
            try:
                return func(*args, **kwargs)
            finally:
                resume(token)

        return profile_hook_step(step)

    hook_step._torchspmd = True  # type: ignore[attr-defined]
    return hook_step


def install() -> None:
    """Install both mechanisms (idempotent)."""
    global _MODE
    if _MODE is None:
        _MODE = _ReplicateUnannotated()
        _MODE.__enter__()
    DTensor._op_dispatcher._custom_op_handlers.update(_HANDLERS)
    hook = torch.optim.Optimizer.profile_hook_step
    if not getattr(hook, "_torchspmd", False):
        hook = _plain_steps_step_aside(hook)
        torch.optim.Optimizer.profile_hook_step = staticmethod(hook)
        # optimizer classes already built once (before use_spmd(), or in the process this one
        # was forked from) had their step wrapped by torch's hook: wrap it again by this one
        pending = list(torch.optim.Optimizer.__subclasses__())
        while pending:
            cls = pending.pop()
            pending.extend(cls.__subclasses__())
            step = cls.__dict__.get("step")
            if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
                cls.step = hook(step.__wrapped__)
                cls.step.hooked = True


# ---------------------------------------------------------------------------
# 2. Exact reductions over sharded rows.
# ---------------------------------------------------------------------------


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
        t = _replicated(t, ref)
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


def _sum_placements(x: DTensor) -> list:
    """Placements of a full reduction of ``x``: pending sums over its shard axes."""
    return [Partial("sum") if p.is_shard() else Replicate() for p in x.placements]


def _group_sum(value: torch.Tensor, x: DTensor) -> torch.Tensor:
    """Sum a local scalar over the mesh axes that shard ``x`` (a real all-reduce)."""
    value = value.clone()
    mesh = x.device_mesh
    for dim, p in enumerate(x.placements):
        if p.is_shard() and mesh.size(dim) > 1:
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
        _early.pend(loss, values["self"])
        return loss

    return handler


def _pointwise_loss_backward(n_inputs: int) -> Callable:
    """Handler for ``op_backward(grad_output, self, target, [weight,] reduction, *extra)``."""

    def handler(op, args, kwargs):
        args = list(args)
        schema_names = [a.name for a in op._schema.arguments]
        values = dict(zip(schema_names, args))
        values.update(kwargs)
        _early.start(values["self"])
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
    if any(isinstance(p, _StridedShard) for p in x.placements):
        # Rows split over two axes in an order a plain split of the targets does not give
        # (logits (batch, seq) split over 'data' and 'model', flattened): gather those.
        x = x.redistribute(x.device_mesh, [Replicate() if isinstance(p, _StridedShard) else p for p in x.placements])
    target_placements = []
    for p in x.placements:
        if p.is_shard():
            d = p.dim if p.dim < cdim or x.ndim == 1 else p.dim - 1
            target_placements.append(Shard(d))
        else:
            target_placements.append(Replicate())
    target = values["target"]
    if not isinstance(target, DTensor):
        target = _replicated(target, x)
    if tuple(target.placements) != tuple(target_placements):
        target = target.redistribute(x.device_mesh, target_placements)
    weight = values.get("weight")
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    return x, target, weight


def _nll_forward(op, args, kwargs):
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    reduction, ignore_index = values["reduction"], values["ignore_index"]
    # The global count of ignored targets, when the loader has it reduced already.
    ignored = _early.ignored(values["target"]) if (
        reduction == _MEAN and values.get("weight") is None and ignore_index == _early.IGNORE_INDEX) else None
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
    _early.pend(loss, weight_out)
    return loss, weight_out


def _nll_backward(op, args, kwargs):
    names = [a.name for a in op._schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    x, target, weight = _nll_prepare(values)
    reduction, ignore_index = values["reduction"], values["ignore_index"]
    grad = values["grad_output"]
    total_weight = values["total_weight"]
    _early.start(total_weight)
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
        value = _early.reduced(x)  # reduced already, in the backward pass
        if value is not None:
            return op(value)
        value = x.to_local()
        for dim, p in enumerate(x.placements):  # one all-reduce per axis that holds a pending sum
            if p.is_partial() and mesh.size(dim) > 1:
                value = value.clone()
                dist.all_reduce(value, group=mesh.get_group(dim))
        return op(value)
    return op(x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local())


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


def _default(op, args, kwargs):
    """DTensor's own handling of ``op`` (bypassing the handler registered here)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mine = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = mine


def _view(op, args, kwargs):
    """Views of an unevenly split tensor (``logits.view(-1, V)`` on 5 rows over 2
    devices, attention heads folded into an odd batch) have no torch.chunk layout
    DTensor can express: gather the uneven dims first (correct, but it moves the tensor)."""
    x = args[0]
    if not _uneven(x):
        try:
            out = _default(op, args, kwargs)
            _early.carry(x, out)
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
    _early.carry(x, out)
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
        index = _rng.shard_index(list(mesh.get_coordinate()), list(mesh.shape), shard_dims)
        with _rng.local_stream(index, "cpu"):
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
    aten._scaled_dot_product_flash_attention_for_cpu.default: _per_row,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _per_row,
    aten.mean.default: _mean,
    aten.mean.dim: _mean,
}
_HANDLERS.update(dict.fromkeys([
    aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli_.float, aten.uniform_.default,
    aten.normal_.default, aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.randint_like.low_dtype, aten.exponential_.default, aten.log_normal_.default, aten.geometric_.default,
], _random))
_HANDLERS = {op: _below_autograd(h) for op, h in _HANDLERS.items()}
