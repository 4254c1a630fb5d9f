"""Fault injection for the tests: the one seam, driven by environment variables.

A test starts a job with one of these set; production code asks this module at the points
where a fault can be injected and nothing happens unless the variable is set. Each fault
acts on the job's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so that an
elastic restart runs clean.

- ``TORCHSPMD_FAULT_KILL_AT_STEP=N``: rank 1 SIGKILLs itself after training step N.
- ``TORCHSPMD_FAULT_SAVE_AT_STEP=N``: the save of step N raises once its shards are written.
- ``TORCHSPMD_FAULT_KILL_IN_SAVE=N:POINT``: one process SIGKILLs itself inside the save of
  step N, at ``POINT``: ``shards`` (the last process, once its own shard files are written,
  before the checkpoint's index), ``before-rename`` / ``after-rename`` (rank 0, around the
  rename that completes it).
- ``TORCHSPMD_FAULT_NAN_AT_STEPS=2,4-6``: the loss of those steps is NaN on the last
  process (its gradients follow).
"""

from __future__ import annotations

import os
import signal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.futures import Future

from torchspmd.errors import SpmdError

KILL_AT = "TORCHSPMD_FAULT_KILL_AT_STEP"
FAIL_SAVE = "TORCHSPMD_FAULT_SAVE_AT_STEP"
KILL_IN_SAVE = "TORCHSPMD_FAULT_KILL_IN_SAVE"
NAN_AT = "TORCHSPMD_FAULT_NAN_AT_STEPS"
KILL_POINTS = ("shards", "before-rename", "after-rename")


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def after_step(step: int) -> None:
    """``KILL_AT``: rank 1 dies after ``step``."""
    if os.environ.get(KILL_AT) == str(step) and _rank() == 1 and _first_attempt():
        _kill()


def nan_steps() -> set[int]:
    """``NAN_AT``: the steps whose loss is made NaN."""
    steps: set[int] = set()
    for part in filter(None, os.environ.get(NAN_AT, "").replace(" ", "").split(",")):
        first, _, last = part.partition("-")
        try:
            steps.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise SpmdError(f"{NAN_AT} = {os.environ[NAN_AT]!r}: expected step numbers and ranges such as "
                            f"'2,4-6'") from None
    return steps


def kill_point_in_save(step: int) -> str | None:
    """``KILL_IN_SAVE``: the point of the save of ``step`` where a process dies, if any."""
    at, _, point = os.environ.get(KILL_IN_SAVE, "").partition(":")
    if at != str(step) or not _first_attempt():
        return None
    if point not in KILL_POINTS:
        raise SpmdError(f"{KILL_IN_SAVE} = {os.environ[KILL_IN_SAVE]!r}: expected STEP:POINT with POINT one of "
                        f"{', '.join(KILL_POINTS)}")
    return point


def in_save(step: int, point: str, rank: int) -> None:
    """Process ``rank`` dies here when the save of ``step`` is to be killed at ``point``."""
    if kill_point_in_save(step) == point and _rank() == rank:
        _kill()


def fail_after_shards(step: int) -> None:
    """``FAIL_SAVE``: the save of ``step`` crashes between its shards and the rest."""
    if os.environ.get(FAIL_SAVE) == str(step):
        raise RuntimeError("simulated crash during checkpoint save")


def storage_writer(path: str, step: int, world: int) -> dcp.FileSystemWriter:
    """DCP's writer for the shards of ``step``'s save: one that kills the last process once
    its shard files are written (and synced), before the checkpoint's ``.metadata`` exists,
    when ``KILL_IN_SAVE`` asks for the point ``shards``."""
    if kill_point_in_save(step) == "shards" and _rank() == world - 1:
        return _KillingWriter(path)
    return dcp.FileSystemWriter(path)


class _KillingWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner) -> Future:
        written = super().write_data(plan, planner)
        written.wait()
        _kill()
        return written  # not reached
