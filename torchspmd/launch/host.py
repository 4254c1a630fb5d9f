"""The host the native engine's processes share: malloc settings, core binding, threads.

Relaunched CPU processes get ``OMP_NUM_THREADS`` = cores / processes unless it is set, glibc
malloc settings that reuse freed memory instead of page-faulting fresh memory every step
(``TORCHSPMD_MALLOC=default`` keeps glibc's), and each its own share of the launcher's
cores (``TORCHSPMD_BIND_CORES=0`` lets them run anywhere); see docs/launching.md.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from torchspmd.errors import SpmdError

#: glibc malloc settings for the workers (``mallopt(3)``'s environment variables): blocks up
#: to 32 MiB (glibc's largest threshold) come from the heap rather than from a fresh
#: ``mmap`` each time, and freed heap memory is kept rather than returned to the system. An
#: FSDP step frees and allocates every layer's gathered parameters and gradients again;
#: with glibc's defaults each of those allocations is new memory that the kernel zeroes
#: page by page (page faults, system time); with these the process reuses its own memory.
#: The process's resident memory then stays near its peak between steps.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40),
              "MALLOC_TOP_PAD_": str(256 * 2**20)}
#: ``TORCHSPMD_MALLOC=default`` keeps glibc's own settings.
MALLOC_SWITCH = "TORCHSPMD_MALLOC"


def allocator_env(environ) -> dict[str, str]:
    """The malloc variables to add to ``environ`` for the workers: :data:`MALLOC_ENV`, unless
    ``TORCHSPMD_MALLOC=default`` or the environment already sets glibc's malloc (a ``MALLOC_*``
    variable, or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``: the user's choice, kept as it is)."""
    switch = environ.get(MALLOC_SWITCH, "tuned")
    if switch not in ("tuned", "default"):
        raise SpmdError(f"{MALLOC_SWITCH}={switch!r}: expected 'tuned' (the default) or 'default' (glibc's own "
                        "malloc settings)")
    if switch == "default" or any(k.startswith("MALLOC_") for k in environ) \
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return dict(MALLOC_ENV)


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the system now (glibc's ``malloc_trim(0)``).

    Under :data:`MALLOC_ENV` freed memory is kept for reuse; that is right for the
    per-step buffers, but not for a one-off like the whole model a process builds before
    FSDPv2 keeps only its shard (the rest would stay resident for the whole run). FSDPv2
    calls this once it has sharded. Nothing happens where the C library has no
    ``malloc_trim`` (not glibc) or on other systems."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # another C library: it keeps no such reserve
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


# glibc's mallopt(3) parameter numbers for MALLOC_ENV's variables: a forked worker does not
# read the environment's malloc settings (glibc reads them once, at process start), so
# they are applied to it with mallopt.
MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}


def apply_malloc_settings(settings: dict[str, str]) -> None:
    """Set ``settings`` (:data:`MALLOC_ENV`'s variables) in this running process."""
    if not settings or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for name, value in settings.items():
        mallopt(MALLOPT[name], min(int(value), 2**31 - 1))


#: ``TORCHSPMD_BIND_CORES=0`` leaves the forked workers free to run on any of the launcher's cores.
BIND_SWITCH = "TORCHSPMD_BIND_CORES"
#: OpenMP's own placement variables: a user who set one chose where threads run.
_PLACEMENT_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def bind_switch(environ) -> bool:
    value = environ.get(BIND_SWITCH, "1")
    if value not in ("0", "1"):
        raise SpmdError(f"{BIND_SWITCH}={value!r}: expected '1' (the default: each worker runs on its own "
                        f"share of the launcher's cores) or '0' (workers may run on any of them)")
    return value == "1"


def worker_cores(cores: Sequence[int], local_rank: int, local_world: int) -> list[int]:
    """The cores local worker ``local_rank`` of ``local_world`` runs on: an equal share of
    ``cores`` (the launcher's), consecutive ones together; with more workers than cores,
    each core is shared by an equal number of workers (ranks 0 and 1 of 4 on the first of 2)."""
    cores = sorted(cores)
    n = len(cores)
    if local_world <= n:
        return cores[local_rank * n // local_world:(local_rank + 1) * n // local_world]
    return [cores[local_rank * n // local_world]]


def bind_to_cores() -> None:
    """In a forked worker: run on :func:`worker_cores` (threads started later inherit it),
    unless ``TORCHSPMD_BIND_CORES=0``, OpenMP's placement variables are set, or
    ``OMP_NUM_THREADS`` asks for more threads than those cores."""
    if not hasattr(os, "sched_setaffinity") or not bind_switch(os.environ) \
            or any(k in os.environ for k in _PLACEMENT_ENV):
        return
    try:
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return
    mine = worker_cores(os.sched_getaffinity(0), local_rank, local_world)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > len(mine):
        return
    os.sched_setaffinity(0, mine)


def threads_per_process(nproc: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nproc)


# --- in each worker -------------------------------------------------------------------
