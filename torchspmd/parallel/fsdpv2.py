"""``SpmdFullyShardedDataParallel`` (``FSDPv2``): fully sharded data parallelism on the named mesh.

On the native engine each wrapped module is one FSDP2 communication unit (``fully_shard``)
over the mesh's ``'fsdp'`` axis; on the torch_xla engine this is torch_xla's FSDPv2. The
arguments are checked here, for both engines alike.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch.nn as nn

from torchspmd import engines
from torchspmd.errors import SpmdError
from torchspmd.mesh import Mesh, as_view, get_global_mesh

__all__ = ["SpmdFullyShardedDataParallel", "FSDPv2", "shard_in_place"]


class SpmdFullyShardedDataParallel(abc.ABC):
    """Fully sharded data parallelism on the named mesh.

    On the native engine each wrapped module is one FSDP2 unit (``fully_shard``) over the
    mesh's ``'fsdp'`` axis (with ``extra_data_axis``: replicated over that axis, as HSDP):
    its parameters, gradients and optimizer state are split over ``'fsdp'``. The outermost
    wrapper is the boundary of the global view: its inputs arrive as global batches, its
    module computes on this process's rows with plain tensors (FSDP2 gathers the
    parameters) where that is proven to give one device's result, else on the whole batch
    (``per_process`` below), and its outputs leave as global DTensors through ``shard_output``.
    Gradients equal the single-device gradients of the global-mean loss: FSDP2 reduces
    with a sum, never an average. On the torch_xla engine this builds torch_xla's
    ``SpmdFullyShardedDataParallel`` (with the unwrapped module's state-dict keys, every
    batch output marked, and ``'bf16'`` mapped to autocast); the options torch_xla lacks
    raise there. The object built is the engine's (``isinstance(m, FSDPv2)`` holds).

    Args (torch_xla's, positional or keyword):
        module: the module to shard; it must define ``forward``.
        mesh: a ``Mesh`` with an ``'fsdp'`` axis; default: the global mesh.
        shard_output: ``fn(output, mesh)`` marking the output's sharding with
            ``mark_sharding`` (torch_xla style) or returning the output as global DTensors.
            Default: tensors with the batch on dim 0 are split like the batch; a scalar
            (a loss computed inside the module) becomes the row-weighted mean over devices.
        auto_wrap_policy: wrap submodules first (``transformer_auto_wrap_policy``, ...).
        auto_wrapper_callable: ``fn(module, *args, **kwargs)`` used instead of FSDPv2 for
            auto-wrapped submodules (e.g. to add ``checkpoint_module``).
        extra_data_axis: another mesh axis splitting the batch, over which parameters are
            replicated (gradients all-reduced): hybrid sharding.

    Options torch_xla lacks (keyword only):
        mixed_precision: ``'bf16'`` (bf16 compute, fp32 master weights and gradient
            reduction), a dtype, or a ``MixedPrecisionPolicy``.
        reshard_after_forward: free gathered parameters after forward. Default ``None``:
            every unit but the outermost, whose parameters backward needs again at once
            (FSDP2's default); ``True``: the outermost too; ``False``: none.
        cpu_offload: keep the shards (and their gradients and optimizer state) in CPU memory.
        collectives: ``"auto"`` (shared-memory collectives for a gloo group of CPU processes on
            one machine, the all-reduce form of the reduce-scatter for gloo across machines,
            FSDP2's own elsewhere, as on NCCL), ``"native"``, ``"allreduce"`` or ``"shm"``
            (``torchspmd/engines/native/communication/collectives.py``).
        strict_sharding: refuse (``SpmdError``) a parameter annotated over a non-data axis
            that cannot compute tensor-parallel and would be gathered whole (by default a
            ``GatheredWholeWarning`` names it); see ``torchspmd/engines/native/wrappers/tensor_parallel.py``.
        compile: ``torch.compile`` each wrapped block's ``forward`` (True, or a dict of
            ``torch.compile`` options); the root module too when nothing is wrapped below
            it. FSDP2's gathering and reducing stay outside the compiled code.
        per_process: compute on this process's rows whatever the model does (FSDP2's and
            DDP's semantics: a statistic over the batch is each process's own). By default
            the model computes on this process's rows only where that is proven to give one
            device's result, else every process computes the whole batch (the global view;
            ``torchspmd/engines/native/global_view/unit_rows.py``); ``ts.explain`` lists which.
    """

    def __new__(
        cls,
        module: nn.Module,
        mesh: Mesh | None = None,
        shard_output: Callable | None = None,
        auto_wrap_policy: Callable | None = None,
        auto_wrapper_callable: Callable | None = None,
        extra_data_axis: str | None = None,
        *,
        mixed_precision: Any = None,
        reshard_after_forward: bool | int | None = None,
        cpu_offload: bool = False,
        collectives: str = "auto",
        compile: bool | dict = False,
        strict_sharding: bool = False,
        per_process: bool = False,
    ):
        engine = engines.current("FSDPv2")
        mesh = _checked(engine, module, mesh, shard_output, extra_data_axis)
        if auto_wrap_policy is not None:
            for name, sub in module.named_modules():
                if isinstance(sub, SpmdFullyShardedDataParallel):
                    raise ValueError(
                        f"Expected {name} to NOT be SpmdFullyShardedDataParallel if using an `auto_wrap_policy`: "
                        f"wrap by hand or by policy, not both"
                    )
        options = dict(mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
                       cpu_offload=cpu_offload, collectives=collectives, compile=compile,
                       strict_sharding=strict_sharding, per_process=per_process)
        return engine.fully_shard(module, mesh, shard_output, auto_wrap_policy, auto_wrapper_callable,
                                  extra_data_axis, options)


FSDPv2 = SpmdFullyShardedDataParallel
engines.counts_as(SpmdFullyShardedDataParallel, "FSDPv2")


def _checked(engine, module, mesh, shard_output, extra_data_axis):
    """The checks torch_xla's FSDPv2 makes, with its messages, for every engine; returns the mesh."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FSDPv2(module=...): expected an nn.Module, got {type(module).__name__}")
    if shard_output is not None and not callable(shard_output):
        raise TypeError(f"FSDPv2(shard_output=...): expected a callable fn(output, mesh), got "
                        f"{type(shard_output).__name__} (the third positional argument is shard_output)")
    if isinstance(module, SpmdFullyShardedDataParallel):
        raise RuntimeError(
            "Cannot wrap a module that is already wrapped with FSDP. For nested FSDP, first wrap the "
            "inner child modules before wrapping the outer parent module."
        )
    if getattr(type(module), "forward", None) is nn.Module.forward:
        raise RuntimeError(
            f"The module wrapped by FSDP *must define a `forward` method and call it during the module's "
            f"forward pass for FSDP to work correctly.* {type(module).__name__} has none: do not wrap "
            f"`nn.ModuleList` or `nn.ModuleDict`; wrap the layers inside them."
        )
    if mesh is None:
        mesh = get_global_mesh()
        if mesh is None:
            raise ValueError(
                "No mesh is provided and no global mesh is set. Please provide a mesh "
                "(FSDPv2(module, mesh=...)) or call torchspmd.set_global_mesh(mesh) first."
            )
    if not isinstance(mesh, Mesh):
        raise ValueError(f"FSDPv2(mesh=...): expected a torchspmd Mesh, got {type(mesh).__name__}")
    view = as_view(mesh, "FSDPv2(mesh=...)")
    if view.axis_names is None or "fsdp" not in view.axis_names:
        raise ValueError(
            f"The mesh must have an axis named 'fsdp'; {view!r} has axes {tuple(view.shape().keys())}. "
            f"Build it as Mesh(ids, (n, 1), ('fsdp', 'model'))."
        )
    if extra_data_axis is not None:
        if extra_data_axis not in view.axis_names:
            raise ValueError(f"The provided {extra_data_axis} axis is not in the mesh {tuple(view.axis_names)}.")
        if extra_data_axis == "fsdp":
            raise ValueError("extra_data_axis must be another axis than 'fsdp'")
    return mesh


def shard_in_place(module: nn.Module, mesh: Mesh | None = None, shard_output: Callable | None = None,
                   extra_data_axis: str | None = None, *, mixed_precision: Any = None,
                   reshard_after_forward: bool | int | None = None, cpu_offload: bool = False,
                   collectives: str = "auto", strict_sharding: bool = False) -> nn.Module:
    """An ``auto_wrapper_callable`` making each auto-wrapped module an FSDPv2 unit without
    a wrapper module around it: the model keeps its module names (for libraries that
    walk them, e.g. PEFT's adapter saving). Returns ``module`` itself, sharded. Only
    inside an FSDPv2 root, which is the global-view boundary (native engine)."""
    engine = engines.current("shard_in_place")
    if mesh is None:
        mesh = get_global_mesh()
    if mesh is None or mesh.axis_names is None or "fsdp" not in mesh.axis_names:
        raise SpmdError("shard_in_place: give the Mesh (with an 'fsdp' axis) the FSDPv2 root uses")
    options = dict(mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
                   cpu_offload=cpu_offload, collectives=collectives, strict_sharding=strict_sharding)
    return engine.shard_in_place(module, mesh, shard_output, extra_data_axis, options)
