"""``torch_xla.experimental.gradient_accumulation`` under ``--xla-compat``: ``gradient_accumulation``.

torch_xla traces ``train_step`` once into XLA's ``While`` loop over the leading dim of the
iterable tensors; the native engine runs eagerly, so the loop is a Python loop with the same
results: each micro-step's loss divided by the number of steps and backpropagated (the
gradients accumulate into the parameters' ``.grad``, added to what they held), the carried
tensors handed from one step to the next, and the divided losses summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from torchspmd.compat.stand_ins import not_provided

__all__ = ["GradientAccumulationContext", "gradient_accumulation"]


@dataclass(frozen=True)
class GradientAccumulationContext:
    """torch_xla's record of a loop: steps, iterable and carried tensor counts."""

    num_gradient_steps: int
    num_iterable_tensors: int
    num_carried_tensors: int


def gradient_accumulation(train_step: Callable[..., Any], iterable_tensors: tuple, model: torch.nn.Module,
                          *carried_tensors: torch.Tensor):
    """``train_step(*[t[i] for t in iterable_tensors], *carried)`` for each ``i`` along the
    iterable tensors' leading dim; returns the accumulated loss (and the carried tensors after
    the last step when there are some), the parameters' gradients accumulated. Checks its
    arguments as torch_xla does (``ValueError``)."""
    if not iterable_tensors:
        raise ValueError("iterable_tensors cannot be empty")
    steps = iterable_tensors[0].size(0)
    for i, tensor in enumerate(iterable_tensors):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"Element {i} of iterable_tensors is not a tensor")
        if tensor.numel() == 0:
            raise ValueError(f"Element {i} of iterable_tensors is empty")
        if tensor.size(0) != steps:
            raise ValueError(f"Element {i} of iterable_tensors has inconsistent first dimension")
    carried = list(carried_tensors)
    total = None
    for i in range(steps):
        result = train_step(*(t[i] for t in iterable_tensors), *carried)
        if carried_tensors:
            loss, *carried = result
        else:
            loss = result
        loss = loss / steps
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return (total, *carried) if carried_tensors else total


__getattr__ = not_provided("torch_xla.experimental.gradient_accumulation")
