"""The global view's function mode, and the regions that step it aside.

The native engine enters one ``TorchFunctionMode`` for the whole process
(``implicit_replication``); code that meets no DTensor (a wrapped module's local compute, a
plain optimizer step, the loader's counts) steps it aside so that no operation pays for a
Python call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_MODE: list = []  # the mode the engine entered (at most one)


def set_mode(mode) -> None:
    _MODE[:] = [mode]


def mode():
    """The mode the engine entered, or None."""
    return _MODE[0] if _MODE else None


def suspend():
    """Step the lifting mode aside while it is the innermost mode; return what ``resume``
    needs to put it back (None when nothing was stepped aside)."""
    if _MODE and torch._C._len_torch_function_stack() > 0 and \
            torch.overrides._get_current_function_mode() is _MODE[0]:
        return torch._C._pop_torch_function_stack()
    return None


def resume(token) -> None:
    if token is not None:
        torch._C._push_on_torch_function_stack(token)


@contextlib.contextmanager
def local_region() -> Iterator[None]:
    """Inside a wrapped module's local compute there are no DTensors to meet: no operation
    there should pay for the lifting mode."""
    token = suspend()
    try:
        yield
    finally:
        resume(token)


def active() -> bool:
    """Whether the engine's mode is the innermost function mode now."""
    return bool(_MODE) and torch._C._len_torch_function_stack() > 0 and \
        torch.overrides._get_current_function_mode() is _MODE[0]


@contextlib.contextmanager
def as_it_was(was_active: bool) -> Iterator[None]:
    """Run with the engine's mode innermost if ``was_active``, else stepped aside: a forward
    recomputed in backward (activation checkpointing) runs as it ran the first time (the
    backward pass itself starts with the mode aside)."""
    if was_active and _MODE and not active():
        torch._C._push_on_torch_function_stack(_MODE[0])
        try:
            yield
        finally:
            torch._C._pop_torch_function_stack()
        return
    token = None if was_active else suspend()
    try:
        yield
    finally:
        resume(token)
