"""The gradient sums of replicated parameters (``ts.replicate``, the automatic data-parallel
path): DDP's buckets summed, not averaged, over the data-parallel processes.

The global-mean loss already divides by the global batch, so DDP's reducer gets a
communication hook that sums. Where the processes are those of one machine (a gloo group on
its CPUs), the hook sums through shared memory instead of gloo's all-reduce, which moves
every byte through TCP sockets and a worker thread of its own (on a machine whose cores all
compute, that thread takes a core from the program for the whole reduction):

- DDP hands the hook the buckets of one backward pass in order; they are set aside (a
  future each) until it hands over the last one. DDP waits for the futures only when it
  finishes the backward pass, after the last bucket, so nothing waits meanwhile;
- then each process copies all of them into its row of one shared buffer, the group meets
  (a sum of one number through ``shared_sums``: shared memory, no system call to start it),
  each process sums its share of every bucket over the rows in rank order
  (``collectives.sum_in_rank_order``: every process ends with the same bits) into a shared
  result, the group meets again, and each copies the results into its buckets and completes
  their futures.

The buffer holds every process's gradients once plus the result, ``(processes + 1) x`` the
trainable parameters' bytes in ``/dev/shm`` for the whole machine, mapped once. Without the
room there (``shared_memory``: when it is made, or when the buckets outgrow it: from then on),
across machines, off the CPU, or with ``TORCHSPMD_SHARED_GRADIENTS=0``, the buckets are
summed by gloo's (or the group backend's) all-reduce.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torchspmd.engines.native.communication import collectives, cpu_shortcuts, shared_memory, shared_sums

SWITCH = "TORCHSPMD_SHARED_GRADIENTS"  # "0": the group backend's all-reduce


def _aligned(nbytes: int) -> int:
    return -(-nbytes // collectives.ALIGN) * collectives.ALIGN


class SharedMemorySum:
    """The shared-memory hook of one DDP reducer (the module docstring says how it sums)."""

    def __init__(self, group: dist.ProcessGroup, buffer: torch.Tensor, row_bytes: int):
        self.group = group
        self.world, self.rank = group.size(), group.rank()
        self.buffer, self.row_bytes = buffer, row_bytes
        self.pending: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self.met = torch.zeros(1, dtype=torch.int32)

    def hook(self, state, bucket):
        if bucket.index() == 0:
            self.pending = []  # (what a backward pass that raised left)
        fut: torch.futures.Future = torch.futures.Future()
        self.pending.append((bucket.buffer(), fut))
        if bucket.is_last():
            pending, self.pending = self.pending, []
            try:
                self._sum(pending)
            except BaseException as e:
                for _, f in pending:
                    if not f.done():
                        f.set_exception(e)
                raise
        return fut

    def _meet(self) -> None:
        shared_sums.all_reduce(self.met, self.group).wait()

    def _sum(self, pending: list) -> None:
        offsets, end = [], 0
        for buf, _ in pending:
            offsets.append(end)
            end += _aligned(buf.numel() * buf.element_size())
        if end > self.row_bytes:  # (the buckets have the same sizes on every process: all grow here)
            row_bytes = -(-end // 2**20) * 2**20
            buffer, _ = shared_memory.map_for(self.group, (self.world + 1) * row_bytes)
            if buffer is None:  # (alike on every process) no room: the backend sums, from now on
                self.buffer = None
            else:
                self.buffer, self.row_bytes = buffer, row_bytes
        if self.buffer is None:
            for buf, fut in pending:
                dist.all_reduce(buf, group=self.group)
                fut.set_result(buf)
            return
        rows = self.buffer[: self.world * self.row_bytes].view(self.world, self.row_bytes)
        result = self.buffer[self.world * self.row_bytes:]
        for (buf, _), at in zip(pending, offsets):
            rows[self.rank, at:at + buf.numel() * buf.element_size()].view(buf.dtype).copy_(buf.view(-1))
        self._meet()  # every row written
        for (buf, _), at in zip(pending, offsets):
            n = buf.numel()
            share = -(-n // self.world)
            start, stop = min(n, self.rank * share), min(n, (self.rank + 1) * share)
            if start < stop:
                span = slice(at, at + n * buf.element_size())
                collectives.sum_in_rank_order(rows[:, span].view(buf.dtype)[:, start:stop],
                                              result[span].view(buf.dtype)[start:stop])
        self._meet()  # every share summed: the rows may be written again; the next sum writes the result
        # only after its first meeting, which every process reaches after reading this result
        for (buf, fut), at in zip(pending, offsets):
            buf.view(-1).copy_(result[at:at + buf.numel() * buf.element_size()].view(buf.dtype))
            fut.set_result(buf)


def backend_sum(state, bucket):
    """The hook summing a bucket with the group's (``state``) backend."""
    fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def register(ddp, group: dist.ProcessGroup, params: list[torch.Tensor]) -> str:
    """Give ``ddp`` (over ``group``) the hook that sums its buckets; return which:
    ``"shared memory"`` or ``"backend"``. Collective: every process decides alike."""
    if group.size() > 1 and os.environ.get(SWITCH, "1") != "0" and cpu_shortcuts.allowed() and all(p.device.type == "cpu" for p in params) \
            and "gloo" in collectives.backend_of(group, torch.device("cpu")) and shared_memory.same_machine(group):
        row = sum(_aligned(p.numel() * p.element_size()) for p in params)  # (a bucket at most this, all of them)
        row = max(1, -(-row // 2**20)) * 2**20
        buffer, _ = shared_memory.map_for(group, (group.size() + 1) * row)
        if buffer is not None:
            ddp.register_comm_hook(None, SharedMemorySum(group, buffer, row).hook)
            return "shared memory"
    ddp.register_comm_hook(group, backend_sum)
    return "backend"
