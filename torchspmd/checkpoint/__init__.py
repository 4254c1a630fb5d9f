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

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchspmd import engines, faults, runtime
from torchspmd.checkpoint_format import files as checkpoint_files
from torchspmd.checkpoint_format.files import (
    CHECKSUMS,
    BadCheckpoint,
    CheckpointMismatch,
    DamagedCheckpoint,
    NamingReader,
    corrupt,
    fsync_dir,
    hashes,
    on_rank0,
    rank,
    shards_failed,
    storage_files,
    well_formed_pickle,
    why,
    world,
)
from torchspmd.errors import SpmdError
from torchspmd.checkpoint.optimizer_state import (
    groups_differ,
    whole_group_names,
    load_optim_state,
    optim_state,
    optim_targets,
    optimizer_kind,
    read_groups,
    saved_optim_state,
)

__all__ = ["save", "load", "check", "clean", "list_checkpoints", "latest_checkpoint", "load_full_model_state",
           "BadCheckpoint", "DamagedCheckpoint", "CheckpointMismatch"]


NAME = re.compile(r"^step-(\d{8})$")


_LEFTOVER = re.compile(r"^\.step-(\d{8})\.(tmp|replaced|pruned)$")


def step_of(path: Path) -> int:
    return int(NAME.match(path.name).group(1))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoints under ``root``, oldest first. A ``step-N`` directory only ever appears
    complete (renamed into place), so every one is listed: a damaged one is reported
    when it is loaded rather than silently passed over. Temporary ones are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and NAME.match(p.name)), key=step_of)


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
            fsync_dir(root)
        return removed

    return on_rank0(work, lambda e: f"checkpoints {root}: what interrupted saves left there cannot be removed "
                                     f"({why(e)}, on process 0)")


def save(root: str | Path, step: int, model, optimizer, state: dict[str, Any], config_toml: str,
         keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``root`` (every process calls it) and keep the
    newest ``keep`` (0: all).

    A save that fails (a full disk, a process that cannot write its shards) raises the
    same ``SpmdError`` on every process, naming the checkpoint and the cause, and leaves
    the checkpoints saved before it as they were.

    The tests inject faults here through ``torchspmd.faults`` (a crash once the shards are
    written, a process killed at a point of the save).
    """
    writing = _Save(Path(root), step)
    on_rank0(writing.make_tmp, lambda e: f"{writing.unsaved}: {writing.tmp} cannot be made ({why(e)}, on process 0); "
                                         f"{writing.unchanged}")
    sums = writing.shards(model, optimizer)
    on_rank0(lambda: writing.finish(sums, state, config_toml, optimizer, keep), writing.failed)
    return writing.final


class _Save:
    """The steps of one save: a temporary directory; every process's shards (DCP) and their
    hashes; then, on rank 0, the other files, the atomic rename and the pruning."""

    unchanged = "the checkpoints saved before it are unchanged"

    def __init__(self, root: Path, step: int):
        self.root, self.step = root, step
        self.final = root / f"step-{step:08d}"
        self.tmp = root / f".step-{step:08d}.tmp"
        self.aside = root / f".step-{step:08d}.replaced"
        self.unsaved = f"checkpoint {self.final} was not saved"
        self.renamed = False

    def make_tmp(self) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)

    def shards(self, model, optimizer) -> dict[str, str]:
        """The model's and optimizer's shards, written by every process; their SHA-256 sums."""
        sd = {"model": model.state_dict(), "optim": optim_state(model, optimizer)}
        try:
            engines.current("checkpoint save").save_state(sd, faults.storage_writer(str(self.tmp), self.step, world()))
        except CheckpointException as e:
            # DCP's exception is a BaseException (``except Exception`` misses it) that names only the
            # ranks. Every process has it (DCP gathers the failures): none writes any more, so rank 0
            # can drop the unfinished directory (a full disk gets its space back).
            if rank() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise SpmdError(f"{self.unsaved}: {shards_failed(e)}; {self.unchanged}") from None
        faults.fail_after_shards(self.step)  # tests: a crash between the shards and the rest
        # (DCP's save returns once its .metadata is written: every process can read it)
        shards = sorted(storage_files(dcp.FileSystemReader(str(self.tmp)).read_metadata()))
        return hashes(self.tmp, [".metadata", *shards], collective=True)

    def finish(self, sums: dict[str, str], state: dict, config_toml: str, optimizer, keep: int) -> None:
        """Rank 0: state.pt, config.toml, meta.json and the checksums, synced; the rename that
        completes the checkpoint; the older ones pruned."""
        buf = io.BytesIO()
        torch.save(state, buf)
        files = {"state.pt": buf.getvalue(), "config.toml": config_toml.encode(),
                 "meta.json": json.dumps({"step": self.step, "world_size": runtime.global_runtime_device_count()
                                          if runtime.is_spmd() else 1,
                                          "optimizer": optimizer_kind(optimizer)}).encode()}
        for name, data in files.items():
            checkpoint_files.write_synced(self.tmp / name, data)
            sums[name] = hashlib.sha256(data).hexdigest()
        checkpoint_files.write_synced(self.tmp / CHECKSUMS, json.dumps(dict(sorted(sums.items())), indent=1).encode())
        fsync_dir(self.tmp)
        faults.in_save(self.step, "before-rename", 0)
        replacing = self.final.exists()
        if replacing:  # saved by an earlier run that went further: set aside, dropped once replaced
            if self.aside.exists():
                shutil.rmtree(self.aside)
            os.replace(self.final, self.aside)
        os.replace(self.tmp, self.final)  # atomic: the checkpoint appears whole or not at all
        self.renamed = True
        fsync_dir(self.root)
        faults.in_save(self.step, "after-rename", 0)
        if replacing:
            shutil.rmtree(self.aside, ignore_errors=True)
        self.prune(keep)

    def prune(self, keep: int) -> None:
        older = [p for p in list_checkpoints(self.root) if step_of(p) < self.step]
        for old in older[:max(0, len(older) - (keep - 1))] if keep > 0 else []:
            pruned = self.root / f".{old.name}.pruned"  # never a half-deleted step-N directory
            if pruned.exists():
                shutil.rmtree(pruned)
            os.replace(old, pruned)
            shutil.rmtree(pruned, ignore_errors=True)

    def failed(self, e: Exception) -> str:
        """Rank 0's message for every process when ``finish`` raised (what was done undone)."""
        if self.renamed:
            return (f"checkpoint {self.final} is saved, but the older checkpoints could not be pruned ({why(e)}, "
                    f"on process 0)")
        # put back the checkpoint of this step that was set aside for the new one; drop the unfinished one
        try:
            if self.aside.exists() and not self.final.exists():
                os.replace(self.aside, self.final)
            shutil.rmtree(self.tmp, ignore_errors=True)
        except OSError:
            pass  # clean() at the next start does it
        return (f"{self.unsaved}: {why(e)} (on process 0, writing state.pt, config.toml, meta.json and "
                f"{CHECKSUMS}); {self.unchanged}")


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
        if NAME.match(path.name):  # a step-N directory only ever appears complete: this one was damaged
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
        well_formed_pickle((path / ".metadata").read_bytes())
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        files = storage_files(meta)
    except Exception as e:
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: .metadata cannot be read ({why(e)})") from None
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
        got = hashes(path, names, collective)
        changed = [n for n in names if got[n] != expected[n]]
        if changed:
            raise DamagedCheckpoint(f"checkpoint {path} is corrupt: the file {changed[0]} has changed since it was "
                                    f"written (its SHA-256 is not the one in {CHECKSUMS})"
                                    + (f", and {len(changed) - 1} more" if len(changed) > 1 else ""))
    return meta


def read_meta(path: Path) -> dict:
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


def read_state(path: Path) -> dict:
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
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: state.pt cannot be read ({why(e)})") from None
    except Exception as e:
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: state.pt cannot be read ({why(e)})") from None


def model_differs(path: Path, meta, model_sd: dict, model=None) -> None:
    """Raise ``CheckpointMismatch`` naming the first weight the checkpoint and the model do
    not share (either way) or do not agree on the shape of. A ``model`` split over the
    processes (pipeline stages: ``gather_keys``), each holding part of its state, is compared
    as a whole, and every process raises the same error."""
    gather = getattr(model, "gather_keys", None)
    whole = gather(model_sd) if gather is not None else set(model_sd)
    why_not = _model_mismatch(path, meta, model_sd, whole)
    if gather is not None:  # every process decides alike: the first process's finding, else the next...
        import torch.distributed as dist

        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, why_not)
        why_not = next((f for f in found if f is not None), None)
    if why_not is not None:
        raise CheckpointMismatch(why_not)


def _model_mismatch(path: Path, meta, model_sd: dict, whole: set) -> str | None:
    there = {k[len("model."):] for k in meta.state_dict_metadata if k.startswith("model.")}
    lacking = [k for k in model_sd if k not in there] + sorted(whole - set(model_sd) - there)
    extra = sorted(there - whole)
    more = lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else ""  # noqa: E731
    if lacking:
        return f"checkpoint {path}: it has no weights for {lacking[0]!r}{more(lacking)}; it was saved from another model"
    if extra:
        return (f"checkpoint {path}: it has weights for {extra[0]!r}{more(extra)}, which this model does not have; it "
                f"was saved from another model (one with more layers or modules)")
    for key, value in model_sd.items():
        entry = meta.state_dict_metadata[f"model.{key}"]
        if hasattr(entry, "size") and tuple(entry.size) != tuple(value.shape):
            return (f"checkpoint {path}: {key!r} has shape {tuple(entry.size)} there and {tuple(value.shape)} in this "
                    f"model; it was saved from a model of another shape")
    return None


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
    model_differs(path, meta, model_sd, model)
    saved_kind, kind = read_meta(path).get("optimizer"), optimizer_kind(optimizer)
    if saved_kind is not None and saved_kind != kind:
        raise CheckpointMismatch(f"checkpoint {path} was saved with another optimizer: a {saved_kind}, and this one "
                                 f"is a {kind}; load it into the kind of optimizer that saved it")
    state_rest = read_state(path)  # before any collective: every process fails alike
    saved = saved_optim_state(path, meta, model, optimizer)
    keys = meta.state_dict_metadata
    legacy = "optim.param_groups" not in keys and "optim.param_groups.0.lr" in keys
    if legacy:  # the groups' entries, loaded with the rest
        groups = pickle.loads(well_formed_pickle(optim_state(model, optimizer)["param_groups"]))
    else:  # the groups first (one small value): a mismatch stops before anything is loaded
        groups = read_groups(path)
        differ = groups_differ(groups, whole_group_names(model, optimizer))
        if differ:
            raise CheckpointMismatch(f"checkpoint {path} was saved with another optimizer: {differ}; build the "
                                     f"optimizer with the parameter groups of the one that saved it")
    optim = {"state": optim_targets(path, saved, model, optimizer), **({"param_groups": groups} if legacy else {})}
    state = {"model": model_sd, "optim": optim}
    engine = engines.current("checkpoint load")
    try:
        engine.load_state(state, NamingReader(str(path)))
    except CheckpointException as e:
        raise corrupt(path, e) from None
    if not engine.capabilities.checkpoint_in_place:
        model.load_state_dict(state["model"])
    load_optim_state(model, optimizer, {"param_groups": groups, **state["optim"]})
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
            dcp.load(sd, storage_reader=NamingReader(str(path)), no_dist=True)
    except CheckpointException as e:
        raise corrupt(Path(path), e) from None
    except BadCheckpoint as e:  # without a process group DCP does not wrap the error
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: {e}") from None
    model.load_state_dict(sd["model"])
