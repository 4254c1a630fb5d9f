"""``torch_xla.experimental.distributed_checkpoint`` under ``--xla-compat``, on
``torch.distributed.checkpoint`` (DCP).

``SPMDSavePlanner`` / ``SPMDLoadPlanner`` are DCP's default planners (a state dict of
DTensors is what DCP shards natively), with torch_xla's ``sharded_state_dict`` and
``unsharded_state_dict`` views of the state dict they were set up with. ``CheckpointManager`` keeps numbered checkpoints
under ``path``: each is written as ``.<step>.tmp`` and renamed to ``<step>`` once every
process has written its shards, so a failed save never damages an earlier checkpoint;
``save_async`` saves before returning (the native engine has no device-to-host queue to
overlap with). Preemption detection is TPU-only: ``reached_preemption`` is False."""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, SavePlan
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from torchspmd.checkpoint_format.files import barrier, fsync_dir, rank
from torchspmd.compat.stand_ins import not_provided
from torchspmd.errors import SpmdError


def _split_over_devices(t) -> bool:
    """Whether ``t`` is a DTensor that some mesh axis of more than one device splits."""
    return isinstance(t, DTensor) and any(
        p.is_shard() and t.device_mesh.size(axis) > 1 for axis, p in enumerate(t.placements))


class _Separated:
    """torch_xla's planners' view of the (flattened) state dict they were set up with:
    ``sharded_state_dict`` (the tensors split over devices) and ``unsharded_state_dict`` (the
    others, a tensor annotated as replicated included)."""

    @property
    def sharded_state_dict(self) -> dict:
        return {k: v for k, v in self.state_dict.items() if _split_over_devices(v)}

    @property
    def unsharded_state_dict(self) -> dict:
        return {k: v for k, v in self.state_dict.items() if not _split_over_devices(v)}


class SPMDSavePlanner(_Separated, DefaultSavePlanner):
    """DCP's save planner (sharded tensors are DTensors here). A sharded tensor's write item
    names its shard's place in ``local_shards`` (``index.index``), as torch_xla's does: this
    process holds one shard, at 0."""

    def create_local_plan(self) -> SavePlan:
        made = super().create_local_plan()
        fresh = made is self.plan
        self.plan = dataclasses.replace(self.plan, items=[
            dataclasses.replace(item, index=dataclasses.replace(item.index, index=0))
            if item.type == WriteItemType.SHARD and item.index.index is None else item
            for item in self.plan.items])
        return self.plan if fresh else made


class SPMDLoadPlanner(_Separated, DefaultLoadPlanner):
    """DCP's load planner: values are loaded into the state dict's tensors in place,
    resharded to their layouts."""


def _sync_dir(path: str) -> None:
    fsync_dir(Path(path))


class CheckpointManager:
    """Numbered DCP checkpoints under ``path``, one every ``save_interval`` steps, the
    newest ``max_to_keep`` kept (0: all)."""

    def __init__(self, path: str, save_interval: int, max_to_keep: int | None = 0,
                 max_pending_async: int | None = 1, num_of_threads: int | None = 1, process_group=None,
                 chkpt_on_preemption: bool = True):
        if not isinstance(save_interval, int) or save_interval < 1:
            raise SpmdError(f"CheckpointManager(save_interval={save_interval!r}): give a positive number of steps")
        self.base_path = os.fspath(path)
        self.save_interval = save_interval
        self.max_to_keep = max_to_keep or 0
        self.process_group = process_group
        self.chkpt_on_preemption = chkpt_on_preemption
        if rank() == 0:
            os.makedirs(self.base_path, exist_ok=True)
            for name in os.listdir(self.base_path):  # what an interrupted save left
                if name.startswith(".") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.base_path, name), ignore_errors=True)
        barrier()

    def _path(self, step: int) -> str:
        return os.path.join(self.base_path, str(step))

    def all_steps(self) -> list[int]:
        steps = []
        for name in os.listdir(self.base_path):
            if name.isdigit() and os.path.isfile(os.path.join(self.base_path, name, ".metadata")):
                steps.append(int(name))
        return sorted(steps)

    def should_save(self, step: int) -> bool:
        return step % self.save_interval == 0

    def reached_preemption(self, step: int) -> bool:
        return False

    def _save(self, step: int, state_dict) -> None:
        final = self._path(step)
        tmp = os.path.join(self.base_path, f".{step}.tmp")
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is not initialized.*")
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                     planner=SPMDSavePlanner(), process_group=self.process_group)
        if rank() == 0:
            _sync_dir(tmp)
            old = None
            if os.path.exists(final):
                old = os.path.join(self.base_path, f".{step}.replaced.tmp")
                os.replace(final, old)
            os.replace(tmp, final)
            _sync_dir(self.base_path)
            if old:
                shutil.rmtree(old, ignore_errors=True)
            if self.max_to_keep > 0:
                for s in self.all_steps()[:-self.max_to_keep]:
                    shutil.rmtree(self._path(s), ignore_errors=True)
        barrier()

    def save(self, step: int, state_dict, force: bool | None = False) -> bool:
        if self.should_save(step) or force:
            self._save(step, state_dict)
            return True
        return False

    def save_async(self, step: int, state_dict, force: bool | None = False) -> bool:
        """As ``save`` (the checkpoint is complete when it returns)."""
        return self.save(step, state_dict, force)

    def restore(self, step: int, state_dict) -> None:
        path = self._path(step)
        if not os.path.isfile(os.path.join(path, ".metadata")):
            have = self.all_steps()
            raise SpmdError(f"CheckpointManager.restore(step={step}): no complete checkpoint at {path}; "
                            f"steps saved: {have or 'none'}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is not initialized.*")
            dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), planner=SPMDLoadPlanner(),
                     process_group=self.process_group)

    def join(self) -> None:
        """Nothing pending: saves complete before returning."""


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create the optimizer's state (as torch_xla does: one step with zero gradients), so that
    ``optimizer.state_dict()`` has the tensors a restore loads into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


__getattr__ = not_provided("torch_xla.experimental.distributed_checkpoint")
