"""Optimizer steps outside the global view's function mode.

A data-parallel program's optimizer holds plain replicated parameters: its step can meet no
DTensor, and runs without the mode, paying no Python call per operation, as under DDP.
Every optimizer class's step is wrapped (``torchspmd.patches.torch.OPTIMIZER_STEPS``); the
step hooks still run under the mode.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from torchspmd.engines.native.start.global_mode import resume, suspend
from torchspmd.patches import torch as torch_patches


def _all_plain(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    """Whether an optimizer step can meet no DTensor: no closure (a closure runs the
    program's forward), and plain parameters, gradients and state."""
    if any(a is not None for a in args[1:]) or any(v is not None for v in kwargs.values()):
        return False
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(p, DTensor) or isinstance(p.grad, DTensor):
                return False
    return not any(isinstance(v, DTensor) for state in opt.state.values() for v in state.values())


def _plain_step(func: Callable) -> Callable:
    """``func`` (an optimizer class's step) run without the mode when it can meet no DTensor."""

    @functools.wraps(func)
    def step(*args, **kwargs):
        if torch.compiler.is_compiling():  # a compiled step: left to torch.compile as it is
            return func(*args, **kwargs)
        token = suspend()  # (reading p.grad under the mode would be a call of its own)
        if token is not None and not _all_plain(args[0], args, kwargs):
            resume(token)
            token = None
        try:
            return func(*args, **kwargs)
        finally:
            resume(token)

    return step


def install() -> None:
    torch_patches.wrap_optimizer_steps(_plain_step)
