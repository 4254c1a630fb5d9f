"""PyTorch's device plugins (the ``torch.backends`` entry points that ``import torch`` loads,
unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), checked before torch is imported.

TorchTPU (``torch-tpu``) is such a plugin: ``import torch`` loads ``torch_tpu``, whose C++ part
aborts the process (a failed ``CHECK``: no Python exception, nothing to catch) where ``libtpu``
cannot be found. ``import torchspmd`` (and so ``torchspmd run``/``train``) looks first and
raises an ``ImportError`` that says what to do instead; a program that imports torch before
torchspmd meets the abort itself. This module imports nothing from torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def _plugins() -> list:
    try:
        return list(importlib.metadata.entry_points(group="torch.backends"))
    except Exception:  # (a broken distribution's metadata: torch itself reports it)
        return []


def installed() -> list[str]:
    """The device plugins torch loads at import, as ``name = module:function``."""
    return [f"{ep.name} = {ep.value}" for ep in _plugins()]


def problem() -> str | None:
    """Why ``import torch`` would abort in this process, or None (torch already imported, the
    plugins' autoload off, no plugin known to abort, or what it needs is there)."""
    if "torch" in sys.modules or os.environ.get(AUTOLOAD, "1") == "0":
        return None
    if not any(ep.value.split(":")[0].split(".")[0] == "torch_tpu" for ep in _plugins()):
        return None
    if os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu") is not None:
        return None
    return ("torch-tpu is installed but libtpu is not: `import torch` would load torch_tpu (torch's device-plugin "
            "autoload), which aborts the process without libtpu. On a TPU VM install libtpu (pip install "
            "'libtpu>=0.0.50', or set TPU_LIBRARY_PATH); on a machine without a TPU uninstall torch-tpu, or set "
            f"{AUTOLOAD}=0 to run on this machine's CPUs or GPUs")


def check() -> None:
    """Raise ``ImportError`` (with :func:`problem`'s message) where ``import torch`` would abort."""
    why = problem()
    if why is not None:
        raise ImportError(f"torchspmd: {why}")
