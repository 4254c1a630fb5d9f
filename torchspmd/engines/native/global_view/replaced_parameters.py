"""Parameters torchspmd replaced, and the optimizers that still hold them.

``FSDPv2`` and an in-place ``mark_sharding`` put new (sharded) parameters in the model's
modules. An optimizer built before that holds the old tensors: its steps would update
tensors the model no longer uses, and the model would never train, without an error
(torch_xla shards in place, so a program written for it may build its optimizer first).
The old tensors are tagged; from the first tag on, every optimizer's step checks once
(again only when its parameters or the tags change) that it holds none of them.

Sharded parameters that ``FSDPv2`` made are tagged too, so that wrapping or annotating
them again, in the wrong order, is refused with the fix rather than a puzzle.
"""

from __future__ import annotations

import weakref

import torch

from torchspmd.errors import SpmdError

_REPLACED = "_torchspmd_replaced"  # on an old parameter: how it was replaced
_FSDP = "_torchspmd_fsdpv2"  # on a parameter FSDPv2 made: True
_generation = 0
_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_hook = None


def mark_replaced(old: torch.Tensor, how: str) -> None:
    """``old`` (a parameter) was replaced in its modules; ``how`` names it and says by
    what, e.g. "parameter 'fc1.weight', which FSDPv2 replaced with its shard"."""
    global _generation, _hook
    if not (isinstance(old, torch.nn.Parameter) or (old.is_leaf and old.requires_grad)):
        return
    setattr(old, _REPLACED, how)
    _generation += 1
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook = register_optimizer_step_pre_hook(_check)


def replaced(t: torch.Tensor) -> str | None:
    return getattr(t, _REPLACED, None)


def mark_fsdp(p: torch.Tensor) -> None:
    setattr(p, _FSDP, True)


def made_by_fsdp(p: torch.Tensor) -> bool:
    return getattr(p, _FSDP, False)


def _check(optimizer, args, kwargs):
    # (what the check depends on, per group, not per parameter: a step costs O(groups) here)
    key = (_generation, tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups))
    if _checked.get(optimizer) == key:
        return None
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        how = replaced(p)
        if how is not None:
            name = type(optimizer).__name__
            raise SpmdError(
                f"{name}.step(): this optimizer holds {how}; the model no longer uses the tensor "
                f"the optimizer was given, so the step would not train it. Build the optimizer after "
                f"wrapping and annotating the model: optimizer = torch.optim.{name}(model.parameters(), ...)"
            )
    _checked[optimizer] = key
    return None
