"""The shared memory of one machine's processes: the one transport under the CPU collectives
that bypass gloo (``collectives``: FSDP2's all-gather and reduce-scatter; ``shared_sums``: a
step's small sums; ``gradient_sums``: DDP's buckets).

**Mapping.** :func:`map_for` is collective over a group: its first process makes a file in
``/dev/shm`` with the space reserved (``posix_fallocate``: a full ``/dev/shm`` — a default
Docker container has 64 MB — fails there, not with a SIGBUS at first touch), every process
maps it (``torch.from_file``), one barrier, and the first process deletes the file (the
mappings live on; nothing is left behind, no resource tracker is involved; a buffer nothing
views any more is unmapped). When the file cannot be made every process gets ``None`` and
the same reason, so every user falls back to the group backend's collective alike.

**Where it is used.** :func:`usable` says whether a group may use it at all: every process
on this machine (host names compared once per group, by the group's name, which every
process gives it alike; an ``id`` is an address a new group may reuse on some processes
only) and a gloo group on the CPU. Each user has its own switch to the backend as well.

**Memory ordering.** Two kinds of synchronisation meet the shared bytes:

- the collectives of ``collectives`` and ``gradient_sums`` order their reads and writes with
  the group backend's barriers (or ``shared_sums``' meeting, below): a barrier is a system
  call and a full fence on every architecture, so these are correct on any machine;
- ``shared_sums`` synchronises through the shared memory itself: a process writes its values,
  then a sequence number, and its peers poll the sequence number and then read the values.
  That is correct only where stores become visible in program order and loads are not
  reordered with older loads: x86-64's total store order. :func:`ordered_stores` is that gate;
  elsewhere (ARM, POWER: weaker orders, no fences in numpy's stores) ``shared_sums`` takes the
  backend's all-reduce, and so does ``gradient_sums``' meeting, which goes through it.
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile

import torch
import torch.distributed as dist

__all__ = ["group_key", "map_for", "members", "ordered_stores", "same_machine", "shared_dir"]

#: ``TORCHSPMD_SHM_ORDER=weak`` takes this machine's stores as unordered (as on ARM): every
#: user of the shared memory's own synchronisation takes the backend's collective instead
#: (for tests of that path on x86-64 machines, and a way out should a machine misbehave).
ORDER_SWITCH = "TORCHSPMD_SHM_ORDER"


def shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_file(size: int) -> list:
    """``[path, None]`` of a new file of ``size`` bytes in :func:`shared_dir`, its space
    reserved, or ``[None, reason]``."""
    path, where = None, shared_dir()
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


def map_for(group: dist.ProcessGroup, size: int) -> tuple[torch.Tensor | None, str]:
    """A new ``size``-byte buffer every process of ``group`` maps (collective): ``(buffer,
    the deleted file's path)``, or ``(None, why not)`` alike on every process."""
    made = [None, None]  # the file's path, or why it could not be made
    first = group.rank() == 0
    if first:
        made = new_file(size)
    try:
        dist.broadcast_object_list(made, src=dist.get_global_rank(group, 0), group=group)
        if made[1] is not None:
            return None, made[1]
        base = torch.from_file(made[0], shared=True, size=size, dtype=torch.uint8)
        dist.barrier(group=group)  # every process has mapped it
    finally:
        if first and made[0] is not None:
            os.unlink(made[0])  # the mappings live on; nothing is left in /dev/shm
    return base, made[0]


def group_key(group: dist.ProcessGroup):
    """What keeps a group's shared state: its name (alike on every process)."""
    return getattr(group, "group_name", None) or id(group)


_MEMBERS: dict = {}  # group name -> [(host name, pid)] of its processes, in rank order


def members(group: dist.ProcessGroup) -> list[tuple[str, int]]:
    """Each process's ``(host name, pid)``, in the group's rank order (collective the first
    time it is asked for a group)."""
    key = group_key(group)
    if key not in _MEMBERS:
        everyone: list = [None] * group.size()
        dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()), group=group)
        _MEMBERS[key] = [tuple(e) for e in everyone]
    return _MEMBERS[key]


def same_machine(group: dist.ProcessGroup) -> bool:
    """Whether every process of ``group`` runs on this machine (collective the first time)."""
    return len({host for host, _ in members(group)}) == 1


def ordered_stores() -> bool:
    """Whether this machine keeps stores in program order as other cores see them (x86-64's
    total store order): what ``shared_sums``' polling needs (the module docstring)."""
    if os.environ.get(ORDER_SWITCH, "") == "weak":
        return False
    return platform.machine().lower() in ("x86_64", "amd64")
