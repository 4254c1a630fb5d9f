"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step-00000100`` holding the model's and optimizer's
shards (DCP, reshardable: load it on another number of devices), ``state.pt`` (the
rest: scheduler, sampler position, RNG states, step), ``config.toml`` and ``meta.json``.

A save survives being killed at any moment. It is written as ``.step-00000100.tmp``;
every file is fsynced (DCP syncs the shards and its ``.metadata``); then the directory
is renamed to its final name (atomic) and only after that are the old checkpoints
pruned (each renamed to ``.step-N.pruned`` first, so a half-deleted one is never taken
for a checkpoint). So the newest complete checkpoint is always there whole, and a
``step-N`` directory is always complete. ``clean`` removes what an interrupted save
left behind (every process calls it at the start of a job).

``checksums.json`` holds the SHA-256 of every other file, computed as the save wrote them
(the shards' split over the processes): a file changed since (a flipped bit keeps its
size) is found before anything is loaded. Checkpoints without it (written before it
existed) are checked by size alone.

A save that fails on one process fails on every process with the same error (what rank 0
alone writes, it reports to the others), and the checkpoints saved before it stay. A load
checks first that the checkpoint holds the model's weights and no others, and an
optimizer of the same class (``meta.json`` names it) over the same parameter groups; the
optimizer gets exactly the state the checkpoint holds (none for a parameter that had none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

from torchspmd import runtime
from torchspmd._errors import SpmdError

_NAME = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^\.step-(\d{8})\.(tmp|replaced|pruned)$")
# Where a test may have a process SIGKILL itself during a save (see ``save``).
KILL_POINTS = ("shards", "before-rename", "after-rename")


class BadCheckpoint(SpmdError):
    """A checkpoint directory that is missing, incomplete or corrupt."""


class DamagedCheckpoint(BadCheckpoint):
    """A checkpoint that is incomplete or corrupt (a file missing, short, changed or
    unreadable): the one before it is the way back. The other kinds of ``BadCheckpoint``
    (no such directory, a directory that is no checkpoint) are a wrong path, not damage."""


class CheckpointMismatch(SpmdError):
    """A sound checkpoint saved from another model or optimizer than the one it is loaded
    into. Nothing has been loaded when it is raised."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


CHECKSUMS = "checksums.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _hashes(folder: Path, names: list[str], collective: bool) -> dict[str, str]:
    """SHA-256 of the files ``names`` (sorted alike everywhere) in ``folder``; with
    ``collective`` every process hashes its share and all get every hash."""
    if not (collective and dist.is_initialized() and _world() > 1):
        return {n: _sha256(folder / n) for n in names}
    try:
        mine: dict | str = {n: _sha256(folder / n) for n in names[_rank()::_world()]}
    except Exception as e:  # shared with the others, who would otherwise wait for this process's hashes
        mine = f"a file cannot be read on process {_rank()} ({_why(e)})"
    parts: list = [None] * _world()
    dist.all_gather_object(parts, mine)
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise DamagedCheckpoint(f"checkpoint {folder} cannot be checked: {failed[0]}")
    return {n: h for part in parts for n, h in part.items()}


def _step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoints under ``root``, oldest first. A ``step-N`` directory only ever appears
    complete (renamed into place), so every one is listed: a damaged one is reported
    when it is loaded rather than silently passed over. Temporary ones are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=_step_of)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def clean(root: str | Path) -> list[str]:
    """Remove what interrupted saves left under ``root`` (every process calls it; rank 0
    works): unfinished ``.step-N.tmp`` directories and half-pruned ones. A checkpoint that
    was set aside to be replaced by a new one of the same step is put back if the new one
    never arrived. Returns the names removed (on every process); raises the same
    ``SpmdError`` on every process if rank 0 fails."""
    root = Path(root)

    def work() -> list[str]:
        removed: list[str] = []
        if not root.is_dir():
            return removed
        for p in sorted(root.iterdir()):
            m = _LEFTOVER.match(p.name)
            if not m or not p.is_dir():
                continue
            final = root / f"step-{m.group(1)}"
            if m.group(2) == "replaced" and not final.exists():
                os.replace(p, final)
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        if removed:
            _fsync_dir(root)
        return removed

    return _on_rank0(work, lambda e: f"checkpoints {root}: what interrupted saves left there cannot be removed "
                                     f"({_why(e)}, on process 0)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _kill_if(kill_at: str | None, point: str, rank: int) -> None:
    """Fault injection for the tests: SIGKILL this process at ``point`` of a save."""
    if kill_at == point and _rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)


class _KillingWriter(dcp.FileSystemWriter):
    """DCP's file writer that SIGKILLs this process once its own shard files are written
    (and synced), before the checkpoint's ``.metadata`` exists (tests)."""

    def write_data(self, plan, planner) -> Future:
        written = super().write_data(plan, planner)
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)
        return written  # not reached


def _on_xla() -> bool:
    return runtime.is_spmd() and runtime.backend() == "xla"


def _names(model) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _ensure_optim_state(optimizer) -> None:
    """Create the optimizer's state (e.g. Adam's moments) if it has none yet, without
    changing any parameter: one step with zero gradients and a learning rate of 0."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    if _on_xla():
        from torchspmd.backends import xla

        return xla.prime_optimizer(optimizer)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _optim_state(model, optimizer) -> dict:
    """The optimizer's state keyed by parameter names (so that it can be resharded). The
    groups (hyper-parameters) are one pickled value: DCP's planner flattens containers
    into per-key entries and torch_xla's keeps those without tensors whole, so one value is
    what both engines store alike."""
    names = _names(model)
    sd = optimizer.state_dict()
    ids = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {ids[i]: v for i, v in sd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [ids[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": pickle.dumps(groups)}


def _as_saved(optim_sd: dict, keys, prefix: str = "optim") -> dict:
    """The optimizer target in the layout of a checkpoint written before the groups were
    one value (DCP had flattened them, a key per group entry)."""
    if f"{prefix}.param_groups" not in keys and f"{prefix}.param_groups.0.lr" in keys:
        optim_sd = {**optim_sd, "param_groups": pickle.loads(_well_formed_pickle(optim_sd["param_groups"]))}
    return optim_sd


#: Optimizer options that choose how this process computes the step, not what it computes:
#: a checkpoint's groups do not override them (a run on another engine or device, e.g. a
#: fused AdamW on CPU resumed on XLA, where the fused kernel does not exist, keeps its own).
_IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


def _group_names(model, optimizer) -> list[list[str]]:
    names = _names(model)
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _groups_differ(saved: list[dict], own: list[list[str]]) -> str | None:
    """How the checkpoint's parameter groups (``saved``, their parameters by name) differ
    from this optimizer's (``own``), or None: the groups' settings are loaded group by
    group, so the same parameters must be in the same groups (in any order)."""
    if len(saved) != len(own):
        return f"it has {len(saved)} parameter group(s) and this optimizer {len(own)}"
    there = {n: i for i, g in enumerate(saved) for n in g["params"]}
    for i, group in enumerate(own):
        for n in group:
            if n not in there:
                return f"the parameter {n!r} (in this optimizer's group {i}) is in none of its groups"
            if there[n] != i:
                return f"the parameter {n!r} is in its group {there[n]} and in this optimizer's group {i}"
    here = {n for group in own for n in group}
    extra = [(i, n) for i, g in enumerate(saved) for n in g["params"] if n not in here]
    if extra:
        return f"its group {extra[0][0]} holds the parameter {extra[0][1]!r}, which this optimizer does not update"
    return None


def _load_optim_state(model, optimizer, named: dict) -> None:
    """Load ``named`` (``_optim_state``'s layout, read from a checkpoint) into
    ``optimizer``. A parameter without an entry in ``named["state"]`` is left without
    state, as in a fresh optimizer: the checkpoint had none for it (plain SGD keeps none;
    Adam has none before a parameter's first gradient). The groups are matched by their
    parameters' names, each group's in this optimizer's own order: ``load_state_dict``
    pairs the saved parameters with its own by position."""
    own = _group_names(model, optimizer)
    index = {n: i for i, n in enumerate(n for group in own for n in group)}
    groups = named["param_groups"]
    if isinstance(groups, bytes):
        groups = pickle.loads(_well_formed_pickle(groups))
    differ = _groups_differ(groups, own)
    if differ:
        raise CheckpointMismatch(f"checkpoint: it was saved with another optimizer: {differ}")
    impl = [{k: g[k] for k in _IMPLEMENTATION_OPTIONS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict({
        "state": {index[n]: v for n, v in named["state"].items() if n in index},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, **impl[i],
                          "params": [index[n] for n in own[i]]} for i, g in enumerate(groups)],
    })


def _optimizer_kind(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _saved_optim_state(path: Path, meta, model, optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer state the checkpoint holds: ``{parameter name: {entry: DCP metadata}}``
    (``optim.state.<name>.<entry>``). A parameter it holds none for is absent."""
    own = {n for group in _group_names(model, optimizer) for n in group}
    saved: dict[str, dict[str, Any]] = {}
    for key, md in meta.state_dict_metadata.items():
        if not key.startswith("optim.state."):
            continue
        rest = key[len("optim.state."):]
        # parameter names hold dots too: the entry follows the (one) prefix that names a parameter
        name = next((rest[:i] for i, c in enumerate(rest) if c == "." and rest[:i] in own), None)
        if name is None:
            raise CheckpointMismatch(
                f"checkpoint {path} was saved with another optimizer: it has optimizer state for "
                f"{rest.rpartition('.')[0]!r}, a parameter this optimizer does not update; build the optimizer "
                f"over the same parameters as the one that saved it")
        saved.setdefault(name, {})[rest[len(name) + 1:]] = md
    return saved


def _optim_targets(path: Path, saved: dict[str, dict[str, Any]], model, optimizer) -> dict[str, dict[str, Any]]:
    """What to load the checkpoint's optimizer state into: exactly the entries it has.
    Natively they are made from its metadata: an entry of its parameter's shape (a moment)
    is sharded as the parameter is, any other tensor (a step count) is whole on every
    process, and any other value is put in place by DCP. (``load_state_dict`` then moves
    each where the optimizer keeps it.) torch_xla's planner loads into device tensors
    sharded by the compiler: there the optimizer makes its state (one step that changes
    nothing) and the entries the checkpoint has are taken from it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not saved:
        return {}
    params = {name: p for name, p in model.named_parameters()}
    if not _on_xla():
        def target(param, md):
            if not isinstance(md, TensorStorageMetadata):
                return b""
            if tuple(md.size) == tuple(param.shape):
                return torch.zeros_like(param.detach(), dtype=md.properties.dtype)
            return torch.zeros(tuple(md.size), dtype=md.properties.dtype)

        return {name: {entry: target(params[name], md) for entry, md in entries.items()}
                for name, entries in saved.items()}
    _ensure_optim_state(optimizer)
    primed = _optim_state(model, optimizer)["state"]
    targets: dict[str, dict[str, Any]] = {}
    for name, entries in saved.items():
        lacking = [e for e in entries if e not in primed.get(name, {})]
        if lacking:
            raise CheckpointMismatch(
                f"checkpoint {path} was saved with another optimizer (or other settings of it): its state for "
                f"{name!r} has {lacking[0]!r}, which this optimizer does not keep")
        targets[name] = {e: primed[name][e] for e in entries}
    return targets


def _read_groups(path: Path) -> list[dict]:
    """The checkpoint's optimizer parameter groups (one pickled value), read by this
    process alone (no collective: every process reads the same and decides alike)."""
    target = {"optim": {"param_groups": b""}}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(target, storage_reader=_NamingReader(str(path)), no_dist=True)
        return pickle.loads(_well_formed_pickle(target["optim"]["param_groups"]))
    except CheckpointException as e:
        raise _corrupt(path, e) from None
    except Exception as e:
        detail = (str(e) if isinstance(e, BadCheckpoint)
                  else f"the optimizer's parameter groups cannot be read ({_why(e)})")
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: {detail}") from None


def _read_meta(path: Path) -> dict:
    """``meta.json`` (step, device count, optimizer class); {} for a checkpoint without one."""
    f = path / "meta.json"
    if not f.is_file():
        return {}
    try:
        meta = json.loads(f.read_text())
        assert isinstance(meta, dict)
    except Exception:
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: meta.json cannot be read") from None
    return meta


def _on_rank0(work, failed):
    """Run ``work()`` on rank 0 alone and share how it went: every process returns its
    result, or raises the same ``SpmdError(failed(exception))`` when it raised on rank 0
    (``failed`` runs there, and can tell what was done). A bare barrier after such a
    section does not do: when rank 0 raises, the others' barrier pairs with rank 0's next
    collective, they carry on as if it had succeeded, and the group is out of step."""
    outcome: list = [None, None]
    if _rank() == 0:
        try:
            outcome = [work(), None]
        except Exception as e:
            outcome = [None, failed(e)]
    if dist.is_initialized() and _world() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise SpmdError(outcome[1])
    return outcome[0]


def _shards_failed(e: CheckpointException) -> str:
    """Which processes could not write their shards, and why (DCP's own message names
    only the ranks; it carries each one's exception)."""
    failures = sorted(e.failures.items())
    ranks = ", ".join(str(r) for r, _ in failures)
    why = "; ".join(f"process {r}: {_why(exc)}" for r, (exc, _) in failures[:4])
    return f"writing its shards failed on process{'es' if len(failures) > 1 else ''} {ranks} ({why})"


def save(root: str | Path, step: int, model, optimizer, state: dict[str, Any], config_toml: str,
         keep: int = 2, _fail_after_shards: bool = False, _kill_at: str | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` (every process calls it) and keep the
    newest ``keep`` (0: all).

    A save that fails (a full disk, a process that cannot write its shards) raises the
    same ``SpmdError`` on every process, naming the checkpoint and the cause, and leaves
    the checkpoints saved before it as they were.

    ``_fail_after_shards`` and ``_kill_at`` inject faults for the tests: raise once the
    shards are written, or SIGKILL one process at a point of ``KILL_POINTS``: ``"shards"``
    (the last process, once its shards are written, before the checkpoint's index),
    ``"before-rename"`` / ``"after-rename"`` (rank 0, around the rename that completes it).
    """
    if _kill_at is not None and _kill_at not in KILL_POINTS:
        raise SpmdError(f"checkpoint fault injection: unknown point {_kill_at!r}; choose one of "
                        f"{', '.join(KILL_POINTS)}")
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    unsaved = f"checkpoint {final} was not saved"
    unchanged = "the checkpoints saved before it are unchanged"

    def make_tmp() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    _on_rank0(make_tmp, lambda e: f"{unsaved}: {tmp} cannot be made ({_why(e)}, on process 0); {unchanged}")
    sd = {"model": model.state_dict(), "optim": _optim_state(model, optimizer)}
    try:
        if _on_xla():  # torch_xla's planners write each device's shards; the layout and keys are the same
            from torchspmd.backends import xla

            if _kill_at == "shards":
                raise SpmdError("checkpoint fault injection: the point 'shards' is for the native engine only")
            xla.dcp_save(sd, str(tmp))
        else:
            kill = _kill_at == "shards" and _rank() == _world() - 1
            dcp.save(sd, storage_writer=(_KillingWriter if kill else dcp.FileSystemWriter)(str(tmp)))
    except CheckpointException as e:
        # DCP's exception is a BaseException (``except Exception`` misses it) that names only the
        # ranks. Every process has it (DCP gathers the failures): none writes any more, so rank 0
        # can drop the unfinished directory (a full disk gets its space back).
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SpmdError(f"{unsaved}: {_shards_failed(e)}; {unchanged}") from None
    if _fail_after_shards:  # tests: a crash between the shards and the rest
        raise RuntimeError("simulated crash during checkpoint save")
    # (DCP's save returns once its .metadata is written: every process can read it)
    shards = sorted(_storage_files(dcp.FileSystemReader(str(tmp)).read_metadata()))
    sums = _hashes(tmp, [".metadata", *shards], collective=True)
    done = {"renamed": False}
    aside = root / f".step-{step:08d}.replaced"

    def finish() -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        files = {"state.pt": buf.getvalue(), "config.toml": config_toml.encode(),
                 "meta.json": json.dumps({"step": step, "world_size": runtime.global_runtime_device_count()
                                          if runtime.is_spmd() else 1,
                                          "optimizer": _optimizer_kind(optimizer)}).encode()}
        for name, data in files.items():
            _write_synced(tmp / name, data)
            sums[name] = hashlib.sha256(data).hexdigest()
        _write_synced(tmp / CHECKSUMS, json.dumps(dict(sorted(sums.items())), indent=1).encode())
        _fsync_dir(tmp)
        _kill_if(_kill_at, "before-rename", 0)
        replacing = final.exists()
        if replacing:  # saved by an earlier run that went further: set aside, dropped once replaced
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(final, aside)
        os.replace(tmp, final)  # atomic: the checkpoint appears whole or not at all
        done["renamed"] = True
        _fsync_dir(root)
        _kill_if(_kill_at, "after-rename", 0)
        if replacing:
            shutil.rmtree(aside, ignore_errors=True)
        older = [p for p in list_checkpoints(root) if _step_of(p) < step]
        for old in older[:max(0, len(older) - (keep - 1))] if keep > 0 else []:
            pruned = root / f".{old.name}.pruned"  # never a half-deleted step-N directory
            if pruned.exists():
                shutil.rmtree(pruned)
            os.replace(old, pruned)
            shutil.rmtree(pruned, ignore_errors=True)

    def failed(e: Exception) -> str:
        if done["renamed"]:
            return (f"checkpoint {final} is saved, but the older checkpoints could not be pruned ({_why(e)}, "
                    f"on process 0)")
        # put back the checkpoint of this step that was set aside for the new one; drop the unfinished one
        try:
            if aside.exists() and not final.exists():
                os.replace(aside, final)
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # clean() at the next start does it
        return (f"{unsaved}: {_why(e)} (on process 0, writing state.pt, config.toml, meta.json and {CHECKSUMS}); "
                f"{unchanged}")

    _on_rank0(finish, failed)
    return final


def _storage_files(meta) -> dict[str, int]:
    """The shard files a checkpoint's DCP metadata refers to, each with the size it must
    have at least."""
    need: dict[str, int] = {}
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need


def check(path: str | Path, collective: bool = True):
    """Check that ``path`` is a complete checkpoint whose files are all there at full size
    and, where it has ``checksums.json``, unchanged since they were written; return its DCP
    metadata; raise ``BadCheckpoint`` naming what is wrong. Every process of the group
    calls it (``collective``: the hashing is split over them, and each sees every hash),
    so every process reaches the same verdict; ``collective=False``: this process alone."""
    path = Path(path)
    if not path.is_dir():
        raise BadCheckpoint(f"checkpoint {path}: " + ("a file, not a checkpoint directory" if path.exists()
                                                      else "no such directory"))
    has = {name: (path / name).is_file() for name in (".metadata", "state.pt")}
    if not any(has.values()):
        if _NAME.match(path.name):  # a step-N directory only ever appears complete: this one was damaged
            raise DamagedCheckpoint(f"checkpoint {path} is incomplete: it has neither .metadata nor state.pt")
        # Someone gave the job's directory (or its checkpoints/): name the checkpoint they likely meant.
        newest = latest_checkpoint(path) or latest_checkpoint(path / "checkpoints")
        raise BadCheckpoint(f"checkpoint {path} is not a torchspmd checkpoint (it has neither .metadata nor state.pt); "
                            f"checkpoints are the step-NNNNNNNN directories under a job's out_dir/checkpoints"
                            + (f": the newest under it is {newest}" if newest else ""))
    for name, what in ((".metadata", "DCP's index of the model and optimizer shards"),
                       ("state.pt", "the step, learning-rate schedule and RNG state")):
        if not has[name]:
            raise DamagedCheckpoint(f"checkpoint {path} is incomplete: {name} ({what}) is missing")
    try:
        _well_formed_pickle((path / ".metadata").read_bytes())
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        files = _storage_files(meta)
    except Exception as e:
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: .metadata cannot be read ({_why(e)})") from None
    for name, size in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise DamagedCheckpoint(f"checkpoint {path} is incomplete: the shard file {name} is missing")
        have = f.stat().st_size
        if have < size:
            raise DamagedCheckpoint(f"checkpoint {path} is corrupt: the shard file {name} is truncated "
                                    f"({have} bytes, its index needs {size})")
    if (path / CHECKSUMS).is_file():
        try:
            expected = json.loads((path / CHECKSUMS).read_text())
            assert isinstance(expected, dict) and all(isinstance(v, str) for v in expected.values())
        except Exception:
            raise DamagedCheckpoint(f"checkpoint {path} is corrupt: {CHECKSUMS} cannot be read") from None
        names = sorted(n for n in expected if (path / n).is_file())
        got = _hashes(path, names, collective)
        changed = [n for n in names if got[n] != expected[n]]
        if changed:
            raise DamagedCheckpoint(f"checkpoint {path} is corrupt: the file {changed[0]} has changed since it was "
                                    f"written (its SHA-256 is not the one in {CHECKSUMS})"
                                    + (f", and {len(changed) - 1} more" if len(changed) > 1 else ""))
    return meta


_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _well_formed_pickle(data: bytes) -> bytes:
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


def _why(e: BaseException) -> str:
    """A short reason (torch.load's own message for garbage advises weights_only=False)."""
    if isinstance(e, pickle.UnpicklingError):
        return "UnpicklingError: its bytes are not what was written"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


class _NamingReader(dcp.FileSystemReader):
    """DCP's file reader that names the shard file it could not read."""

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                raise BadCheckpoint(f"the shard file {name} cannot be read ({_why(e)})") from None
        done: Future = Future()
        done.set_result(None)
        return done


def _corrupt(path: Path, e: CheckpointException) -> DamagedCheckpoint:
    """One message for a DCP read that failed on some process (every process gets all)."""
    rank, (exc, _) = sorted(e.failures.items())[0]
    detail = str(exc) if isinstance(exc, BadCheckpoint) else _why(exc)
    return DamagedCheckpoint(f"checkpoint {path} is corrupt: {detail} (on process {rank})")


def _read_state(path: Path) -> dict:
    """``state.pt``, read as torch reads untrusted files (``weights_only=True``: tensors,
    numbers, strings, containers; no other object is built, no code runs)."""
    try:
        return torch.load(path / "state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" in str(e).lower() and "unsupported global" in str(e).lower():
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = found.group(1) if found else "an object of another type"
            raise BadCheckpoint(
                f"checkpoint {path}: state.pt holds {what}, which is not read back (state.pt is loaded with "
                f"torch.load(weights_only=True)); save plain values in the state (numbers, strings, tensors, "
                f"lists, dicts), or allow the type with torch.serialization.add_safe_globals([...]) before "
                f"loading") from None
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: state.pt cannot be read ({_why(e)})") from None
    except Exception as e:
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: state.pt cannot be read ({_why(e)})") from None


def _model_differs(path: Path, meta, model_sd: dict) -> None:
    """Raise ``CheckpointMismatch`` naming the first weight the checkpoint and the model do
    not share (either way) or do not agree on the shape of."""
    there = {k[len("model."):] for k in meta.state_dict_metadata if k.startswith("model.")}
    lacking = [k for k in model_sd if k not in there]
    extra = sorted(there - set(model_sd))
    more = lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else ""  # noqa: E731
    if lacking:
        raise CheckpointMismatch(f"checkpoint {path}: it has no weights for {lacking[0]!r}{more(lacking)}; it was "
                                 f"saved from another model")
    if extra:
        raise CheckpointMismatch(f"checkpoint {path}: it has weights for {extra[0]!r}{more(extra)}, which this model "
                                 f"does not have; it was saved from another model (one with more layers or modules)")
    for key, value in model_sd.items():
        entry = meta.state_dict_metadata[f"model.{key}"]
        if hasattr(entry, "size") and tuple(entry.size) != tuple(value.shape):
            raise CheckpointMismatch(f"checkpoint {path}: {key!r} has shape {tuple(entry.size)} there and "
                                     f"{tuple(value.shape)} in this model; it was saved from a model of another shape")


def load(path: str | Path, model, optimizer) -> dict:
    """Load a checkpoint into ``model`` and ``optimizer`` (resharding as needed); return
    the rest of its state. A missing, incomplete or corrupt checkpoint raises
    ``BadCheckpoint`` on every process (``DamagedCheckpoint`` when incomplete or corrupt);
    one saved from another model or optimizer (other weights or shapes, another optimizer
    class, other parameter groups) raises ``CheckpointMismatch``. Both are found before
    anything is loaded: the model and the optimizer are then unchanged.

    The optimizer gets exactly the state the checkpoint holds: a parameter it holds none
    for (plain SGD keeps none, Adam has none before the parameter's first gradient) is left
    without, as in a fresh optimizer, and gets it at its next step."""
    path = Path(path)
    meta = check(path)
    model_sd = model.state_dict()
    _model_differs(path, meta, model_sd)
    saved_kind, kind = _read_meta(path).get("optimizer"), _optimizer_kind(optimizer)
    if saved_kind is not None and saved_kind != kind:
        raise CheckpointMismatch(f"checkpoint {path} was saved with another optimizer: a {saved_kind}, and this one "
                                 f"is a {kind}; load it into the kind of optimizer that saved it")
    state_rest = _read_state(path)  # before any collective: every process fails alike
    saved = _saved_optim_state(path, meta, model, optimizer)
    keys = meta.state_dict_metadata
    legacy = "optim.param_groups" not in keys and "optim.param_groups.0.lr" in keys
    if legacy:  # the groups' entries, loaded with the rest
        groups = pickle.loads(_well_formed_pickle(_optim_state(model, optimizer)["param_groups"]))
    else:  # the groups first (one small value): a mismatch stops before anything is loaded
        groups = _read_groups(path)
        differ = _groups_differ(groups, _group_names(model, optimizer))
        if differ:
            raise CheckpointMismatch(f"checkpoint {path} was saved with another optimizer: {differ}; build the "
                                     f"optimizer with the parameter groups of the one that saved it")
    optim = {"state": _optim_targets(path, saved, model, optimizer), **({"param_groups": groups} if legacy else {})}
    state = {"model": model_sd, "optim": optim}
    if _on_xla():  # loads in place into the sharded device tensors
        from torchspmd.backends import xla

        try:
            xla.dcp_load(state, str(path))
        except CheckpointException as e:
            raise _corrupt(path, e) from None
    else:
        try:
            dcp.load(state, storage_reader=_NamingReader(str(path)))
        except CheckpointException as e:
            raise _corrupt(path, e) from None
        model.load_state_dict(state["model"])
    _load_optim_state(model, optimizer, {"param_groups": groups, **state["optim"]})
    return state_rest


def load_full_model_state(path: str | Path, model: torch.nn.Module) -> None:
    """Load a checkpoint's model weights into a plain (unsharded) model in this one
    process, without a process group (for export and sampling)."""
    check(path, collective=False)
    sd = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():
            # One process on purpose (no_dist=True): DCP still warns that it assumes so.
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(sd, storage_reader=_NamingReader(str(path)), no_dist=True)
    except CheckpointException as e:
        raise _corrupt(Path(path), e) from None
    except BadCheckpoint as e:  # without a process group DCP does not wrap the error
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: {e}") from None
    model.load_state_dict(sd["model"])
