"""Clean processes: run a test's function in fresh processes that, by default, never import
torchspmd — the single-process (or plain-PyTorch multi-process) reference a torchspmd run is
compared with — or in which a test may change process-wide state (``use_spmd()``, mocks) that
then ends with the process.

``run_clean(fn, *args)`` runs ``fn`` in one such process and returns its result;
``run_clean(fn, *args, world=2)`` runs it on every rank of a fresh gloo group (the
environment torchrun gives, ``init_process_group("gloo")`` done before and destroyed
after) and returns each rank's result. ``fn`` must be a module-level function of a
module that, with ``allow_torchspmd=False``, does not import torchspmd at import time. The
process starts with the caller's environment at the call, less the launcher's and torchspmd's
variables (``RANK``, ``TORCHSPMD_BACKEND``, ...), with ``OMP_NUM_THREADS=1``.

The processes are forks of a server process (multiprocessing's forkserver context), one per
test process, that has imported torch (``PRELOAD``) and nothing else: a call that does
nothing takes ~0.02 s (two ranks: ~0.07 s), where a spawned interpreter importing torch takes
~1.5 s (~2 s) on a 2-core machine. The server never imports torchspmd; it is started with the
environment above (so torch and its libraries read ``OMP_NUM_THREADS=1`` when they load), and
each process replaces that environment with the one of its call. transformers is not
preloaded: it reads its environment (``HF_*``, ``TRANSFORMERS_*``) when imported, which would
be the server's, and it would save ~0.5 s only in the calls that import it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from multiprocessing.connection import wait

from _helpers import clean_env, free_port

TIMEOUT = float(os.environ.get("TORCHSPMD_TEST_TIMEOUT", 180))

#: what the server imports before it forks the clean processes (nothing of torchspmd's)
PRELOAD = ["torch"]


def _context():
    """The forkserver context, its server running (started, or restarted if it died, with the
    clean environment; nothing else in the tests or torchspmd uses this context)."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(clean_env(OMP_NUM_THREADS=1))
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


def _torchspmd_modules() -> list[str]:
    import sys

    return sorted(m for m in sys.modules if m == "torchspmd" or m.startswith("torchspmd."))


def _child(module: str, name: str, args, kwargs, rank: int, world: int, port: int, allow_torchspmd: bool,
           env: dict, conn) -> None:
    try:
        os.environ.clear()
        os.environ.update(env)
        if world > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import importlib

        import torch

        torch.set_num_threads(1)
        fn = getattr(importlib.import_module(module), name)
        if not allow_torchspmd and _torchspmd_modules():
            raise AssertionError(f"the clean process imported {_torchspmd_modules()} before running {name}")
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo")
        try:
            result = fn(*args, **kwargs)
        finally:
            if world > 1:
                dist.destroy_process_group()
        if not allow_torchspmd and _torchspmd_modules():
            raise AssertionError(f"{name} imported {_torchspmd_modules()} in the clean process")
        # plain pickle: torch's multiprocessing pickler would share tensors through file
        # descriptors of this process, which ends before the parent reads them
        conn.send_bytes(pickle.dumps((True, result)))
    except BaseException:
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    finally:
        conn.close()


def run_clean(fn, *args, world: int = 1, allow_torchspmd: bool = False, timeout: float = TIMEOUT, **kwargs):
    """``fn(*args, **kwargs)`` in ``world`` fresh processes (see the module's docstring):
    its result (``world == 1``) or the list of results by rank."""
    ctx = _context()
    port = free_port()
    # the caller's environment now, without the launcher's and torchspmd's variables
    # (_helpers.LAUNCH_VARS): a forked process would otherwise have the server's
    env = clean_env(OMP_NUM_THREADS=1)
    pipes, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn.__module__, fn.__name__, args, kwargs, rank, world, port,
                                             allow_torchspmd, env, child))
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    results: dict[int, object] = {}
    errors: list[str] = []
    pending = dict(enumerate(pipes))
    try:
        while pending and not errors:  # a failed rank ends the wait (the others may hang on it)
            ready = wait(list(pending.values()), timeout)
            if not ready:
                raise AssertionError(f"{fn.__name__} in a clean process: no answer from ranks {sorted(pending)} "
                                     f"within {timeout}s")
            for rank in [r for r, c in pending.items() if c in ready]:
                conn = pending.pop(rank)
                try:
                    ok, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(5)
                    errors.append(f"rank {rank} died (exit code {procs[rank].exitcode})")
                    continue
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(0 if errors else 10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError(f"{fn.__name__} failed in a clean process:\n" + "\n".join(errors))
    return results[0] if world == 1 else [results[r] for r in range(world)]
