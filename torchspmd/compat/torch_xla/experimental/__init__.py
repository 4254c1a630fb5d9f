"""``torch_xla.experimental`` under ``--xla-compat``: the eager-mode switch (the native engine
always runs operations as they are issued: torch_xla's eager mode is its only mode)."""

from __future__ import annotations

import contextlib

from torchspmd.compat.stand_ins import not_provided

__all__ = ["eager_mode", "is_eager_mode", "eager_mode_context"]


def eager_mode(enable: bool) -> None:
    """Nothing to switch: operations run eagerly here (``torch_xla.compile`` and the step's end
    are where torch_xla would compile a graph; the native engine runs the same operations)."""


def is_eager_mode() -> bool:
    return True


@contextlib.contextmanager
def eager_mode_context(enable: bool):
    yield True


__getattr__ = not_provided("torch_xla.experimental")
