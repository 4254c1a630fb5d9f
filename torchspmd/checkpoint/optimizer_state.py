"""An optimizer's state keyed by parameter names, so that a checkpoint reshards: saved,
compared with another optimizer's, and loaded into one.

``optim_state`` gives ``{"state": {parameter name: {entry: value}}, "param_groups": pickled
groups}``; the groups are one pickled value, because DCP's planner flattens containers into
per-key entries and torch_xla's keeps those without tensors whole, so one value is what both
engines store alike.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchspmd import engines
from torchspmd.checkpoint_format.files import (
    BadCheckpoint,
    CheckpointMismatch,
    DamagedCheckpoint,
    NamingReader,
    corrupt,
    well_formed_pickle,
    why,
)


def parameter_names(model) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optim_state(model, optimizer) -> dict:
    """The optimizer's state keyed by parameter names (so that it can be resharded). The
    groups (hyper-parameters) are one pickled value: DCP's planner flattens containers
    into per-key entries and torch_xla's keeps those without tensors whole, so one value is
    what both engines store alike. Of a model split over the processes (pipeline stages),
    the groups name every process's parameters."""
    names = parameter_names(model)
    sd = optimizer.state_dict()
    ids = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {ids[i]: v for i, v in sd["state"].items()}
    whole = whole_group_names(model, optimizer)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": whole[i]}
              for i, g in enumerate(sd["param_groups"])]
    return {"state": state, "param_groups": pickle.dumps(groups)}


def as_saved(optim_sd: dict, keys, prefix: str = "optim") -> dict:
    """The optimizer target in the layout of a checkpoint written before the groups were
    one value (DCP had flattened them, a key per group entry)."""
    if f"{prefix}.param_groups" not in keys and f"{prefix}.param_groups.0.lr" in keys:
        optim_sd = {**optim_sd, "param_groups": pickle.loads(well_formed_pickle(optim_sd["param_groups"]))}
    return optim_sd


#: Optimizer options that choose how this process computes the step, not what it computes:
#: a checkpoint's groups do not override them (a run on another engine or device, e.g. a
#: fused AdamW on CPU resumed on XLA, where the fused kernel does not exist, keeps its own).
_IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


def group_names(model, optimizer) -> list[list[str]]:
    names = parameter_names(model)
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def whole_group_names(model, optimizer) -> list[list[str]]:
    """``group_names``; of a model split over the processes, each holding a part (a pipeline
    runner: ``gather_group_names``), the groups' names over every process (a collective)."""
    own = group_names(model, optimizer)
    gather = getattr(model, "gather_group_names", None)
    return gather(own) if gather is not None else own


def groups_differ(saved: list[dict], own: list[list[str]]) -> str | None:
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


def load_optim_state(model, optimizer, named: dict) -> None:
    """Load ``named`` (``optim_state``'s layout, read from a checkpoint) into
    ``optimizer``. A parameter without an entry in ``named["state"]`` is left without
    state, as in a fresh optimizer: the checkpoint had none for it (plain SGD keeps none;
    Adam has none before a parameter's first gradient). The groups are matched by their
    parameters' names, each group's in this optimizer's own order: ``load_state_dict``
    pairs the saved parameters with its own by position."""
    own = group_names(model, optimizer)
    index = {n: i for i, n in enumerate(n for group in own for n in group)}
    groups = named["param_groups"]
    if isinstance(groups, bytes):
        groups = pickle.loads(well_formed_pickle(groups))
    differ = groups_differ(groups, whole_group_names(model, optimizer))
    if differ:
        raise CheckpointMismatch(f"checkpoint: it was saved with another optimizer: {differ}")
    impl = [{k: g[k] for k in _IMPLEMENTATION_OPTIONS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict({
        "state": {index[n]: v for n, v in named["state"].items() if n in index},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, **impl[i],
                          "params": [index[n] for n in own[i]]} for i, g in enumerate(groups)],
    })


def optimizer_kind(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def saved_optim_state(path: Path, meta, model, optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer state the checkpoint holds: ``{parameter name: {entry: DCP metadata}}``
    (``optim.state.<name>.<entry>``). A parameter it holds none for is absent."""
    own = {n for group in whole_group_names(model, optimizer) for n in group}
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


def optim_targets(path: Path, saved: dict[str, dict[str, Any]], model, optimizer) -> dict[str, dict[str, Any]]:
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
    saved = {name: entries for name, entries in saved.items() if name in params}  # (a split model: this part's)
    if not saved:
        return {}
    if not engines.current("checkpoint load").capabilities.checkpoint_in_place:
        def target(param, md):
            if not isinstance(md, TensorStorageMetadata):
                return b""
            if tuple(md.size) == tuple(param.shape):
                return torch.zeros_like(param.detach(), dtype=md.properties.dtype)
            return torch.zeros(tuple(md.size), dtype=md.properties.dtype)

        return {name: {entry: target(params[name], md) for entry, md in entries.items()}
                for name, entries in saved.items()}
    ensure_optim_state(optimizer)
    primed = optim_state(model, optimizer)["state"]
    targets: dict[str, dict[str, Any]] = {}
    for name, entries in saved.items():
        lacking = [e for e in entries if e not in primed.get(name, {})]
        if lacking:
            raise CheckpointMismatch(
                f"checkpoint {path} was saved with another optimizer (or other settings of it): its state for "
                f"{name!r} has {lacking[0]!r}, which this optimizer does not keep")
        targets[name] = {e: primed[name][e] for e in entries}
    return targets


def read_groups(path: Path) -> list[dict]:
    """The checkpoint's optimizer parameter groups (one pickled value), read by this
    process alone (no collective: every process reads the same and decides alike)."""
    target = {"optim": {"param_groups": b""}}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(target, storage_reader=NamingReader(str(path)), no_dist=True)
        return pickle.loads(well_formed_pickle(target["optim"]["param_groups"]))
    except CheckpointException as e:
        raise corrupt(path, e) from None
    except Exception as e:
        detail = (str(e) if isinstance(e, BadCheckpoint)
                  else f"the optimizer's parameter groups cannot be read ({why(e)})")
        raise DamagedCheckpoint(f"checkpoint {path} is corrupt: {detail}") from None


def ensure_optim_state(optimizer) -> None:
    """Create the optimizer's state (e.g. Adam's moments) if it has none yet, without
    changing any parameter (the engine's ``prime_optimizer``: a step with zero gradients
    and a learning rate of 0)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    engines.current("checkpoint load").prime_optimizer(optimizer)
