"""Pipeline stages' plan: where the model is cut (before the modules that begin each stage,
chosen so that the stages hold about equal parameters) and which parameters each stage uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from torchspmd.errors import SpmdError

__all__ = ["StagePlan", "plan_stages", "parent_and_leaf"]


#: schedule name -> (torch.distributed.pipelining class, stages per process)
@dataclass(frozen=True)
class StagePlan:
    """Which module names begin each stage after the first, and which parameters (by name,
    as the model names them) each stage holds."""

    starts: tuple[str, ...]
    params: tuple[tuple[str, ...], ...]
    #: the number of the model's parameters (elements) in each stage, for balance reports
    sizes: tuple[int, ...]


def parent_and_leaf(root: nn.Module, name: str):
    *path, leaf = name.split(".")
    mod = root
    for p in path:
        mod = getattr(mod, p)
    return mod, leaf


def plan_stages(model: nn.Module, num_stages: int, layers: list[str]) -> StagePlan:
    """Cut ``model`` into ``num_stages`` runs of the consecutive modules ``layers`` (names, in
    the model's order), balanced by parameter count; the modules registered before the first
    layer belong to the first stage, those after the last to the last stage."""
    if len(layers) < num_stages:
        raise SpmdError(f"pipeline(split=...): {num_stages} stages need at least {num_stages} split points "
                        f"(layers); the model has {len(layers)}: use fewer stages on the 'pipeline' axis")
    size_of = {n: sum(p.numel() for p in model.get_submodule(n).parameters()) for n in layers}
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]

    def owner(pname: str) -> str | None:
        for layer in layers:
            if pname.startswith(layer + "."):
                return layer
        return None

    # before or after the layers by the order the modules are registered in (the layers
    # may hold no parameters at all: a parameter's place among the layers' is no guide then)
    modules = [n for n, _ in model.named_modules(remove_duplicate=False)]
    first_layer_at = modules.index(layers[0])

    def before(pname: str) -> bool:
        return modules.index(pname.rpartition(".")[0]) < first_layer_at

    pre = sum(model.get_parameter(n).numel() for n in names if owner(n) is None and before(n))
    post = sum(model.get_parameter(n).numel() for n in names if owner(n) is None and not before(n))
    # cumulative size at the start of each layer, the first stage's extra modules included
    cum = [pre]
    for n in layers:
        cum.append(cum[-1] + size_of[n])
    total = cum[-1] + post
    starts_at = []
    lo = 1
    for k in range(1, num_stages):
        target = total * k / num_stages
        hi = len(layers) - (num_stages - k)  # leave a layer for each later stage
        best = min(range(lo, hi + 1), key=lambda i: (abs(cum[i] - target), i))
        starts_at.append(best)
        lo = best + 1
    bounds = [0, *starts_at, len(layers)]
    stage_of_layer = {layers[i]: k for k in range(num_stages) for i in range(bounds[k], bounds[k + 1])}
    params: list[list[str]] = [[] for _ in range(num_stages)]
    for n in names:
        layer = owner(n)
        k = stage_of_layer[layer] if layer is not None else (0 if before(n) else num_stages - 1)
        params[k].append(n)
    sizes = []
    for k in range(num_stages):
        seen = {}
        for n in params[k]:
            p = model.get_parameter(n)
            seen[id(p)] = p.numel()
        sizes.append(sum(seen.values()))
    return StagePlan(tuple(layers[i] for i in starts_at), tuple(tuple(p) for p in params), tuple(sizes))
