"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step-00000100`` holding the model's and optimizer's
shards (DCP, reshardable: load it on another number of devices), ``state.pt`` (the
rest: scheduler, sampler position, RNG states, step), and ``config.toml``. It is
written under a temporary name and renamed once complete, so a crash in the middle of
a save leaves the previous checkpoint as it was; only the newest ``keep`` are kept.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchspmd import runtime
from torchspmd._errors import SpmdError

_NAME = re.compile(r"^step-(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary ones are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / "state.pt").exists()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


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
        optim_sd = {**optim_sd, "param_groups": pickle.loads(optim_sd["param_groups"])}
    return optim_sd


def _load_optim_state(model, optimizer, named: dict) -> None:
    names = _names(model)
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    missing = [n for n in order if n not in named["state"]]
    if missing:
        raise SpmdError(f"checkpoint: no optimizer state for {missing[0]!r}; it was saved from another model")
    groups = named["param_groups"]
    if isinstance(groups, bytes):
        groups = pickle.loads(groups)
    optimizer.load_state_dict({
        "state": {index[n]: v for n, v in named["state"].items() if n in index},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                         for g in groups],
    })


def save(root: str | Path, step: int, model, optimizer, state: dict[str, Any], config_toml: str,
         keep: int = 2, _fail_after_shards: bool = False) -> Path:
    """Write checkpoint ``step`` under ``root`` (every process calls it)."""
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    sd = {"model": model.state_dict(), "optim": _optim_state(model, optimizer)}
    if _on_xla():  # torch_xla's planners write each device's shards; the layout and keys are the same
        from torchspmd.backends import xla

        xla.dcp_save(sd, str(tmp))
    else:
        dcp.save(sd, checkpoint_id=str(tmp))
    if _fail_after_shards:  # tests: a crash between the shards and the rest
        raise RuntimeError("simulated crash during checkpoint save")
    if _rank() == 0:
        torch.save(state, tmp / "state.pt")
        (tmp / "config.toml").write_text(config_toml)
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": runtime.global_runtime_device_count()
                                                   if runtime.is_spmd() else 1}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: the checkpoint appears whole or not at all
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(path: str | Path, model, optimizer) -> dict:
    """Load a checkpoint into ``model`` and ``optimizer`` (resharding as needed); return
    the rest of its state."""
    path = Path(path)
    if not (path / "state.pt").exists() or not (path / ".metadata").exists():
        raise SpmdError(f"checkpoint {path}: not a complete torchspmd checkpoint (state.pt or .metadata missing)")
    model_sd = model.state_dict()
    _ensure_optim_state(optimizer)
    optim_sd = _optim_state(model, optimizer)
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise SpmdError(f"checkpoint {path}: cannot read its metadata ({e}); it is corrupt") from None
    for key, value in model_sd.items():
        entry = meta.state_dict_metadata.get(f"model.{key}")
        if entry is None:
            raise SpmdError(f"checkpoint {path}: it has no weights for {key!r}; it was saved from another model")
        if hasattr(entry, "size") and tuple(entry.size) != tuple(value.shape):
            raise SpmdError(f"checkpoint {path}: {key!r} has shape {tuple(entry.size)} there and {tuple(value.shape)} "
                            f"in this model; it was saved from a model of another shape")
    state = {"model": model_sd, "optim": _as_saved(optim_sd, meta.state_dict_metadata)}
    if _on_xla():  # loads in place into the sharded device tensors
        from torchspmd.backends import xla

        xla.dcp_load(state, str(path))
    else:
        dcp.load(state, checkpoint_id=str(path))
        model.load_state_dict(state["model"])
    _load_optim_state(model, optimizer, state["optim"])
    return torch.load(path / "state.pt", weights_only=False)


def load_full_model_state(path: str | Path, model: torch.nn.Module) -> None:
    """Load a checkpoint's model weights into a plain (unsharded) model in this one
    process, without a process group (for export and sampling)."""
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(sd["model"])
