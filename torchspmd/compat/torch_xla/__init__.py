"""``torch_xla`` under ``--xla-compat`` (see ``torchspmd.compat``)."""

from __future__ import annotations

import functools
import sys

import torch

from torchspmd.compat import _device, _steps
from torchspmd.compat.names import not_provided

__version__ = "2.9.0+torchspmd.compat"  # the torch_xla API this layer follows


def device(index: int | None = None) -> torch.device:
    """This process's native device (``cuda:LOCAL_RANK`` or ``cpu``); ``index`` is ignored
    (under SPMD a program sees one device)."""
    return _device.native()


def devices() -> list[torch.device]:
    return [device()]


def real_devices() -> list[str]:
    """The devices of this host, as torch_xla names them under SPMD (``['CPU:0', 'CPU:1']``):
    ``xr.device_type()`` and an index, one per process torchspmd runs here."""
    from torchspmd.compat.torch_xla import runtime as xr

    return [f"{xr.device_type()}:{i}" for i in range(xr.addressable_runtime_device_count())]


def device_count() -> int:
    """``len(real_devices())``, as torch_xla: the devices of this host (2 under SPMD on 2
    devices; it is ``devices()`` that lists the program's one device)."""
    return len(real_devices())


def step():
    """Context manager: one training step. Leaving it ends the step (closures run)."""
    return _steps.step()


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """End the step: the native engine has run every operation already; closures run."""
    _steps.end_step()
    if wait and torch.cuda.is_available() and device().type == "cuda":
        torch.cuda.synchronize()


def compile(f=None, full_graph: bool = False, name: str | None = None, max_different_graphs: int | None = None):
    """``torch_xla.compile(fn)``: ``fn`` runs as one step (eagerly on the native engine;
    ``torch.compile`` is PyTorch's compiler if wanted). Usable as a decorator, with or
    without arguments; ``full_graph`` and ``max_different_graphs`` (limits on XLA's
    tracing) have nothing to limit here."""
    if f is None:
        return functools.partial(compile, full_graph=full_graph, name=name, max_different_graphs=max_different_graphs)

    @functools.wraps(f)
    def run(*args, **kwargs):
        with _steps.step():
            return f(*args, **kwargs)

    return run


def manual_seed(seed, device=None) -> None:
    torch.manual_seed(seed)


def launch(fn, args=(), start_method: str = "spawn", debug_single_process: bool = False):

    raise NotProvidedError(message("torch_xla.launch"))


class _XLAC:
    """``torch_xla._XLAC``: only ``_get_xla_sharding_spec``."""

    @staticmethod
    def _get_xla_sharding_spec(t) -> str:

        return sharding_string(t)

    def __getattr__(self, name):
        if name.startswith("__"):  # (the import system's questions: not a package)
            raise AttributeError(name)

        raise missing(f"torch_xla._XLAC.{name}")


_XLAC = _XLAC()
# `import torch_xla._XLAC` and `from torch_xla._XLAC import ...` find it as a module would be
import sys as _sys  # noqa: E402

_sys.modules.setdefault("torch_xla._XLAC", _XLAC)

# As in torch_xla, `import torch_xla` makes these available as attributes.
from torchspmd.compat.names import NotProvidedError, message, missing
from torchspmd.compat.torch_xla import (  # noqa: E402,F401
    core,
    debug,
    distributed,
    experimental,
    runtime,  # noqa: E402
    utils,
)
from torchspmd.compat.torch_xla.core import xla_model  # noqa: E402,F401
from torchspmd.engines.native.sharded_view import sharding_string

xr, xm = runtime, xla_model

__getattr__ = not_provided("torch_xla")
