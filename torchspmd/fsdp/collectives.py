"""Collectives tuned per backend, plugged into FSDP2 (``set_custom_all_gather`` /
``set_custom_reduce_scatter``).

gloo moves every byte through TCP sockets, even between processes of one machine; that
is where FSDP on CPUs loses its time (``bench/collectives.py`` measures it). FSDPv2's
variants (what each computes exactly: ``docs/performance.md``, measured by
``tests/test_collectives.py``):

- ``"shm"`` (processes of one machine): the collectives go through shared memory. The
  all-gather output buffer FSDP2 asks for *is* one shared buffer: once every process is
  done with the previous parameters (a barrier when FSDP2 asks for the buffer), FSDP2
  copies each process's shard into its slot, a second barrier, and every process reads
  the whole parameters from it. The reduce-scatter input FSDP2 asks for is likewise this
  process's row of one shared buffer: a barrier when FSDP2 asks for it, FSDP2 copies the
  gradients in, a second barrier, and each process sums its own column of the rows, in
  rank order and in float32 (so every shard is the same fixed-order sum whoever arrives
  first; gloo's own sums in ring order and differs by rounding). No bytes go through a
  socket; the barriers are gloo's. The shared memory is the size of the largest unit's
  gathered parameters plus the largest unit's gradients times the process count (what the
  processes' own reduce-scatter input buffers took), plus 16 MB for direct calls (a buffer
  grown out of is unmapped once nothing views it).
- ``"allreduce"``: all-gather as an all-reduce of the output holding this process's
  shard and zeros (the exact values), reduce-scatter as an in-place all-reduce keeping
  this process's slot. gloo's all-reduce beats its reduce-scatter of the same bytes
  (1.4-2x here) but not always its all-gather (0.8-1.4x), so ``"auto"`` uses only the
  reduce-scatter form for gloo groups spanning machines.
- ``"native"``: FSDP2's own (kept on NCCL, which is near the hardware limit).

``collectives=`` on ``FSDPv2``: ``"auto"`` (default: ``"shm"`` when the group is gloo on
CPU within one machine, the all-reduce reduce-scatter for gloo across machines (not
measurable here: this machine has no second one), ``"native"`` otherwise), or one of the
variants by name.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from torchspmd._errors import SpmdError

__all__ = ["AllReduceAllGather", "AllReduceReduceScatter", "SharedMemoryAllGather", "SharedMemoryReduceScatter",
           "choose", "CHOICES"]

CHOICES = ("auto", "native", "allreduce", "shm")


class _Alloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AllReduceAllGather(_Alloc, AllGather):
    """All-gather as an all-reduce of the output holding this process's shard and zeros."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = group.size(), group.rank()
        slots = output_tensor.view(world, -1)
        mine = slots[rank]
        if input_tensor.data_ptr() != mine.data_ptr():  # FSDP2 copies the input into its slot already
            mine.copy_(input_tensor.reshape(-1))
        if rank > 0:
            slots[:rank].zero_()
        if rank < world - 1:
            slots[rank + 1:].zero_()
        return dist.all_reduce(output_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class _Done:
    """A finished ``Work`` for a collective that completed before returning."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class AllReduceReduceScatter(_Alloc, ReduceScatter):
    """Reduce-scatter as an in-place all-reduce of the input, keeping this process's slot."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        world, rank = group.size(), group.rank()
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(world, -1)[rank].view_as(output_tensor))
        return _Done() if async_op else None


# -- shared memory ------------------------------------------------------------------------
class _Arena:
    """A shared-memory buffer for one process group, in ``parts`` used in turn. Growing it
    is collective: every process asks for the same sizes in the same order (FSDP2's
    collectives are issued in one order everywhere).

    The memory is a file in ``/dev/shm`` that every process maps (``torch.from_file``), and
    that the first process deletes as soon as all have mapped it: nothing is left behind, no
    resource tracker is involved, and a buffer the arena grew out of is unmapped once no
    tensor views it any more."""

    def __init__(self, group: dist.ProcessGroup, parts: int):
        self.group = group
        self.parts = parts
        self.halves: list[torch.Tensor] = []
        self.capacity = 0
        self.turn = 0
        self.path = ""  # the (deleted) file of the current buffer

    def _grow(self, nbytes: int) -> None:
        size = self.parts * nbytes
        rank = self.group.rank()
        made = [None, None]  # the file's path, or why it could not be made
        if rank == 0:
            made = _shared_file(size)
        try:
            dist.broadcast_object_list(made, src=dist.get_global_rank(self.group, 0), group=self.group)
            if made[1] is not None:
                raise SpmdError(
                    f"FSDPv2(collectives='shm'): {made[1]}; give it more room (docker run --shm-size=...) "
                    "or use FSDPv2(collectives='allreduce')"
                )
            base = torch.from_file(made[0], shared=True, size=size, dtype=torch.uint8)
            dist.barrier(group=self.group)  # every process has mapped it
        finally:
            if rank == 0 and made[0] is not None:
                os.unlink(made[0])  # the mappings live on; nothing is left in /dev/shm
        self.halves = [base[i * nbytes:(i + 1) * nbytes] for i in range(self.parts)]
        self.capacity = nbytes
        self.path = made[0]

    def next(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the next part."""
        if nbytes > self.capacity:
            self._grow(-(-nbytes // 2**20) * 2**20)
        part = self.halves[self.turn]
        self.turn = (self.turn + 1) % self.parts
        return part[:nbytes]


def _shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _shared_file(size: int) -> list:
    """``[path, None]`` of a new file of ``size`` bytes in :func:`_shared_dir`, its space
    reserved (so that a full ``/dev/shm`` fails here, not with a SIGBUS at first touch), or
    ``[None, reason]``."""
    path, where = None, _shared_dir()
    try:
        fd, path = tempfile.mkstemp(prefix="torchspmd-", dir=where)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return [path, None]
    except OSError as e:
        if path is not None:
            os.unlink(path)
        return [None, f"cannot make a {size}-byte shared-memory buffer in {where} ({e})"]


_ARENAS: dict[tuple[int, str], _Arena] = {}


def _arena(group: dist.ProcessGroup, kind: str) -> _Arena:
    key = (id(group), kind)
    if key not in _ARENAS:
        _ARENAS[key] = _Arena(group, 2 if kind == "reduce_scatter" else 1)
    return _ARENAS[key]


#: Bytes of one step of the shared-memory reduce-scatter (all processes' pieces together).
RS_STEP_BYTES = 8 * 2**20


class SharedMemoryAllGather(AllGather):
    """All-gather through one shared output buffer (processes of one machine): FSDP2 asks
    for the output buffer (a barrier there: every process is done reading the previous
    parameters from it), copies its shard into its slot, and after a second barrier every
    process reads the whole parameters."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for s in size:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        arena = _arena(self.group, "all_gather")
        dist.barrier(group=self.group)  # nobody still copies out of the buffer
        return arena.next(nbytes).view(dtype).view(*size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = group.size(), group.rank()
        mine = output_tensor.view(world, -1)[rank]
        if input_tensor.data_ptr() != mine.data_ptr():
            mine.copy_(input_tensor.reshape(-1))
        dist.barrier(group=group)  # every slot written
        return _Done() if async_op else None


class SharedMemoryReduceScatter(ReduceScatter):
    """Reduce-scatter through shared memory, adding the processes' pieces in rank order
    (:func:`_sum_in_rank_order`).

    Under FSDP2 the input buffer FSDP2 asks for (``allocate``, before it copies the
    gradients in) *is* this process's row of one shared buffer, ``[world, numel]``: a
    barrier there (every process is done summing the previous reduce-scatter's input),
    FSDP2 writes its gradients into the row, a second barrier at the call, and each process
    sums its column of the rows. Two barriers and no copy beyond FSDP2's own. The buffer
    holds every process's input once, the bytes each process's private input buffer used
    to take. FSDP2 asks for the input and then the output (a plain tensor) before the
    call; an input that does not come from ``allocate`` (a direct call) goes through a
    small shared buffer in steps instead (two halves of ``RS_STEP_BYTES`` used in turn:
    each process writes its piece for every destination, a barrier, each sums its
    column)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._pending: torch.Tensor | None = None  # the shared [world, numel] buffer of the input handed out

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._pending is not None or device.type != "cpu":  # the output: this process's own memory
            return torch.empty(*size, dtype=dtype, device=device)
        numel = 1
        for s in size:
            numel *= int(s)
        world, rank = self.group.size(), self.group.rank()
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        arena = _arena(self.group, "reduce_scatter_input")
        dist.barrier(group=self.group)  # nobody still sums the previous input
        rows = arena.next(world * nbytes).view(dtype).view(world, numel)
        self._pending = rows
        return rows[rank].view(*size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, "sum"):
            raise SpmdError(f"shared-memory reduce-scatter: only sums are supported, got {op}")
        world, rank = group.size(), group.rank()
        per = input_tensor.numel() // world
        rows, self._pending = self._pending, None
        if (rows is not None and input_tensor.data_ptr() == rows[rank].data_ptr()
                and input_tensor.numel() == rows.shape[1] and input_tensor.dtype == rows.dtype):
            dist.barrier(group=group)  # every row written
            _sum_in_rank_order(rows.view(world, world, per)[:, rank], output_tensor.view(-1))
            return _Done() if async_op else None
        src = input_tensor.view(world, per)  # src[d]: this process's part for destination d
        out = output_tensor.view(-1)
        size = input_tensor.element_size()
        step = max(1, RS_STEP_BYTES // (world * world * size))
        arena = _arena(group, "reduce_scatter")
        for start in range(0, per, step):
            m = min(step, per - start)
            buf = arena.next(world * world * m * size).view(input_tensor.dtype).view(world, world, m)
            buf[rank].copy_(src[:, start:start + m])
            dist.barrier(group=group)  # every row written
            _sum_in_rank_order(buf[:, rank], out[start:start + m])
        return _Done() if async_op else None


def _sum_in_rank_order(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out = ((rows[0] + rows[1]) + rows[2]) + ...``, accumulated in float32 (or the
    rows' dtype when wider) and rounded to ``out``'s dtype once, at the end: one fixed
    order, whatever the number of rows. (``torch.sum`` over the rows adds in this order only
    up to 4 rows on CPU: its vectorized kernel regroups more.)"""
    narrow = out.is_floating_point() and torch.finfo(out.dtype).bits < 32
    acc = rows[0].to(torch.float32) if narrow else out.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        acc.add_(rows[r])
    if narrow:
        out.copy_(acc)


def _same_machine(group: dist.ProcessGroup) -> bool:
    names: list = [None] * group.size()
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return len(set(names)) == 1


def _backend_of(group: dist.ProcessGroup, device: torch.device) -> str:
    try:
        return str(dist.get_backend(group)) if device.type != "cuda" else "nccl"
    except Exception:
        return "unknown"


def choose(collectives: str, module, one_group: bool = True) -> str:
    """The variant ``module``'s FSDP2 unit uses. ``one_group``: the unit gathers over one
    process group (not ``reshard_after_forward=<int>``, which gathers over a second one)."""
    if collectives not in CHOICES:
        raise SpmdError(f"FSDPv2(collectives={collectives!r}): choose one of {', '.join(CHOICES)}")
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or []
    if not groups or collectives in ("native", "allreduce"):
        return "native" if not groups else collectives
    pg = groups[0].mesh_info.shard_process_group
    device = groups[0].device
    gloo_cpu = "gloo" in _backend_of(pg, device) and device.type == "cpu"
    if collectives == "auto" and not gloo_cpu:
        return "native"
    key = id(pg)
    if key not in _SAME_MACHINE:
        _SAME_MACHINE[key] = _same_machine(pg)
    if collectives == "shm" and not (gloo_cpu and _SAME_MACHINE[key] and one_group):
        raise SpmdError(
            "FSDPv2(collectives='shm'): shared-memory collectives need CPU tensors, a gloo group whose processes "
            "are all on this machine, and reshard_after_forward True or False; use collectives='auto'"
        )
    return "shm" if _SAME_MACHINE[key] and one_group else "allreduce"


_SAME_MACHINE: dict[int, bool] = {}


def install(module, collectives: str, one_group: bool = True) -> str:
    """Give ``module`` (an FSDP2 unit) the chosen collectives; return the choice."""
    variant = choose(collectives, module, one_group)
    if variant == "allreduce":
        # Measured on one machine (bench/collectives.py): the all-reduce reduce-scatter is
        # 1.4-2x gloo's at every size, the all-reduce all-gather anywhere from 0.8x to 1.4x;
        # "auto" takes only the former.
        if collectives != "auto":
            module.set_custom_all_gather(AllReduceAllGather())
        module.set_custom_reduce_scatter(AllReduceReduceScatter())
    elif variant == "shm":
        groups = module._get_fsdp_state()._fsdp_param_groups
        if groups:
            pg = groups[0].mesh_info.shard_process_group
            module.set_custom_all_gather(SharedMemoryAllGather(pg))
            module.set_custom_reduce_scatter(SharedMemoryReduceScatter(pg))
    return variant
