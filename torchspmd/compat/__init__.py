"""``--xla-compat``: torch_xla SPMD programs, unchanged, on torchspmd's native engine.

In a process started with the switch (``torchspmd run --xla-compat``, ``python -m
torchspmd.compat script.py``, ``torchrun ... -m torchspmd.compat script.py``), ``install()``
puts an import finder first on ``sys.meta_path``: ``torch_xla`` and its submodules, and
``optimum.tpu``, resolve to the modules under ``torchspmd/compat/torch_xla/`` and
``torchspmd/compat/optimum_tpu/``; the string device ``'xla'`` means this process's native
device (``_device.py``); ``init_process_group('xla')`` and ``init_method='xla://'`` give the
native backend's group (``process_group.py``); transformers and accelerate are told that
torch_xla is absent (``USE_TORCH_XLA=0``, both libraries' documented switch), and
``transformers.Trainer`` is torchspmd's (``torchspmd.hf.Trainer``) so that stock trainers
given the FSDPv2 arguments train sharded.

Nothing happens in a process without the switch: importing this package installs nothing.
Every public module and name of torch_xla (``manifest``) imports under the switch; a name the
layer does not provide is a stand-in (``stand_ins``) that raises ``NotProvidedError`` when it
is used, naming the API and, where one exists, the torchspmd (or PyTorch) equivalent.
docs/xla_compat.md lists every name (``python -m torchspmd.compat.name_table``).
"""

from __future__ import annotations

from torchspmd.compat.names import (
           NotProvidedAttributeError,
           NotProvidedError,
           missing,
)
from torchspmd.compat.stand_ins import not_provided
from torchspmd.compat.switch import ENV_ACTIVE, active, install, real_torch_xla

__all__ = ["install", "active", "NotProvidedError", "NotProvidedAttributeError", "not_provided", "missing",
           "real_torch_xla", "ENV_ACTIVE"]
