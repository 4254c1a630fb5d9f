"""Steps under ``--xla-compat``: ``torch_xla.step()``, ``xm.mark_step()``, ``torch_xla.sync()``
end a step; closures added with ``xm.add_step_closure`` run after it, in order.

The native engine runs every operation when it is issued, so ending a step computes
nothing more: it advances torchspmd's step counter (``torchspmd.current_step()``) and
runs the closures, as torch_xla runs them once the step's graph has executed."""

from __future__ import annotations

import contextlib

from torchspmd import runtime

_CLOSURES: list = []
_DEPTH = [0]


def add_closure(fn, args=(), run_async: bool = False) -> None:
    _CLOSURES.append((fn, tuple(args)))


def end_step() -> None:
    """A step boundary: advance the counter, run the closures queued so far."""
    runtime.count_step()
    run_closures()


def run_closures() -> None:
    while _CLOSURES:
        fn, args = _CLOSURES.pop(0)
        fn(*args)


@contextlib.contextmanager
def step():
    import torch

    if runtime.is_spmd():
        with runtime.step():  # advances the counter on a normal exit
            _DEPTH[0] += 1
            try:
                yield
            finally:
                _DEPTH[0] -= 1
    else:
        with torch.profiler.record_function(f"torch_xla.step#{runtime.current_step()}"):
            yield
        runtime.count_step()
    run_closures()
