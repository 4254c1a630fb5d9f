"""The native engine: PyTorch's own distributed stack (DeviceMesh, DTensor, FSDP2, c10d, DCP,
torchrun), one process per device, on CUDA (NCCL) and CPUs (gloo).

``start`` joins the process group a launcher made (torchrun, ``torchspmd run``), or, for a
plain ``python script.py`` with several devices, re-launches the script once per device and
exits with the workers' status. Every process then continues from rank 0's random state and
the global view's patches are applied (``torchspmd.patches``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchspmd import accelerators, patches
from torchspmd.layouts import hlo, sharding_table
from torchspmd.engines.base import Capabilities, Engine
from torchspmd.engines.native import data, state
from torchspmd.engines.native.communication import shared_sums
from torchspmd.engines.native.global_view import (
    exact_ops,
    implicit_replication,
    module_edges,
    module_slots,
    optimizer_steps,
    redistribution,
    sharded_view,
    sharding,
)
from torchspmd.engines.native.start import rng, topology
from torchspmd.engines.native.wrappers import (
    activation_checkpointing,
    data_parallel,
    fsdp,
    pipeline_runner,
    unwrapped_tensor_parallel,
)
from torchspmd.engines.native.communication.collectives import CHOICES
from torchspmd.engines.native.start.device_mesh import device_mesh
from torchspmd.launch import environment, failures, launcher
from torchspmd.errors import SpmdError
from torchspmd.patches import dtensor as dtensor_patches
from torchspmd.patches import torch as torch_patches
from torchspmd.patches.python import QUIET_REPLICAS, silence_output

#: The torch versions the native engine is tested on (CI: the suite on the lowest, the smoke
#: subset on the highest). torch 2.9-2.12's DTensor lacks sharding rules the engine relies on
#: (detach_, masked_fill_, argmax, batch norm); torch_xla 2.9 (the torch_xla engine) keeps
#: torch 2.9, so the package's own requirement stays torch>=2.9.
SUPPORTED_TORCH = ">=2.13,<2.16"

#: The patches the engine applies at its start or later, mid-run (the first checked forward,
#: a mesh over reordered devices, a model built on the meta device): checked at its start.
#: (FSDPv2's shared parameters are checked when a unit is wrapped; the uneven-gathers guard
#: knows the torch versions that need it.)
PATCHES = (torch_patches.MODULE_SLOTS, torch_patches.GLOBAL_VIEW_MODE, torch_patches.OPTIMIZER_STEPS,
           torch_patches.MODULE_FORWARD_HOOKS, torch_patches.PARAMETERS_ON_META, dtensor_patches.OP_HANDLERS,
           dtensor_patches.GROUPS_IN_MESH_ORDER, dtensor_patches.REDISTRIBUTION_COUNT,
           dtensor_patches.REDISTRIBUTION_FALLBACK, dtensor_patches.XLA_SHARDED_TENSOR, QUIET_REPLICAS)


class NativeEngine(Engine):
    name = "native"
    backends = accelerators.NAMED
    capabilities = Capabilities(process_per_device=True, static_shapes=False, lazy_tensors=False, fused_optimizers=True,
                                hub_kernels=True, transformers_shards=False, tuple_axes_in_mesh_order=False,
                                pipeline_stages=True)

    def __init__(self):
        self._owns_process_group = False
        self._backend: str | None = None

    # -- choice and start ----------------------------------------------------------------------
    def default_backend(self) -> str:
        return topology.default_backend()

    def serves(self, backend: str) -> bool:
        # cpu, cuda, and any device type PyTorch has a module for (xpu, mps, a PrivateUse1 device)
        return backend in self.backends or (backend not in ("meta", "xla")
                                            and accelerators.device_module(backend) is not None)

    def usable(self, backend: str, where: str, explicit: bool) -> str | None:
        if not accelerators.is_available(backend):
            fix = "backend='cpu'" if explicit else "TORCHSPMD_BACKEND=cpu"
            return (f"{where}: no {backend} device is visible to PyTorch "
                    f"(torch.get_device_module({backend!r}).is_available() is False); use {fix}")
        return None

    def start(self, backend: str, *, auto: bool, num_devices: int | None) -> torch.device:
        if auto:
            raise SpmdError(
                "use_spmd(auto=True): auto-sharding is torch_xla's (the torch_xla engine); the native engine does "
                "not support it: annotate shardings with mark_sharding / FSDPv2 instead"
            )
        _require_supported_torch(backend)
        if not environment.launched() and not dist.is_initialized():
            n = topology.configured_processes(backend, num_devices)
            if n > 1:
                raise SystemExit(launcher.relaunch_current_script(n))
        self._init_process_group(backend)
        failures.record_failures()  # uncaught errors -> torchrun's error file, for the summary
        self._backend = backend
        topology.set_device_type(backend)
        local = topology.local_rank()
        accelerators.set_device(backend, local)
        device = accelerators.device_of(backend, local)
        # One program: every process continues from rank 0's random state (docs/launching.md).
        rng.synchronize(backend)
        # every patch the engine applies, now or later mid-run, checked before any step
        patches.verify(PATCHES)
        if dist.get_rank() != 0 and not environment.all_ranks_output():
            # The global view: the program prints once, as one process would.
            silence_output()
        module_slots.install()
        implicit_replication.install()
        exact_ops.install()
        optimizer_steps.install()
        sharded_view.install()
        data_parallel.install_auto()
        dtensor_patches.guard_uneven_gathers()
        redistribution.install()
        return device

    def _init_process_group(self, backend: str) -> None:
        if dist.is_initialized():
            return
        pg_backend = accelerators.pg_spec(backend)  # (gloo; on an accelerator also its own)
        if environment.launched():
            dist.init_process_group(pg_backend)
        else:
            dist.init_process_group(pg_backend, store=dist.HashStore(), rank=0, world_size=1)
        self._owns_process_group = True
        atexit.register(self._shutdown)

    def _shutdown(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    # -- topology ------------------------------------------------------------------------------
    def local_device_count(self) -> int:
        return topology.local_size()

    def local_ordinal(self) -> int:
        return topology.local_rank()

    def process_index(self) -> int:
        return topology.rank()

    def process_count(self) -> int:
        return topology.world_size()

    def world_size(self) -> int:
        return topology.world_size()

    def planned_processes(self, backend: str, num_devices: int | None) -> int:
        if environment.launched():
            return int(os.environ["WORLD_SIZE"])
        return topology.configured_processes(backend, num_devices)

    def describe(self, backend: str) -> list[str]:
        return [f"local devices {topology.configured_processes(backend)}"]

    def interrupted(self) -> bool:
        return failures.interrupted()

    def peak_memory_gb(self) -> float | None:
        peak = accelerators.max_memory_allocated(topology.device()) if self._backend else None
        return None if peak is None else peak / 2**30

    # -- steps ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, index: int = 0) -> Iterator[None]:
        with torch.profiler.record_function(f"torchspmd.step#{index}"):
            yield

    def sync(self) -> None:
        """Work is issued eagerly: nothing to flush."""

    # -- meshes --------------------------------------------------------------------------------
    def own_class(self, kind: str) -> type | None:
        return {"MpDeviceLoader": data.MpDeviceLoader, "FSDPv2": fsdp.SpmdFullyShardedDataParallel}.get(kind)

    def device_mesh(self, mesh):
        return device_mesh(mesh)

    # -- sharding ------------------------------------------------------------------------------
    def mark_sharding(self, t, mesh, spec, resolved):
        out = sharding.mark_sharding(t, mesh, resolved)
        if t.is_leaf:  # (in place: every module slot holding t holds out)
            for owner, _name, _kind in module_slots.live_slots(out):
                unwrapped_tensor_parallel.install_for(owner)  # Pattern 1: Megatron's layouts at its edges
        return out

    def result_taken(self, marked):
        return module_edges.taken_by_wrapper(marked)

    def in_local_compute(self):
        return module_edges.in_local_compute()

    # -- what the integrations read -------------------------------------------------------------
    def set_auto_replicate(self, enabled):
        return data_parallel.set_auto_replicate(enabled)

    def auto_path(self, module):
        return data_parallel.auto_path(module)

    def is_pipelined(self, model):
        return pipeline_runner.is_split(model)

    def tensor_parallel_layout(self, module):
        return unwrapped_tensor_parallel.laid_out(module)

    @contextlib.contextmanager
    def watching_fallbacks(self, where):
        with redistribution.watching(where) as fallbacks, shared_sums.through_backend():
            yield fallbacks

    def fallbacks_seen(self):
        return redistribution.seen()

    def sharding_string(self, t):
        return sharded_view.sharding_string(t)

    def sharding_type(self, t):
        return sharded_view.sharding_type(t)

    def quiet_gathers(self):
        return state.quiet_gathers()

    def mark_sharding_with_gradients(self, t, mesh, spec, resolved):
        return sharding.mark_sharding_with_gradients(t, mesh, resolved)

    def enable_manual_sharding(self, t, mesh, spec, resolved):
        return sharding.enable_manual_sharding(t, mesh, resolved)

    def disable_manual_sharding(self, t, mesh, spec, resolved, full_shape):
        return sharding.disable_manual_sharding(t, mesh, spec, resolved, full_shape)

    def clear_sharding(self, t):
        return sharding.clear_sharding(t)

    def get_sharding(self, t):
        return sharding.get_sharding(t)

    def visualize_sharding(self, t, use_color: bool):
        if isinstance(t, str):
            return sharding_table.render(hlo.cells(t, topology.world_size()), topology.device_type().upper(),
                                         use_color)
        cells, kind = sharding.sharding_cells(t)
        return sharding_table.render(cells, kind, use_color)

    # -- data ----------------------------------------------------------------------------------
    def loader(self, loader, device, input_sharding, **options):
        return data.MpDeviceLoader(loader, device, input_sharding=input_sharding, **options)

    def shard_batch(self, batch: Any, input_sharding, device) -> Any:
        return data.shard_batch(batch, input_sharding, device)

    # -- wrappers ------------------------------------------------------------------------------
    def replicate(self, module, mesh, data_dims, shard_output, ddp_kwargs):
        return data_parallel.replicate(module, mesh, data_dims, shard_output, ddp_kwargs)

    def pipeline(self, model, mesh, axis, layers, microbatches, schedule, example_inputs):
        return pipeline_runner.PipelineRunner(model, mesh, axis, layers, microbatches, schedule, example_inputs)

    def fully_shard(self, module, mesh, shard_output, auto_wrap_policy, auto_wrapper_callable, extra_data_axis,
                    options):

        if options.get("collectives", "auto") not in CHOICES:
            raise SpmdError(f"FSDPv2(collectives={options['collectives']!r}): choose one of {', '.join(CHOICES)}")
        return fsdp.SpmdFullyShardedDataParallel(module, mesh, shard_output, auto_wrap_policy, auto_wrapper_callable,
                                                 extra_data_axis, **options)

    def shard_in_place(self, module, mesh, shard_output, extra_data_axis, options):
        return fsdp.shard_in_place(module, mesh, shard_output, extra_data_axis, **options)

    def is_fully_sharded(self, module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(module, (fsdp.SpmdFullyShardedDataParallel, FSDPModule))

    def checkpoint_module(self, module):
        return activation_checkpointing.checkpoint_module(module)

    # -- gradients and state -------------------------------------------------------------------
    def clip_grad_norm_(self, params, max_norm, norm_type, error_if_nonfinite):
        return state.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    def full_state_dict(self, model, rank0_only, cpu):
        return state.full_state_dict(model, rank0_only=rank0_only, cpu=cpu)

    def load_full_state_dict(self, model, state_dict, strict):
        return state.load_full_state_dict(model, state_dict, strict=strict)

    # -- sharded checkpoints -------------------------------------------------------------------
    def save_state(self, state_dict: dict, storage_writer) -> None:
        dcp.save(state_dict, storage_writer=storage_writer)

    def load_state(self, state_dict: dict, storage_reader) -> None:
        dcp.load(state_dict, storage_reader=storage_reader)

    def prime_optimizer(self, optimizer) -> None:
        """Create the optimizer's state (e.g. Adam's moments) without changing any parameter:
        one step with zero gradients and a learning rate of 0."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        lrs = [g["lr"] for g in optimizer.param_groups]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _require_supported_torch(backend: str) -> None:
    """The native engine refuses a torch outside the versions it is tested on, before any
    process starts (``TORCHSPMD_UNTESTED_VERSIONS=1`` lets a newer one through)."""
    if patches.in_range(torch.__version__, SUPPORTED_TORCH):
        return
    if os.environ.get(patches.UNTESTED_VERSIONS) == "1" and patches.in_range(torch.__version__, ">=2.13"):
        return
    raise SpmdError(
        f"use_spmd(): the native engine ({backend}) supports torch{SUPPORTED_TORCH}, and this is torch "
        f"{torch.__version__}. "
        + ("Its DTensor lacks sharding rules the engine relies on (on torch 2.9: detach_, masked_fill_, argmax, "
           "batch norm). Install torch>=2.13, or run on the torch_xla engine (torch_xla of this torch's version, "
           "with PJRT_DEVICE set or TORCHSPMD_BACKEND=xla)"
           if not patches.in_range(torch.__version__, ">=2.13") else
           f"It is newer than any torch the engine is tested on: install torch{SUPPORTED_TORCH}, or set "
           f"{patches.UNTESTED_VERSIONS}=1 to try it (patches outside their verified versions are then applied)"))

