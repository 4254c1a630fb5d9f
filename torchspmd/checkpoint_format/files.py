"""The files of a sharded checkpoint: written durably, checked, read safely, and the work
one process does for all.

A file is written and fsynced (``write_synced``, ``fsync_dir``); what rank 0 alone does it
reports to the others (``on_rank0``), so that every process raises the same error; hashes
are split over the processes (``hashes``); a pickle is checked before it is read
(``well_formed_pickle``); a DCP read names the shard file it could not read
(``NamingReader``). The error types of checkpoints live here too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import pickletools
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

from torchspmd.errors import SpmdError


class BadCheckpoint(SpmdError):
    """A checkpoint directory that is missing, incomplete or corrupt."""


class DamagedCheckpoint(BadCheckpoint):
    """A checkpoint that is incomplete or corrupt (a file missing, short, changed or
    unreadable): the one before it is the way back. The other kinds of ``BadCheckpoint``
    (no such directory, a directory that is no checkpoint) are a wrong path, not damage."""


class CheckpointMismatch(SpmdError):
    """A sound checkpoint saved from another model or optimizer than the one it is loaded
    into. Nothing has been loaded when it is raised."""


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


CHECKSUMS = "checksums.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def hashes(folder: Path, names: list[str], collective: bool) -> dict[str, str]:
    """SHA-256 of the files ``names`` (sorted alike everywhere) in ``folder``; with
    ``collective`` every process hashes its share and all get every hash."""
    if not (collective and dist.is_initialized() and world() > 1):
        return {n: sha256(folder / n) for n in names}
    try:
        mine: dict | str = {n: sha256(folder / n) for n in names[rank()::world()]}
    except Exception as e:  # shared with the others, who would otherwise wait for this process's hashes
        mine = f"a file cannot be read on process {rank()} ({why(e)})"
    parts: list = [None] * world()
    dist.all_gather_object(parts, mine)
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise DamagedCheckpoint(f"checkpoint {folder} cannot be checked: {failed[0]}")
    return {n: h for part in parts for n, h in part.items()}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def on_rank0(work, failed):
    """Run ``work()`` on rank 0 alone and share how it went: every process returns its
    result, or raises the same ``SpmdError(failed(exception))`` when it raised on rank 0
    (``failed`` runs there, and can tell what was done). A bare barrier after such a
    section does not do: when rank 0 raises, the others' barrier pairs with rank 0's next
    collective, they carry on as if it had succeeded, and the group is out of step."""
    outcome: list = [None, None]
    if rank() == 0:
        try:
            outcome = [work(), None]
        except Exception as e:
            outcome = [None, failed(e)]
    if dist.is_initialized() and world() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise SpmdError(outcome[1])
    return outcome[0]


def why(e: BaseException) -> str:
    """A short reason (torch.load's own message for garbage advises weights_only=False)."""
    if isinstance(e, pickle.UnpicklingError):
        return "UnpicklingError: its bytes are not what was written"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def shards_failed(e: CheckpointException) -> str:
    """Which processes could not write their shards, and why (DCP's own message names
    only the ranks; it carries each one's exception)."""
    failures = sorted(e.failures.items())
    ranks = ", ".join(str(r) for r, _ in failures)
    reasons = "; ".join(f"process {r}: {why(exc)}" for r, (exc, _) in failures[:4])
    return f"writing its shards failed on process{'es' if len(failures) > 1 else ''} {ranks} ({reasons})"


_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def well_formed_pickle(data: bytes) -> bytes:
    """``data`` if it is one whole pickle whose memo indices fit in it; an
    ``UnpicklingError`` otherwise. It reads the opcodes without running them: Python's
    unpickler, given a damaged file, sizes its memo from an index it reads (a few bytes
    of garbage can make it fill gigabytes and the process be killed for memory) before it
    finds that the rest is garbage."""
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in _MEMO_OPS and not 0 <= int(arg) < len(data):
                raise ValueError(f"memo index {arg} in a pickle of {len(data)} bytes")
    except ValueError as e:
        raise pickle.UnpicklingError(str(e)) from None
    return data


class NamingReader(dcp.FileSystemReader):
    """DCP's file reader that names the shard file it could not read."""

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                raise BadCheckpoint(f"the shard file {name} cannot be read ({why(e)})") from None
        done: Future = Future()
        done.set_result(None)
        return done


def corrupt(path: Path, e: CheckpointException) -> DamagedCheckpoint:
    """One message for a DCP read that failed on some process (every process gets all)."""
    rank, (exc, _) = sorted(e.failures.items())[0]
    detail = str(exc) if isinstance(exc, BadCheckpoint) else why(exc)
    return DamagedCheckpoint(f"checkpoint {path} is corrupt: {detail} (on process {rank})")


def storage_files(meta) -> dict[str, int]:
    """The shard files a checkpoint's DCP metadata refers to, each with the size it must
    have at least."""
    need: dict[str, int] = {}
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need
