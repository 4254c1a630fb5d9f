"""``torch_xla.debug.profiler`` under ``--xla-compat``, on ``torch.profiler``.

``start_trace(log_dir)`` / ``stop_trace()`` record a PyTorch profiler trace into
``log_dir`` (TensorBoard's format, one file per process); ``Trace`` / ``StepTrace`` /
``trace_me`` label regions (``record_function``), ``StepTrace`` also ends a step on exit.
``start_server`` returns a handle and starts nothing: there is no profiler server to
connect ``trace()`` or TensorBoard's capture to (``trace`` is not provided); use ``start_trace``."""

from __future__ import annotations

import functools
import os

import torch

from torchspmd import accelerators
from torchspmd.compat import _steps
from torchspmd.compat.stand_ins import not_provided

_PROFILE: list = []


class _Server:
    def __init__(self, port: int):
        self.port = port


def start_server(port: int, only_on_master: bool = True) -> _Server:
    return _Server(port)


def start_trace(log_dir, create_perfetto_link: bool = False, create_perfetto_trace: bool = False) -> None:
    if _PROFILE:
        raise RuntimeError("start_trace: a trace is already running; call stop_trace() first")
    activities = [torch.profiler.ProfilerActivity.CPU]
    accelerator = accelerators.profiler_activity(accelerators.default_type())
    if accelerator is not None:
        activities.append(accelerator)
    prof = torch.profiler.profile(activities=activities,
                                  on_trace_ready=torch.profiler.tensorboard_trace_handler(os.fspath(log_dir)))
    prof.start()
    _PROFILE.append(prof)


def stop_trace() -> None:
    if not _PROFILE:
        raise RuntimeError("stop_trace: no trace is running (start one with start_trace(log_dir))")
    _PROFILE.pop().stop()


class Trace:
    """A labelled region in the profiler trace."""

    def __init__(self, name: str, **kwargs):
        self.name = name

    def __enter__(self):
        self._rf = torch.profiler.record_function(self.name)
        self._rf.__enter__()
        return self

    def __exit__(self, *exc):
        self._rf.__exit__(*exc)
        return False


class StepTrace(Trace):
    """A labelled step: ends the step when the block is left."""

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is None:

            _steps.end_step()
        return False


def trace_me(name: str):
    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with Trace(name):
                return fn(*args, **kwargs)

        return run

    return decorate


__getattr__ = not_provided("torch_xla.debug.profiler")
