"""Sums of a few numbers over the processes of one machine, through shared memory.

A step with the exact global loss sums two tiny tensors over the processes that DDP's step
does not (``early_reductions``: the batch's ignored-target counts and the loss's pending
sum). Through gloo each is a collective: its start wakes gloo's worker thread, which on a
machine whose cores are all busy takes the core from the program's thread for a while
(``bench/data_parallel.py`` measures what that costs a step). When every process of the
group runs on one x86-64 machine, these sums go through shared memory instead:

- every process of the group maps one small buffer: a ring of ``RING`` places, each with
  one row per process of ``WIDTH`` 8-byte values, a sequence number and the dtype and size
  summed (the processes must agree on them: an error says so otherwise);
- ``all_reduce(t)`` (in the same order on every process, as a collective) writes this
  process's values into its row of the next place, then the place's sequence number: no
  system call, no other thread;
- waiting for it reads the other rows once their sequence numbers say they are written,
  and sums them in rank order, in float64 for floating types (int64 for integers), so
  that every process gets the same bits; the sum is written into ``t`` in place.

A place is written again ``RING`` sums later, once every process has read what it held:
before writing, a process finishes (reads and keeps) every sum of its own it has not
waited for that is that old, and waits for every other process to have done the same.
A sequence number read means the values before it are there only where stores are seen in
order (x86-64; ``shared_memory`` argues it and holds the gate): other architectures, groups
spanning machines, tensors wider than ``WIDTH`` or off the CPU are summed by the group's
backend, and so is everything when the shared buffer cannot be had. The choice depends only on the
group, the dtype and the size, alike on every process.

Waiting polls: it yields the core, then sleeps in growing steps (at most
``MAX_SLEEP_S``), and every ``CHECK_S`` checks that the processes it waits for are still
alive, raising ``PeerLost`` (counted as a consequence, as a lost connection) naming the rank
when one is gone, and after the group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from torchspmd.engines.native.communication import cpu_shortcuts, shared_memory
from torchspmd.engines.native.start import global_mode
from torchspmd.errors import PeerLost, SpmdError

RING = 64
WIDTH = 32
MAX_SLEEP_S = 0.0005
CHECK_S = 0.5
SWITCH = "TORCHSPMD_SHARED_SUMS"  # "0": always the backend's collective

_SUMMED = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class _Done:
    """What a sum left to wait for (a ``dist.Work``'s ``wait``)."""

    __slots__ = ("board", "finished", "seq", "tensor")

    def __init__(self, board: _Board, seq: int, tensor: torch.Tensor):
        self.board, self.seq, self.tensor, self.finished = board, seq, tensor, False

    def wait(self, timeout=None) -> bool:
        if not self.finished:
            self.board.finish_upto(self.seq)
        return True

    def is_completed(self) -> bool:
        return self.finished


class _Board:
    """One group's ring of places in shared memory (see the module docstring)."""

    def __init__(self, group, world: int, rank: int, pids: list[int], memory: torch.Tensor, timeout: float):
        self.group, self.world, self.rank, self.pids, self.timeout = group, world, rank, pids, timeout
        self.memory = memory  # keeps the mapping alive
        words = memory.view(torch.int64).numpy()
        self.finished_at = words[:world]  # each process's: every sum up to this one is read
        body = words[world:].reshape(RING, world, 2 + WIDTH)
        self.seqs = body[:, :, 0]
        self.kinds = body[:, :, 1]  # what was summed: its dtype and size (the processes must agree)
        self.ints = body[:, :, 2:]
        self.floats = self.ints.view(np.float64)
        self.next_seq = 1
        self.finished = 0  # every sum up to this one has been read by this process
        self.pending: dict[int, _Done] = {}
        self.lock = threading.Lock()

    # -- writing ----------------------------------------------------------------------
    def start(self, tensor: torch.Tensor) -> _Done:
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            if seq > RING:
                self._finish(seq - RING)  # this process has read what the place held
                self._until(lambda: all(int(self.finished_at[r]) >= seq - RING for r in range(self.world)),
                            "to read a sum", range(self.world))
            place = (seq - 1) % RING
            values, n = _values(tensor), tensor.numel()
            self.kinds[place, self.rank] = n * 64 + _SUMMED.index(tensor.dtype)
            # (numpy converts to the row's float64 or int64 as it stores)
            (self.floats if tensor.dtype.is_floating_point else self.ints)[place, self.rank, :n] = values
            self.seqs[place, self.rank] = seq  # (after the values: x86-64 keeps the stores' order)
            done = _Done(self, seq, tensor)
            self.pending[seq] = done
            return done

    # -- reading ----------------------------------------------------------------------
    def finish_upto(self, seq: int) -> None:
        with self.lock:
            self._finish(seq)

    def _finish(self, upto: int) -> None:
        """Read every sum up to ``upto`` this process started and has not read (in order)."""
        while self.finished < upto:
            seq = self.finished + 1
            place = (seq - 1) % RING
            row = self.seqs[place]
            self._until(lambda row=row, seq=seq: all(int(row[r]) == seq for r in range(self.world)),
                        "to start a sum", range(self.world))
            kinds = self.kinds[place]
            if any(int(kinds[r]) != int(kinds[self.rank]) for r in range(self.world)):
                raise SpmdError(
                    f"torchspmd: the processes' sum number {seq} of a global loss's values differ in dtype or "
                    f"size ({', '.join(_describe(int(k)) for k in kinds)} on the group's ranks 0..{self.world - 1}):"
                    f" they ran different programs, or one process skipped a sum the others made (an error "
                    f"raised on some processes only)"
                )
            done = self.pending.pop(seq, None)
            if done is not None:
                t = done.tensor
                n = t.numel()
                rows = self.floats if t.dtype.is_floating_point else self.ints
                total = rows[place, 0, :n].copy()
                for r in range(1, self.world):
                    total += rows[place, r, :n]
                _store(t, total)
                done.finished = True
            self.finished = seq
            self.finished_at[self.rank] = seq

    def _until(self, ready, what: str, ranks) -> None:
        if ready():
            return
        start = last_check = time.monotonic()
        pause = 0.0
        while not ready():
            if pause == 0.0:
                os.sched_yield()
                pause = 1e-5 if time.monotonic() - start > 1e-4 else 0.0
            else:
                time.sleep(pause)
                pause = min(2 * pause, MAX_SLEEP_S)
            now = time.monotonic()
            if now - last_check >= CHECK_S:
                last_check = now
                self._check_alive(ranks, what)
                if now - start > self.timeout:
                    raise PeerLost(
                        f"torchspmd: waited {self.timeout:.0f} s for the other processes {what} of the global "
                        f"loss's sums (through shared memory); a process stopped calling collectives: one "
                        f"may be stuck, or the processes run different programs"
                    )

    def _check_alive(self, ranks, what: str) -> None:
        for r in ranks:
            if r == self.rank:
                continue
            if _ended(self.pids[r]):
                raise PeerLost(
                    f"torchspmd: process {dist.get_global_rank(self.group, r)} (pid {self.pids[r]}) ended while "
                    f"this one waited for it {what}; its own error says why"
                )


def _values(t: torch.Tensor) -> np.ndarray:
    """``t``'s values, flat, as numpy holds them (bfloat16, which numpy lacks, as float64)."""
    if t.dtype == torch.bfloat16:
        with global_mode.local_region():
            return t.detach().double().numpy().reshape(-1)
    return t.detach().numpy().reshape(-1)


def _store(t: torch.Tensor, total: np.ndarray) -> None:
    """Write the sum ``total`` (float64 or int64, flat) into ``t``, cast to its dtype."""
    if t.dtype == torch.bfloat16:
        with global_mode.local_region():
            t.copy_(torch.from_numpy(total).reshape(t.shape))
    else:
        t.detach().numpy().reshape(-1)[:] = total  # (a view of t's storage: t is contiguous)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped by its parent has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _describe(kind: int) -> str:
    return f"{_SUMMED[kind % 64]} x {kind // 64}"


_BOARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _Board, or None: not usable


_THROUGH_BACKEND = threading.local()


@contextlib.contextmanager
def through_backend():
    """Sums started inside go through the backend's all-reduce (``torchspmd.explain`` lists a
    step's collectives as the backend makes them). Every process must enter it alike."""
    before = getattr(_THROUGH_BACKEND, "on", False)
    _THROUGH_BACKEND.on = True
    try:
        yield
    finally:
        _THROUGH_BACKEND.on = before


def _enabled() -> bool:
    return (os.environ.get(SWITCH, "1") != "0" and cpu_shortcuts.allowed() and not getattr(_THROUGH_BACKEND, "on", False)
            and shared_memory.ordered_stores())


def _board(group) -> _Board | None:
    """The group's board (made collectively at the group's first sum), or None where the
    group's processes are not all on this machine or shared memory cannot be had."""
    if group in _BOARDS:
        return _BOARDS[group]
    world, rank = group.size(), group.rank()
    size = (world + RING * world * (2 + WIDTH)) * 8  # int64 words: each process's "finished up to", the ring
    board = None
    if shared_memory.same_machine(group):
        memory, _ = shared_memory.map_for(group, size)
        if memory is not None:
            pids = [pid for _, pid in shared_memory.members(group)]
            board = _Board(group, world, rank, pids, memory, _timeout(group))
    _BOARDS[group] = board
    return board


def _timeout(group) -> float:
    try:
        t = group._get_backend(torch.device("cpu")).options._timeout
        return t.total_seconds() if isinstance(t, timedelta) else float(t)
    except (AttributeError, RuntimeError):  # (a backend without these options)
        return 1800.0


def all_reduce(tensor: torch.Tensor, group=None):
    """Start the sum of ``tensor`` over ``group``'s processes (a collective: every process
    calls it at the same point of the program), in place; return what to ``wait()`` for."""
    group = group if group is not None else dist.group.WORLD
    usable = (_enabled() and tensor.device.type == "cpu" and tensor.dtype in _SUMMED
              and tensor.numel() <= WIDTH and tensor.is_contiguous())
    board = _board(group) if usable else None
    if board is None:
        return dist.all_reduce(tensor, group=group, async_op=True)
    return board.start(tensor)
