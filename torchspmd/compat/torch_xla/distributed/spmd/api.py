"""``torch_xla.distributed.spmd.api`` under ``--xla-compat``: PyTorch's DTensor API on a mesh of
the ``'xla'`` device type.

``torch.distributed.tensor.distribute_tensor`` and ``distribute_module`` hand a ``DeviceMesh``
whose device type is ``'xla'`` (``init_device_mesh('xla', ...)``, which PyTorch builds without
process groups) to ``xla_distribute_tensor`` / ``xla_distribute_module`` of this module: that is
PyTorch's own extension point for torch_xla. Here they turn the mesh into a torchspmd ``Mesh`` of
the same shape, devices and axis names, and annotate with ``mark_sharding``, as torch_xla does;
the result is a DTensor on this process's device (torch_xla returns an ``XLAShardedTensor``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor.placement_types import Placement, Replicate

from torchspmd.compat.names import NotProvidedError, message
from torchspmd.compat.stand_ins import not_provided
from torchspmd.errors import SpmdError
from torchspmd.mesh import Mesh
from torchspmd.runtime import device, is_spmd, use_spmd
from torchspmd.sharding import mark_sharding

__all__ = ["auto_policy", "convert_to_xla_mesh", "convert_to_xla_partition_spec", "xla_distribute_module",
           "xla_distribute_tensor"]


def _spmd() -> None:
    if not is_spmd():  # torch_xla's functions here turn SPMD on themselves
        use_spmd()


def auto_policy(mod_name, mod, mesh) -> None:
    """torch_xla's marker for XLA's auto-sharding in ``distribute_module``: not provided (the
    sharding would be chosen by the XLA compiler)."""
    raise NotProvidedError(message("torch_xla.distributed.spmd.auto_policy"))


def convert_to_xla_mesh(dt_mesh) -> Mesh:
    """The ``Mesh`` of a ``DeviceMesh``: its devices in order, its shape, its dim names."""
    _spmd()
    return Mesh(dt_mesh.mesh.flatten().numpy(), tuple(dt_mesh.mesh.size()), dt_mesh.mesh_dim_names)


def convert_to_xla_partition_spec(tensor: torch.Tensor, placements: Sequence[Placement]) -> tuple:
    """The partition spec of ``placements``: for each tensor dim, the mesh dims that shard it
    (an int, a tuple when several do, None when none)."""
    spec: list = [None] * tensor.dim()
    for mesh_dim, p in enumerate(placements):
        if p.is_shard():
            d = p.dim if p.dim >= 0 else p.dim + tensor.dim()
            spec[d] = mesh_dim if spec[d] is None else (*((spec[d],) if isinstance(spec[d], int) else spec[d]),
                                                        mesh_dim)
        elif not p.is_replicate():
            raise SpmdError(f"distribute_tensor on an 'xla' mesh: placement {p!r} is not supported; use Shard(d) or "
                            f"Replicate() (a pending reduction has no annotation)")
    return tuple(spec)


def xla_distribute_tensor(tensor: torch.Tensor, device_mesh, placements: Sequence[Placement] | None = None):
    """``distribute_tensor(tensor, device_mesh, placements)`` for an ``'xla'`` mesh."""
    _spmd()
    placements = list(placements) if placements is not None else [Replicate()] * device_mesh.ndim
    if len(placements) != device_mesh.ndim:
        raise SpmdError(f"distribute_tensor: placements has {len(placements)} entries, the mesh {device_mesh.ndim} "
                        f"dims: give one placement per mesh dim")
    if not tensor.is_meta:
        tensor = tensor.to(device())
    return mark_sharding(tensor, convert_to_xla_mesh(device_mesh), convert_to_xla_partition_spec(tensor, placements))


def xla_distribute_module(module: nn.Module, device_mesh=None, partition_fn: Callable | None = None,
                          input_fn: Callable | None = None, output_fn: Callable | None = None) -> nn.Module:
    """``distribute_module`` for an ``'xla'`` mesh: the module on this process's device,
    ``partition_fn(name, submodule, device_mesh)`` called on every submodule (it shards what it
    chooses, with ``distribute_tensor``), ``input_fn(module, inputs, device_mesh)`` and
    ``output_fn(module, outputs, device_mesh)`` as forward hooks."""
    _spmd()
    if partition_fn is None or partition_fn is auto_policy:
        # (an SpmdError, not NotProvidedError: distribute_module turns an ImportError into "install torch_xla")
        raise SpmdError(message("torch_xla.distributed.spmd.auto_policy") + " (distribute_module without a "
                        "partition_fn asks XLA's auto-sharding)")
    module = module.to(device())
    for name, sub in module.named_modules():
        partition_fn(name, sub, device_mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda m, args: input_fn(m, args, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda m, args, out: output_fn(m, out, device_mesh))
    return module


__getattr__ = not_provided("torch_xla.distributed.spmd.api")
