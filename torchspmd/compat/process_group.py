"""``torch.distributed.init_process_group`` under ``--xla-compat``: the ``'xla'`` backend, the
``xla://`` init method, and a call made after torchspmd started the process group.

torch_xla registers the ``'xla'`` backend and the ``xla://`` init method when
``torch_xla.distributed.xla_backend`` is imported. SPMD programs call
``dist.init_process_group('gloo', init_method='xla://')`` after ``xr.use_spmd()`` (torch_xla's
guide to distributed checkpoints), others ``init_process_group('xla', init_method='xla://')``.
Under the layer, whether or not that module is imported:

- after ``use_spmd()``, the backend ``'xla'`` is refused with torch_xla's own message (an
  ``SpmdError``, an ``AssertionError`` as torch_xla's ``assert``): torch_xla refuses its
  ``'xla'`` group under SPMD;
- before it, the backend ``'xla'`` (and ``'gloo'``, ``'nccl'``, none) of the default group is the native
  engine's: gloo on CPU; on an accelerator its own backend for its tensors and gloo for CPU ones
  (``accelerators.pg_spec``), so that the program's CPU collectives (gloo, as it asked) and the
  engine's device ones share the group. ``dist.get_backend()`` names them, not ``'xla'``;
- ``init_method='xla://'`` is ``env://`` under a launcher (torchrun, ``torchspmd run``), else a
  group of this one process (torch_xla's one process on one host);
- a call while the default group exists (``use_spmd()`` started it) reuses that group when it
  matches: the same world size and rank where the call gives them, and for each device the
  backend the call asks for. torch_xla's program calls ``init_process_group`` once, and this
  is that call. One that does not match raises ``SpmdError`` naming both.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from torchspmd import accelerators, runtime
from torchspmd.errors import SpmdError
from torchspmd.patches import torch as torch_patches

__all__ = ["install", "native_backend", "XLA_INIT_METHOD"]

XLA_INIT_METHOD = "xla://"
#: what a torch_xla program may ask for, each the native engine's group: the named devices' specs among them
_MAPPED = {None, "xla", "gloo", "nccl", *(accelerators.pg_spec(t) for t in accelerators.NAMED)}


def native_backend() -> str:
    """The process-group backend the native engine starts (``use_spmd``) on this machine."""
    return accelerators.pg_spec(runtime.chosen_backend())


def _device_backends(backend: str) -> dict[str, str]:
    return BackendConfig(Backend(backend)).get_device_backend_map()


def _reuse(backend: str, world_size: int, rank: int) -> None:
    """Check a call made while the default group exists against that group."""
    have = _device_backends(dist.get_backend_config())
    wanted = _device_backends(backend)
    problems = []
    if world_size not in (-1, None) and world_size != dist.get_world_size():
        problems.append(f"world_size={world_size}, the group has {dist.get_world_size()} processes")
    if rank not in (-1, None) and rank != dist.get_rank():
        problems.append(f"rank={rank}, this process is rank {dist.get_rank()}")
    for device, name in wanted.items():
        if have.get(device) not in (None, name):
            problems.append(f"backend {name!r} for {device}, the group has {have[device]!r}")
    if problems:
        raise SpmdError(f"init_process_group: the process group is already started (torchspmd's use_spmd() starts "
                        f"it: {dist.get_backend_config()}, {dist.get_world_size()} processes) and this call does "
                        f"not match it: {'; '.join(problems)}. Leave those arguments out to use the group as it is")


def _wrap(init_process_group):
    def call(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, *args, **kwargs):
        asked = backend.lower() if isinstance(backend, str) else backend
        if asked == "xla" and runtime.is_spmd():
            # (torch_xla's own refusal: its 'xla' backend's collectives are per-device replicas)
            raise SpmdError("init_process_group(backend='xla'): XLA backend is not supported with SPMD. Please use "
                            "a CPU process group instead: init_process_group('gloo', init_method='xla://')")
        if asked in _MAPPED:
            backend = native_backend()
        if dist.is_initialized():
            _reuse(backend, world_size, rank)
            return None
        if init_method == XLA_INIT_METHOD or (isinstance(init_method, str) and init_method.startswith("xla://")):
            if runtime.launched():
                init_method = "env://"
            else:
                init_method, store, world_size, rank = None, dist.HashStore(), 1, 0
        return init_process_group(backend, init_method, timeout, world_size, rank, store, *args, **kwargs)

    return call


def install() -> None:
    """``init_process_group`` as this module says (``torchspmd.patches.torch.PROCESS_GROUP_XLA``)."""
    torch_patches.wrap_init_process_group(_wrap)
