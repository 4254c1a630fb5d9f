"""Collectives tuned per backend, plugged into FSDP2 (``set_custom_all_gather`` /
``set_custom_reduce_scatter``).

gloo moves every byte through TCP sockets, even between processes of one machine; that
is where FSDP on CPUs loses its time (``bench/collectives.py`` measures it). FSDPv2's
variants (what each computes exactly: ``docs/cpu_speed.md``, measured by
``tests/test_collectives.py``):

- ``"shm"`` (processes of one machine): the collectives go through shared memory. Where
  torch lets a storage point at memory it does not own (``UntypedStorage._swap_data_ptr_``),
  FSDP2's all-gather can be taken over (``torchspmd.patches.fsdp.SHARED_PARAMS``, checked for
  this torch's version and signatures) and the unit's parameters are split on dim 0 and gathered as one
  tensor each, the gathered parameters themselves live in shared memory, once for all the
  processes (:class:`SharedParamsAllGather`): each process copies its shards straight from
  its sharded parameters into their places in a shared region laid out parameter by
  parameter (FSDP2's all-gather is taken over: no all-gather input buffer in between), one
  barrier, and every parameter's storage points at its place there until FSDP2 frees it; no
  process copies the whole parameters out. Otherwise the all-gather output buffer FSDP2 asks for *is* one
  shared buffer: once every process is done with the previous parameters (a barrier when
  FSDP2 asks for the buffer), FSDP2 copies each process's shard into its slot, a second
  barrier, and every process copies the whole parameters out of it. The reduce-scatter
  input FSDP2 asks for is this process's row of one shared buffer: FSDP2 copies the
  gradients in (once every process is done summing the previous rows: a barrier of the group
  since then, usually the next unit's gathering, else one of its own), a barrier, and each
  process sums its own column of the rows, in
  rank order and in float32 (so every shard is the same fixed-order sum whoever arrives
  first; gloo's own sums in ring order and differs by rounding). No bytes go through a
  socket; the barriers are gloo's. The shared memory is the size of the largest unit's
  gathered parameters (without shared parameters: the buffer FSDP2 gathers into) plus the largest unit's
  gradients times the process count (what the processes' own reduce-scatter input buffers
  took), plus 16 MB for direct calls (a buffer grown out of is unmapped once nothing views
  it), plus, with the parameters shared, the regions they are gathered into: what FSDP2
  holds gathered at once (the root unit, the current unit and the next) and what was freed
  since the last gather, once for all processes, where each process held its own copy
  before.
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
import warnings
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from torchspmd import accelerators
from torchspmd.engines.native.communication import cpu_shortcuts, shared_memory
from torchspmd.errors import SpmdError
from torchspmd.patches import fsdp as fsdp_patches

__all__ = ["AllReduceAllGather", "AllReduceReduceScatter", "SharedMemoryAllGather", "SharedMemoryReduceScatter",
           "SharedParamsAllGather",
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
        self.summed_at = -1  # the group's barrier count when this process last summed out of it

    def _grow(self, nbytes: int) -> None:
        base, self.path = map_shared(self.group, self.parts * nbytes)
        self.halves = [base[i * nbytes:(i + 1) * nbytes] for i in range(self.parts)]
        self.capacity = nbytes

    def next(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the next part."""
        if nbytes > self.capacity:
            self._grow(-(-nbytes // 2**20) * 2**20)
        part = self.halves[self.turn]
        self.turn = (self.turn + 1) % self.parts
        return part[:nbytes]


_ARENAS: dict[tuple, _Arena] = {}  # (group name, kind) -> its arena


def _arena(group: dist.ProcessGroup, kind: str) -> _Arena:
    key = (shared_memory.group_key(group), kind)
    if key not in _ARENAS:
        _ARENAS[key] = _Arena(group, 2 if kind == "reduce_scatter" else 1)
    return _ARENAS[key]


def _nbytes(size: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for s in size:
        numel *= int(s)
    return numel * torch.empty((), dtype=dtype).element_size()


def _into_own_slot(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """This process's all-gather input into its slot of the output (FSDP2 has usually put it there)."""
    world, rank = group.size(), group.rank()
    mine = output_tensor.view(world, -1)[rank]
    if input_tensor.data_ptr() != mine.data_ptr():
        mine.copy_(input_tensor.reshape(-1))


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
        arena = _arena(self.group, "all_gather")
        dist.barrier(group=self.group)  # nobody still copies out of the buffer
        return arena.next(_nbytes(size, dtype)).view(dtype).view(*size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        _into_own_slot(output_tensor, input_tensor, group)
        dist.barrier(group=group)  # every slot written
        return _Done() if async_op else None


class SharedMemoryReduceScatter(ReduceScatter):
    """Reduce-scatter through shared memory, adding the processes' pieces in rank order
    (:func:`sum_in_rank_order`).

    Under FSDP2 the input buffer FSDP2 asks for (``allocate``, before it copies the
    gradients in) *is* this process's row of one shared buffer, ``[world, numel]``: FSDP2
    writes its gradients into the row, a barrier at the call, and each process sums its
    column of the rows. Before a row is written again every process must be done summing
    the previous reduce-scatter's rows: a barrier of this group passed since the last sum
    says so (every process passed it after its own sum: the processes pass this group's
    barriers in one order), and between two reduce-scatters there usually is one (the
    gathering of the next unit's parameters); otherwise ``allocate`` waits at a barrier
    itself. So one barrier per reduce-scatter, two at most, and no copy beyond FSDP2's own.
    The buffer holds every process's input once, the bytes each process's private input
    buffer used to take. FSDP2 asks for the input and then the output (a plain tensor)
    before the call; an input that does not come from ``allocate`` (a direct call) goes
    through a small shared buffer in steps instead (two halves of ``RS_STEP_BYTES`` used in
    turn: each process writes its piece for every destination, a barrier, each sums its
    column)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.shared = _shared(group)  # counts this group's barriers
        self._pending: torch.Tensor | None = None  # the shared [world, numel] buffer of the input handed out
        self._rows_arena: _Arena | None = None  # the arena it came from

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._pending is not None or device.type != "cpu":  # the output: this process's own memory
            return torch.empty(*size, dtype=dtype, device=device)
        numel = 1
        for s in size:
            numel *= int(s)
        world, rank = self.group.size(), self.group.rank()
        nbytes = _nbytes(size, dtype)
        arena = _arena(self.group, "reduce_scatter_input")
        if self.shared.epoch <= arena.summed_at:
            self.shared.barrier()  # nobody still sums the previous input
        rows = arena.next(world * nbytes).view(dtype).view(world, numel)
        self._pending, self._rows_arena = rows, arena
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
            self.shared.barrier()  # every row written
            sum_in_rank_order(rows.view(world, world, per)[:, rank], output_tensor.view(-1))
            self._rows_arena.summed_at = self.shared.epoch
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
            sum_in_rank_order(buf[:, rank], out[start:start + m])
        return _Done() if async_op else None


# -- the gathered parameters themselves in shared memory ------------------------------------
#: ``TORCHSPMD_SHARED_PARAMS=0`` makes the shared-memory all-gather copy the gathered
#: parameters into each process's own memory, as FSDP2 does (for measuring what sharing saves).
SHARED_PARAMS_SWITCH = "TORCHSPMD_SHARED_PARAMS"


def can_point_storages() -> bool:
    """This torch can make a parameter's storage point at memory it does not own and back
    (``UntypedStorage._swap_data_ptr_``), and FSDP2's all-gather and copy-out can be taken
    over (``torchspmd.patches.fsdp.SHARED_PARAMS``: its versions, names and signatures)."""
    return fsdp_patches.available()


def _shares_params(module) -> bool:
    """Whether ``module``'s FSDP2 unit can gather its parameters into shared memory: every
    parameter split on dim 0, gathered as one tensor (no ``fsdp_pre_all_gather`` extension),
    not offloaded, on the CPU."""
    if os.environ.get(SHARED_PARAMS_SWITCH, "1") == "0":
        return False
    groups = module._get_fsdp_state()._fsdp_param_groups
    return bool(groups) and all(
        g.device.type == "cpu" and not fp.offload_to_cpu and fp.fsdp_placement.dim == 0
        and not hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")
        for g in groups for fp in g.fsdp_params) and _take_over() \
        and (not fsdp_patches.output_hook_per_unit() or all(fsdp_patches.can_set_output_function(g) for g in groups))


def map_shared(group: dist.ProcessGroup, size: int) -> tuple[torch.Tensor, str]:
    """A new ``size``-byte buffer every process of ``group`` maps (``shared_memory.map_for``);
    without the room, the same ``SpmdError`` on every process, with the fixes."""
    base, path = shared_memory.map_for(group, size)
    if base is None:
        raise SpmdError(
            f"FSDPv2's shared-memory collectives (collectives='shm', or 'auto' on one machine): {path}; give "
            "/dev/shm more room (docker run --shm-size=...) or use FSDPv2(collectives='allreduce')"
        )
    return base, path


class _Region:
    """Bytes ``[start, start + nbytes)`` of slab ``slab``, holding one gather's parameters."""

    __slots__ = ("slab", "start", "nbytes", "holders", "freed_at")

    def __init__(self, slab: int, start: int, nbytes: int):
        self.slab, self.start, self.nbytes = slab, start, nbytes
        self.holders = 0  # parameters whose storage points into it
        self.freed_at = -1  # the barrier count when the last of them was freed

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.start + self.nbytes


class _SharedParams:
    """The shared memory a process group's gathered parameters live in, once for all its
    processes: slabs (mapped buffers, kept for the life of the process: parameter storages
    point into them without owning them) carved into regions, one per gathered unit.

    Every process makes the same decisions in the same order (FSDP2 gathers and frees in one
    order everywhere), so regions, slabs and barriers agree without talking. A region whose
    parameters were freed is written again only once every process has freed them, that is
    once a barrier of this group has passed since the free (``epoch`` counts them: the
    gathers' and the shared-memory reduce-scatters' of this group)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.slabs: list[torch.Tensor] = []
        self.regions: list[_Region] = []  # holding parameters, or freed and not yet written over
        self.epoch = 0  # barriers this group passed here

    def barrier(self) -> None:
        dist.barrier(group=self.group)
        self.epoch += 1

    def place(self, nbytes: int) -> _Region:
        """A region of ``nbytes`` no process still reads: the first gap between the regions
        holding parameters that was freed before the last barrier of this group, or a new
        slab. (Every gather ends with a barrier, so what a gather frees is free for the
        gather after next: a few units' worth of slabs, machine-wide, and one barrier per
        gather.)"""
        for s, slab in enumerate(self.slabs):
            held = sorted((r.start, r.start + r.nbytes) for r in self.regions if r.slab == s and r.holders)
            pos = 0
            for a, b in held + [(slab.numel(), slab.numel())]:
                if a - pos >= nbytes and all(r.freed_at < self.epoch for r in self.regions
                                             if r.slab == s and not r.holders and r.overlaps(pos, pos + nbytes)):
                    return self._take(s, pos, nbytes)
                pos = max(pos, b)
        slab, _ = map_shared(self.group, -(-nbytes // 2**20) * 2**20)
        self.epoch += 1  # map_shared ends with a barrier
        self.slabs.append(slab)
        return self._take(len(self.slabs) - 1, 0, nbytes)

    def _take(self, slab: int, start: int, nbytes: int) -> _Region:
        region = _Region(slab, start, nbytes)
        self.regions = [r for r in self.regions if r.holders or r.slab != slab
                        or not r.overlaps(start, start + nbytes)]
        self.regions.append(region)
        return region


_SHARED: dict = {}  # group name -> its shared parameters' slabs


def _shared(group: dist.ProcessGroup) -> _SharedParams:
    key = shared_memory.group_key(group)
    if key not in _SHARED:
        _SHARED[key] = _SharedParams(group)
    return _SHARED[key]


#: id of a gather's output not yet copied out -> (the output, its collective, its region).
#: Keyed by the tensor itself (held here, so its id is not reused), not by its address.
_PENDING: dict[int, tuple[torch.Tensor, "SharedParamsAllGather", _Region]] = {}
ALIGN = 64  # bytes: where each piece of a shared buffer starts


class SharedParamsAllGather(AllGather):
    """All-gather whose result is the unit's parameters in shared memory, once for all the
    processes of this machine, instead of a copy in every process.

    FSDP2's all-gather of these units is taken over (:meth:`gather`): each process copies its
    shards, straight from its sharded parameters, into a region of :class:`_SharedParams`
    laid out parameter by parameter (parameter ``p``'s gathered tensor is ``[world, shard
    of p]`` there, as FSDP2 lays it out in its own memory). At FSDP2's copy-out (taken over
    too, :meth:`copy_out`) it waits at one barrier (every shard written) and points each
    parameter's storage at its place in the region. When FSDP2 frees the gathered
    parameters, the storages are pointed back at empty memory. Processes read the
    parameters from the same pages; nothing is copied out, and FSDP2's all-gather input
    buffer (a copy of the shards) is not used."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.shared = _shared(group)

    def gather(self, fsdp_params, group: dist.ProcessGroup):
        """FSDP2's ``foreach_all_gather`` for this unit (taken over, :func:`_take_over`): this
        process's shards straight into their places in a new region (no copy into an
        all-gather input buffer first); the barrier and the parameters' storages come at the
        copy-out. Returns FSDP2's ``AllGatherResult``, whose output is the region's bytes."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            AllGatherResult,
            _get_param_all_gather_inputs,
        )

        world, rank = group.size(), group.rank()
        inputs = _get_param_all_gather_inputs(fsdp_params)
        if any(len(ts) != 1 for ts in inputs):
            raise SpmdError("FSDPv2(collectives='shm'): a parameter is gathered as several tensors "
                            "(fsdp_pre_all_gather); use collectives='allreduce'")
        shards = [ts[0] for ts in inputs]
        sizes = [t.numel() * t.element_size() for t in shards]  # bytes per shard
        starts, total = [], 0
        for b in sizes:
            starts.append(total)
            total += -(-world * b // ALIGN) * ALIGN
        for key, (_, gather, region) in list(_PENDING.items()):
            if gather is self:  # gathered before and never copied out (a step given up midway): release it
                del _PENDING[key]
                _unreserve(region, self.shared)
        shared = self.shared
        region = shared.place(total)
        region.holders += 1  # reserved until the copy-out
        slab = shared.slabs[region.slab]
        for t, b, start in zip(shards, sizes, starts):
            block = slab[region.start + start:region.start + start + world * b]
            block.view(world, b)[rank].view(t.dtype).copy_(t.reshape(-1))
        out = slab[region.start:region.start + total]
        _PENDING[id(out)] = (out, self, region)
        return AllGatherResult(out, None, None, [[t.dtype] for t in shards], [[t.numel()] for t in shards],
                               [t.numel() for t in shards])

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise SpmdError("SharedParamsAllGather gathers through FSDP2's foreach_all_gather, taken over")

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        raise SpmdError("SharedParamsAllGather gathers through FSDP2's foreach_all_gather, taken over")

    def copy_out(self, result, fsdp_params, group: dist.ProcessGroup, region: _Region) -> None:
        """Once every process's shards are in ``region`` (a barrier), point each parameter's
        storage at its place there."""
        world = group.size()
        shared = self.shared
        shared.barrier()  # every process's shards are in place
        base = shared.slabs[region.slab].data_ptr() + region.start
        start = 0
        for fsdp_param, numels, dtypes in zip(fsdp_params, result.param_all_gather_input_numels,
                                              result.param_all_gather_input_dtypes):
            nbytes = world * numels[0] * dtypes[0].itemsize
            _release(fsdp_param)
            fsdp_param.init_all_gather_outputs(numels, dtypes, world, result.all_gather_output.device)
            storage = fsdp_param.all_gather_outputs[0].untyped_storage()
            storage.resize_(0)
            storage._swap_data_ptr_(torch._C._construct_storage_from_data_pointer(
                base + start, result.all_gather_output.device, nbytes))
            _hold(fsdp_param, region, shared)
            start += -(-nbytes // ALIGN) * ALIGN
        _unreserve(region, shared)


def _hold(fsdp_param, region: _Region, shared: _SharedParams) -> None:
    """``fsdp_param``'s storage points into ``region`` until FSDP2 frees it."""
    region.holders += 1
    fsdp_param._torchspmd_region = (region, shared)
    fsdp_patches.before_free(fsdp_param, _release)


def _release(fsdp_param) -> None:
    """Point ``fsdp_param``'s storage back at empty memory of its own, if it points into a region."""
    held = getattr(fsdp_param, "_torchspmd_region", None)
    if held is None:
        return
    region, shared = held
    fsdp_param.all_gather_outputs[0].untyped_storage()._swap_data_ptr_(torch.UntypedStorage(0))
    fsdp_param._torchspmd_region = None
    _unreserve(region, shared)


def _unreserve(region: _Region, shared: _SharedParams) -> None:
    region.holders -= 1
    if not region.holders:
        region.freed_at = shared.epoch


def _gather(original, *args, **kwargs):
    """FSDP2's ``foreach_all_gather(fsdp_params, group, async_op, copy_in_stream, stream,
    device, all_gather_comm)`` (its signature checked when the patch is applied)."""
    names = ("fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream", "device",
             "all_gather_comm")
    call = dict(zip(names, args), **kwargs)
    comm = call.get("all_gather_comm")
    if isinstance(comm, SharedParamsAllGather):
        return comm.gather(call["fsdp_params"], call["group"])
    return original(*args, **kwargs)


def _pending(all_gather_result):
    """The shared-memory gather ``all_gather_result`` came from, taken off the pending list
    (None: FSDP2's own gather)."""
    out = all_gather_result.all_gather_output
    pending = _PENDING.get(id(out))
    if pending is None or pending[0] is not out:
        return None
    del _PENDING[id(out)]
    return pending


def _copy_out(original, all_gather_result, fsdp_params, *args, **kwargs):
    """FSDP2's module-level ``foreach_all_gather_copy_out`` (torch 2.13-2.14)."""
    pending = _pending(all_gather_result)
    if pending is None:
        return original(all_gather_result, fsdp_params, *args, **kwargs)
    pending[1].copy_out(all_gather_result, fsdp_params, pending[1].group, pending[2])


def _output(original, fsdp_params, all_gather_result, *args, **kwargs):
    """A unit's own all-gather output function (torch 2.15's ``_all_gather_output_fn``)."""
    pending = _pending(all_gather_result)
    if pending is None:
        return original(fsdp_params, all_gather_result, *args, **kwargs)
    pending[1].copy_out(all_gather_result, fsdp_params, pending[1].group, pending[2])


def _take_over() -> bool:
    """FSDP2's all-gather and copy-out, for the units gathered by
    :class:`SharedParamsAllGather`: theirs is theirs, every other unit's go to FSDP2's own
    (``torchspmd.patches.fsdp.SHARED_PARAMS``). False: the patch cannot apply on this torch
    (one warning says why) and the units gather as FSDP2 does."""
    return fsdp_patches.route_all_gathers(_gather, _copy_out)


def sum_in_rank_order(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out = ((rows[0] + rows[1]) + rows[2]) + ...``, accumulated in float32 (or the
    rows' dtype when wider) and rounded to ``out``'s dtype once, at the end: one fixed
    order, whatever the number of rows. The first two rows are added straight into ``out``,
    not copied there first. (``torch.sum`` over the rows adds in this order only up to 4
    rows on CPU: its vectorized kernel regroups more.)"""
    n = rows.shape[0]
    if out.is_floating_point() and torch.finfo(out.dtype).bits < 32:
        acc = rows[0].to(torch.float32)
        for r in range(1, n):
            acc.add_(rows[r])
        out.copy_(acc)
    elif n == 1:
        out.copy_(rows[0])
    else:
        torch.add(rows[0], rows[1], out=out)
        for r in range(2, n):
            out.add_(rows[r])


def backend_of(group: dist.ProcessGroup, device: torch.device) -> str:
    try:
        if device.type == accelerators.CPU:
            return str(dist.get_backend(group))
        return accelerators.pg_backend(device.type)  # (the device's own, as the group's spec names it)
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
    gloo_cpu = "gloo" in backend_of(pg, device) and device.type == "cpu"
    if collectives == "auto" and not (gloo_cpu and cpu_shortcuts.allowed()):
        return "native"
    on_one_machine = shared_memory.same_machine(pg)
    if collectives == "shm" and not (gloo_cpu and on_one_machine and one_group):
        raise SpmdError(
            "FSDPv2(collectives='shm'): shared-memory collectives need CPU tensors, a gloo group whose processes "
            "are all on this machine, and reshard_after_forward True or False; use collectives='auto'"
        )
    if not (on_one_machine and one_group):
        return "allreduce"
    if collectives == "auto":
        # Room in /dev/shm for this unit, reserved for a moment (collective: every process
        # learns the same answer): without it, the backend's collectives, exact as well.
        need = _room_needed(groups, pg.size())
        room, why = shared_memory.map_for(pg, need)
        if room is None:
            warnings.warn(f"FSDPv2(collectives='auto'): {why}; this unit's collectives take the all-reduce form "
                          f"through the backend instead of shared memory (slower on one machine: give /dev/shm "
                          f"more room, docker run --shm-size=...)", SharedMemoryUnavailableWarning, stacklevel=2)
            return "allreduce"
        del room
    return "shm"


class SharedMemoryUnavailableWarning(UserWarning):
    """FSDPv2's ``'auto'`` collectives found no room in ``/dev/shm`` for a unit and took the
    backend's instead."""


def _room_needed(groups, world: int) -> int:
    """The shared bytes a unit is likely to need at once: its gathered parameters three
    times (FSDP2 holds the root, the current unit and the next gathered), its gradients'
    rows from every process, and the direct calls' buffer."""
    try:  # (a DTensor's numel is its global one)
        unit = sum(fp.sharded_param.numel() * fp.sharded_param.element_size() for g in groups for fp in g.fsdp_params)
    except AttributeError:  # (another FSDP2: the direct calls' buffer at least)
        unit = 0
    return 3 * unit + world * unit + 16 * 2**20


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
            gather = SharedParamsAllGather(pg) if _shares_params(module) else SharedMemoryAllGather(pg)
            module.set_custom_all_gather(gather)
            if isinstance(gather, SharedParamsAllGather) and fsdp_patches.output_hook_per_unit():
                for g in groups:
                    fsdp_patches.set_output_function(g, _output)
            module.set_custom_reduce_scatter(SharedMemoryReduceScatter(pg))
    return variant

