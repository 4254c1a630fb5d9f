"""simdev: a compiled PrivateUse1 device for tests (see simdev.cpp), registered the way an
out-of-tree device registers itself (torch_npu, torch-tpu): the PrivateUse1 name, a device
module (``torch.simdev``), tensor methods, and a process-group backend (``simgloo``) declared
for its device type. ``load()`` builds the extension once per torch version into
``~/.cache/torchspmd/simdev/`` (about a minute) and registers everything; later calls and
processes reuse the build."""

from __future__ import annotations

import os
from pathlib import Path

NAME = "simdev"
PG_BACKEND = "simgloo"
HERE = Path(__file__).resolve().parent

_ext = None


def build_dir() -> Path:
    import torch
    root = Path(os.environ.get("TORCHSPMD_SIMDEV_CACHE", Path.home() / ".cache" / "torchspmd" / "simdev"))
    return root / torch.__version__.replace("+", "_")


def extension():
    """The compiled extension (built on first use)."""
    global _ext
    if _ext is None:
        from torch.utils import cpp_extension
        where = build_dir()
        where.mkdir(parents=True, exist_ok=True)
        _ext = cpp_extension.load(name="simdev_ext", sources=[str(HERE / "simdev.cpp")], build_directory=str(where),
                                  extra_cflags=["-O1"], verbose=False)
    return _ext


def _create_backend(store, rank, size, timeout):
    import torch.distributed as dist
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    return extension().wrap(gloo)


def load() -> None:
    """Build (once) and register the device: after this, ``torch.device('simdev', i)`` works,
    ``torch.accelerator.current_accelerator()`` is simdev, and c10d maps it to ``simgloo``."""
    import torch
    import torch.distributed as dist
    extension()
    if torch._C._get_privateuse1_backend_name() == NAME:
        return
    from . import device
    torch.utils.rename_privateuse1_backend(NAME)
    torch._register_device_module(NAME, device)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    dist.Backend.register_backend(PG_BACKEND, _create_backend, devices=[NAME])
