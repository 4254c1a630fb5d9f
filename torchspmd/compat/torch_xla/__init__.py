"""``torch_xla`` under ``--xla-compat`` (see ``torchspmd.compat``)."""

from __future__ import annotations

import functools
import os

import torch

from torchspmd import accelerators
from torchspmd.compat import _device, _steps
from torchspmd.compat.stand_ins import not_provided

__version__ = "2.9.0+torchspmd.compat"  # the torch_xla API this layer follows

# torch_xla picks a PJRT device when none is configured and says which in PJRT_DEVICE (programs and
# torch_xla's tests read it): here the native device's type, 'CPU' or 'CUDA'.
os.environ.setdefault("PJRT_DEVICE", _device.native().type.upper())


def device(index: int | None = None) -> torch.device:
    """This process's native device (``cuda:LOCAL_RANK`` or ``cpu``); ``index`` is ignored
    (under SPMD a program sees one device)."""
    return _device.program_device()


def devices() -> list[torch.device]:
    return [device()]


def real_devices() -> list[str]:
    """The devices of this host, as torch_xla names them under SPMD (``['CPU:0', 'CPU:1']``):
    ``xr.device_type()`` and an index, one per process torchspmd runs here."""
    from torchspmd import runtime
    from torchspmd.compat.torch_xla import runtime as xr

    return [f"{xr.device_type()}:{i}" for i in range(runtime.local_device_count())]


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
    if wait:
        accelerators.synchronize(device())


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


# As in torch_xla, `import torch_xla` makes these available as attributes.
from torchspmd.compat.torch_xla import (  # noqa: E402,F401
    _XLAC,
    core,
    debug,
    distributed,
    experimental,
    runtime,
    utils,
)
from torchspmd.compat.torch_xla.core import xla_model  # noqa: E402,F401

xr, xm = runtime, xla_model

__getattr__ = not_provided("torch_xla")
