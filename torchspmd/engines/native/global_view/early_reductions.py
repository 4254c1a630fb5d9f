"""Global values a step needs, reduced before the step waits for them.

The exact global loss costs a data-parallel step two collectives that DDP's step does not
have: the count of targets a mean loss divides by, and ``loss.item()`` of the loss's
pending sum. Each blocks until every process reaches it; with more processes than cores,
that wait is a large part of the step. Both are started earlier here, asynchronously, at
points every process reaches in the same order, so that the step finds them done:

1. **Ignored targets.** ``MpDeviceLoader`` counts, for each integer tensor of a batch, the
   entries equal to -100 (the ``ignore_index`` of torch's and transformers' losses) in the
   rows this process holds, and starts one asynchronous all-reduce of these counts when
   the program takes the batch. A mean ``nll_loss``/``cross_entropy`` (no class weights,
   ``ignore_index=-100``) whose target is such a tensor, or a view of one, unchanged since,
   divides by the global count of the other entries without a collective of its own.
2. **Pending sums of losses.** A loss computed over sharded rows is a sum pending over the
   processes. When the backward pass reaches the loss, its sum is all-reduced
   asynchronously; ``item()`` of the loss then uses the reduced value.

Both sums go through ``shared_sums`` (shared memory when the processes share one
machine, the group's backend otherwise).

Every decision here depends only on the program (which tensors, which operations, in
which order), never on timing, so every process takes it alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from torchspmd.engines.native.communication import shared_sums
from torchspmd.engines.native.start import global_mode
from torchspmd.errors import SpmdError

IGNORE_INDEX = -100
# integer types that can hold IGNORE_INDEX
COUNTED_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_COUNTED = "_torchspmd_ignored"


class BatchCounts:
    """The ignored entries of one batch's integer tensors: this process's part of each
    count, then (``start``) their sums over all processes."""

    def __init__(self, summed: bool, batch: int = 0):
        self.summed = summed  # False: every process holds the whole tensors
        self.batch = batch  # its number in the loader's order (for messages)
        self.parts: list[int] = []
        # Sizes every process must agree on (the dims of a tensor each process collated
        # from its own rows), reduced with the counts as (size, size squared): the sums
        # say whether they all agree (n * sum of squares == sum squared).
        self.sizes: list[tuple[str, int, int]] = []
        self.totals: torch.Tensor | None = None
        self.values: list[int] = []  # the totals, once verified
        self.work = None
        self.started = False
        self.verified = False
        self.processes = 1

    def count(self, t: torch.Tensor, counts: bool) -> int:
        """Add a tensor (in the loader's thread); ``counts``: whether this process's entries
        are part of the sum (one process per replica group counts a block held by several)."""
        self.parts.append(int((t == IGNORE_INDEX).sum()) if counts else 0)
        return len(self.parts) - 1

    def agree(self, key: str, dim: int, size: int) -> None:
        """Add a size every process must have alike (in the loader's thread)."""
        self.sizes.append((key, dim, size))

    def start(self) -> None:
        """Start the sums (in the program's thread: every process starts them in the same
        order relative to its other collectives)."""
        if self.started:
            return
        self.started = True
        with global_mode.local_region():  # (plain tensors: no call of the global view per operation)
            values = self.parts + [v for _, _, n in self.sizes for v in (n, n * n)]
            self.totals = torch.tensor(values, dtype=torch.int64)
            if self.summed and dist.is_initialized() and dist.get_world_size() > 1:
                if not _host_collectives():
                    # A default group without a CPU backend (NCCL alone, initialised by the
                    # program): the counts are not summed, and the loss reduces its own.
                    self.totals = None
                    return
                self.processes = dist.get_world_size()
                self.work = shared_sums.all_reduce(self.totals)

    def verify(self) -> None:
        """Wait for the sums (started earlier) and raise, alike on every process, if the
        processes' batches had different sizes where they must agree."""
        if not self.started or self.totals is None or self.verified:
            return
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.verified = True
        with global_mode.local_region():
            self.values = self.totals.tolist()  # (read as Python ints from here on)
        at = len(self.parts)
        for i, (key, dim, _) in enumerate(self.sizes):
            total, squares = self.values[at + 2 * i], self.values[at + 2 * i + 1]
            if self.processes * squares != total * total:

                what = f"sizes of dim {dim}"
                raise SpmdError(
                    f"MpDeviceLoader: batch {self.batch}'s tensor {key} has different {what} on different "
                    f"processes (sizes averaging {total / self.processes:g}): each process collated only its own "
                    f"rows of the global batch, so a collate_fn that pads to the longest row, or samples of "
                    f"different lengths, give each process another shape. Make every batch one shape (pad to "
                    f"a fixed length), or collate the whole batch in every process and split it with "
                    f"ts.shard_batch(batch, input_sharding)"
                    if dim else
                    f"MpDeviceLoader: batch {self.batch}'s tensor {key} has different numbers of rows on "
                    f"different processes (minibatch=True: each process yields its own part, and the parts must "
                    f"be of one size); give every process's loader the same batch size and drop a last batch "
                    f"that cannot be split alike (drop_last=True)"
                )

    def total(self, index: int) -> int | None:
        if not self.started or self.totals is None:
            return None
        self.verify()
        return self.values[index]


def _versions(t: DTensor) -> tuple[int, int] | object:
    # A DTensor changed in place bumps its own version (shared with its views), not its
    # local tensor's; a local tensor changed through to_local() bumps only its own.
    if t.is_inference() or t._local_tensor.is_inference():
        # (made under torch.inference_mode(): no version is kept, so it is never taken as
        # unchanged, and what reads it reduces at once)
        return object()
    return t._version, t._local_tensor._version


def _host_collectives() -> bool:
    """Whether the default group reduces CPU tensors (gloo, or torchspmd's
    ``cpu:gloo,cuda:nccl``): the counts stay on the host, so that reading them never waits
    for a device."""
    backend = str(dist.get_backend())
    return backend in ("gloo", "mpi") or "cpu:" in backend


def mark(t: DTensor, counts: BatchCounts, index: int) -> None:
    setattr(t, _COUNTED, (counts, index, _versions(t)))


def carry(src: Any, out: Any) -> None:
    """``out``, a view of ``src`` (same entries), keeps ``src``'s count. (Called below
    autograd, before ``out`` shares ``src``'s version; a copy that does not share it keeps
    the count only while both versions are 0.)"""
    info = getattr(src, _COUNTED, None)
    if info is None or not isinstance(out, DTensor) or _versions(src) != info[2] or out._local_tensor.is_inference():
        return
    setattr(out, _COUNTED, (info[0], info[1], (src._version, out._local_tensor._version)))


def ignored(t: Any) -> int | None:
    """The global number of IGNORE_INDEX entries of ``t`` when known without a blocking
    collective; None otherwise."""
    info = getattr(t, _COUNTED, None)
    if info is None or torch.compiler.is_compiling():
        return None
    counts, index, versions = info
    if _versions(t) != versions:  # changed in place since it was counted
        return None
    return counts.total(index)


# ---------------------------------------------------------------------------
# Pending sums of losses.
# ---------------------------------------------------------------------------

_SUM = "_torchspmd_sum"  # on a loss: its _Sum
_SUMS = "_torchspmd_sums"  # on a tensor the loss's backward receives: the _Sums to start there


class _Sum:
    __slots__ = ("local", "versions", "group", "work", "value")

    def __init__(self, loss: DTensor, group):
        # The value as computed (a scalar): a loss scaled from it keeps meaning this value
        # even if the loss itself is changed in place later.
        self.local, self.versions, self.group = loss._local_tensor.detach().clone(), _versions(loss), group
        self.work = None
        self.value: torch.Tensor | None = None

    def start(self) -> None:
        if self.value is None:
            self.value = self.local
            self.work = shared_sums.all_reduce(self.value, group=self.group)


def _group_of(x: DTensor):
    """The process group over which ``x``'s pending sum is reduced, when it is one."""
    dims = [d for d, p in enumerate(x.placements) if p.is_partial()]
    if len(dims) != 1 or any(p.is_partial() and p.reduce_op != "sum" for p in x.placements):
        return None
    return x.device_mesh.get_group(dims[0])


def pend(loss: DTensor, keeper: DTensor) -> None:
    """Keep a loss's pending sum, to be reduced when the backward pass reaches the loss:
    ``keeper`` is a tensor the loss's backward receives (it carries the sum there). The
    sum is started by that backward only, so what is started follows the program's graph,
    alike on every process."""
    if torch.compiler.is_compiling() or loss.ndim != 0:
        return
    group = _group_of(loss)
    if group is None or dist.get_world_size(group) == 1:
        return
    s = _Sum(loss, group)
    setattr(loss, _SUM, s)
    sums = getattr(keeper, _SUMS, None)
    if sums is None:
        setattr(keeper, _SUMS, [s])
    else:
        sums.append(s)


def start(keeper: Any) -> None:
    """In a loss's backward: start the reductions its forward left with ``keeper``."""
    sums = getattr(keeper, _SUMS, None)
    if sums and not torch.compiler.is_compiling():
        for s in sums:
            s.start()
        sums.clear()


class _Derived:
    """The pending sum of a loss scaled by a number (``loss / accumulation_steps``) or
    detached: the scaled sum of its source's pending sum, so that the source's reduction,
    started by the backward pass, serves ``item()`` of both."""

    __slots__ = ("source", "scale", "divide", "versions")

    def __init__(self, source, scale, divide: bool, out: DTensor):
        self.source, self.scale, self.divide, self.versions = source, scale, divide, _versions(out)


# torch functions whose result is a number times their first argument (a scalar loss)
SCALINGS = {torch.Tensor.__truediv__: True, torch.Tensor.div: True, torch.div: True,
             torch.Tensor.__mul__: False, torch.Tensor.__rmul__: False, torch.Tensor.mul: False, torch.mul: False,
             torch.Tensor.detach: False}


def derive(func, args: tuple, kwargs: dict, out: Any) -> None:
    """After ``func(*args, **kwargs)`` gave ``out``: when it scaled or detached a loss whose
    sum is pending, ``out``'s sum is that one scaled (no reduction of its own)."""
    loss = args[0]
    source = getattr(loss, _SUM, None)
    if source is None or kwargs or not isinstance(out, DTensor) or out.ndim != 0 \
            or tuple(out.placements) != tuple(loss.placements) or torch.compiler.is_compiling():
        return
    if func is torch.Tensor.detach:
        scale = None
    elif len(args) == 2 and type(args[1]) in (int, float) and args[1] != 0 and math.isfinite(args[1]):
        scale = args[1]  # (a zero or non-finite scale: the sum of scaled parts may differ, e.g. inf * 0)
    else:
        return
    if _versions(loss) != source.versions:
        return
    setattr(out, _SUM, _Derived(source, scale, SCALINGS[func], out))


def _source_value(s) -> torch.Tensor | None:
    if isinstance(s, _Derived):
        value = _source_value(s.source)
        if value is None or s.scale is None:
            return value
        return value / s.scale if s.divide else value * s.scale
    if s.value is None:
        return None
    if s.work is not None:
        s.work.wait()
        s.work = None
    return s.value


def reduced_item(x: DTensor) -> float | int | bool | None:
    """``x.item()`` when ``x`` is a loss whose sum was started (``reduced``) and whose layout
    is a plain pending sum or replicated; None otherwise."""
    if getattr(x, _SUM, None) is None or x.ndim != 0 or not all(
            p.is_replicate() or (type(p) is Partial and p.reduce_op == "sum") for p in x.placements):
        return None
    value = reduced(x)
    if value is None:
        return None
    with global_mode.local_region():
        return value.item()


def reduced(loss: DTensor) -> torch.Tensor | None:
    """The loss's sum over the processes when its reduction was started (and the loss is
    unchanged since it was computed); None otherwise: ``item()`` reduces it at once."""
    s = getattr(loss, _SUM, None)
    if s is None or _versions(loss) != s.versions:
        return None
    return _source_value(s)
