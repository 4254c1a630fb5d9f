"""Multi-rank test harness: a pool of real gloo processes per world size.

Each worker process joins a process group through the same environment torchrun
provides and calls ``torchspmd.use_spmd()`` once; tests then send it module-level
functions to run on every rank at once and get back each rank's result. Starting the
processes once per session keeps the suite fast; a worker that hangs, dies or raises
fails its test and the pool is started again for the next one. After each task the global
state a test can leave is reset and checked (``_reset``): ``os.environ``, the global mesh,
the automatic data-parallel path's setting and the patches ``use_spmd()`` applied (others a
task applied are removed; one it removed fails the task, and the pool starts again).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from multiprocessing.reduction import ForkingPickler

from _helpers import free_port


def _worker(rank: int, world: int, port: int, inbox, outbox, parent: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        TORCHSPMD_ALL_RANKS_OUTPUT="1",
    )
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pool dumps stacks of a hung rank
    import torch

    torch.set_num_threads(1)
    import torchspmd as ts

    ts.use_spmd(backend="cpu")
    from torchspmd import patches

    baseline = [p.name for p in patches.active()]
    outbox.put((rank, True, "ready"))
    while True:
        try:
            msg = inbox.get(timeout=2)
        except queue.Empty:
            if os.getppid() != parent:  # the test session is gone
                break
            continue
        if msg is None:
            break
        fn, args, kwargs = msg
        saved = dict(os.environ)
        try:
            result = fn(*args, **kwargs)
            # Fail here, visibly, rather than in the queue's feeder thread (which pickles with
            # torch's reductions: they refuse, for one, non-leaf tensors that require grad).
            ForkingPickler.dumps(result)
            answer = (rank, True, result)
        except BaseException:  # reported to the test
            answer = (rank, False, traceback.format_exc())
        finally:  # every environment change a test makes is undone
            os.environ.clear()
            os.environ.update(saved)
        left = _reset(baseline)
        if left and answer[1]:
            answer = (rank, False, f"the task left global state that cannot be reset: {left}")
        outbox.put(answer)


def _reset(baseline: list[str]) -> str:
    """Put back the global state a task can change (see the module's docstring); what could
    not be put back, or ''."""
    import torchspmd as ts
    from torchspmd import patches

    ts.set_global_mesh(None)
    ts.set_auto_replicate(None)
    for name in [p.name for p in patches.active()]:
        if name not in baseline:
            patches.remove(name)
    now = [p.name for p in patches.active()]
    problems = []
    if now != baseline:
        problems.append(f"the patches {sorted(set(baseline) - set(now))} were removed")
    if ts.get_global_mesh() is not None:
        problems.append("a global mesh is set")
    return "; ".join(problems)


class WorkerFailed(AssertionError):
    pass


class Pool:
    def __init__(self, world: int, timeout: float = float(os.environ.get("TORCHSPMD_TEST_TIMEOUT", 180))):
        self.world = world
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.procs = [
            # not daemonic: tests start DataLoader worker processes inside
            ctx.Process(target=_worker, args=(r, world, port, self.inboxes[r], self.outbox, os.getpid()))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect("start-up")

    def _collect(self, what: str) -> list:
        results: dict[int, object] = {}
        errors: list[str] = []
        while len(results) + len(errors) < self.world:
            try:
                # After one rank failed, the others answer at once or are stuck waiting for it.
                rank, ok, value = self.outbox.get(timeout=self.timeout if not errors else min(self.timeout, 10))
            except queue.Empty:
                if errors:
                    break
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                for p in self.procs:  # print where each rank is stuck, then give up on the pool
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1)
                self.close()
                raise WorkerFailed(f"{what}: no answer from every rank within {self.timeout}s (dead ranks: {dead})")
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            # The group may be out of step (a rank waiting in a collective the failed one never
            # reached): this pool is done, the next test gets a fresh one.
            self.close()
            raise WorkerFailed(f"{what} failed:\n" + "\n".join(errors))
        return [results[r] for r in range(self.world)]

    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank."""
        for q in self.inboxes:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", str(fn)))

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.inboxes:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
