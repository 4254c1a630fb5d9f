"""The torch_xla engine: every public call handed to torch_xla (TPUs; CPU PJRT for tests).

One process drives all of its host's devices and torch_xla's GSPMD partitioner inserts
the collectives, so a program runs at torch_xla's own speed. ``XlaEngine`` implements the
engine interface (``torchspmd.engines.base``); what torch_xla has no equivalent for is
refused with an error that says so.

What torchspmd adds on top of torch_xla's objects, so that a program behaves the same on
both engines:

- ``mark_sharding`` returns the tensor it annotated (torch_xla annotates in place and
  returns an ``XLAShardedTensor`` view); a CPU tensor is moved to the device first.
- ``FSDPv2`` builds a subclass of torch_xla's ``SpmdFullyShardedDataParallel`` whose
  ``state_dict`` has the unwrapped module's keys (as on the native engine), whose default
  ``shard_output`` marks every output tensor that has the batch on dim 0 (torch_xla marks
  only the first, and refuses a Hugging Face ``ModelOutput``), and which maps
  ``mixed_precision='bf16'`` to autocast.
- Checkpoints use torch_xla's distributed-checkpoint planners with the same directory
  layout and the same keys as the native engine.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import sys
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from torchspmd.checkpoint_format import keys as state_keys
from torchspmd.layouts import hlo
from torchspmd.engines.base import Capabilities, Engine
from torchspmd.errors import SpmdError
from torchspmd.launch.environment import ENV_NUM_DEVICES, parse_count
from torchspmd.layouts.mesh_layouts import hybrid_layout

PJRT_DEVICE = "PJRT_DEVICE"  # torch_xla's switch: set (with torch_xla installed) chooses this engine
INSTALL = (
    "pip install 'torchspmd[tpu]' (torch_xla needs the torch of its own version: on a TPU VM "
    "`pip install torch==2.9.0 'torch_xla[tpu]==2.9.0'`; to try it on CPUs "
    "`pip install torch==2.9.0 torch_xla==2.9.0` and run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4)"
)


def installed() -> bool:
    """torch_xla is installed (found on the path itself: under --xla-compat the name
    ``torch_xla`` is torchspmd's layer, which this does not count)."""
    return importlib.machinery.PathFinder.find_spec("torch_xla") is not None


def require(api: str = "use_spmd(backend='xla')") -> None:
    """Import torch_xla, or explain how to get it."""
    if not installed():
        raise SpmdError(
            f"{api}: torch_xla is not installed in this Python environment ({sys.executable}); install it with "
            f"{INSTALL}, or use the native engine (backend='cpu' or an accelerator's device type)"
        )
    try:
        for name in ("torch_xla", "torch_xla.runtime", "torch_xla.distributed.spmd"):
            importlib.import_module(name)
    except Exception as e:  # a torch_xla built for another torch, a missing libtpu, ...
        raise SpmdError(
            f"{api}: torch_xla is installed but cannot be imported with torch {torch.__version__} ({e}); "
            f"torch_xla X.Y needs torch X.Y: {INSTALL}"
        ) from e


def _xs():
    import torch_xla.distributed.spmd as xs

    return xs


def _xr():
    import torch_xla.runtime as xr

    return xr


def _device():
    import torch_xla

    return torch_xla.device()


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "xla" else t.to(_device())


# -- meshes -----------------------------------------------------------------------------

_HOST_HYBRID: list = []


def _host_hybrid_class():
    """A torch_xla ``Mesh`` laid out host by host (``HybridMesh`` off TPUs)."""
    if not _HOST_HYBRID:
        _HOST_HYBRID.append(type("HybridMesh", (_xs().Mesh,), {"__module__": __name__}))
    return _HOST_HYBRID[0]


_MESHES: list = []  # meshes built through torchspmd, newest last: get_sharding reads specs against them


def _remember(mesh):
    _MESHES.append(mesh)
    del _MESHES[:-16]
    return mesh


def _check_size(mesh) -> None:
    n = _xr().global_runtime_device_count()
    if int(np.prod(mesh.mesh_shape)) != n:
        raise SpmdError(
            f"Mesh of shape {tuple(mesh.mesh_shape)} is not mappable over {n} devices: the product of "
            f"mesh_shape must equal global_runtime_device_count() ({n})"
        )


# -- FSDPv2 -------------------------------------------------------------------------------

def _autocast_dtype(mixed_precision):
    if mixed_precision is None:
        return None
    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}.get(mixed_precision, mixed_precision)
    if dtype is not torch.bfloat16:
        raise SpmdError(
            f"FSDPv2(mixed_precision={mixed_precision!r}) on the torch_xla engine: only 'bf16' maps to torch_xla "
            f"(autocast to bfloat16 with fp32 master weights); FSDP2 MixedPrecisionPolicy objects and other "
            f"dtypes belong to the native engine"
        )
    return dtype


_XLA_FSDP: list = []


def _fsdp_class():
    """torch_xla's SpmdFullyShardedDataParallel, with torchspmd's clean state-dict keys,
    every-batch-tensor output sharding and bf16 autocast."""
    if _XLA_FSDP:
        return _XLA_FSDP[0]
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel,
        _prepare_spmd_partition_spec,
    )

    class XlaFSDPv2(SpmdFullyShardedDataParallel):
        def __init__(self, module, *, mesh=None, shard_output=None, auto_wrap_policy=None,
                     auto_wrapper_callable=None, extra_data_axis=None, autocast_dtype=None):
            self._ts_rows = None
            default = shard_output is None
            import torch_xla

            for p in module.parameters():
                # A parameter that already ran on the device carries an explicit "replicated"
                # sharding, which torch_xla's FSDPv2 takes for the user's and leaves alone (a
                # model evaluated before wrapping would stay whole): shard it like the others.
                if p.device.type == "xla" and torch_xla._XLAC._get_xla_sharding_spec(p) == hlo.REPLICATED:
                    torch_xla._XLAC._xla_clear_sharding(p)

            def shard_batch_outputs(output, mesh):
                rows = self._ts_rows
                for t in _tensors(output):
                    if t.dim() > 0 and (rows is None or t.shape[0] == rows) and t.device.type == "xla":
                        _xs().mark_sharding(t, mesh, _prepare_spmd_partition_spec(t, extra_data_axis))

            super().__init__(module, mesh=mesh, shard_output=shard_batch_outputs if default else shard_output,
                             auto_wrap_policy=auto_wrap_policy, auto_wrapper_callable=auto_wrapper_callable,
                             extra_data_axis=extra_data_axis)
            self._ts_autocast = autocast_dtype
            self._register_state_dict_hook(state_keys.strip_prefix_hook)
            self._register_load_state_dict_pre_hook(state_keys.add_prefix_hook)

        def forward(self, *args, **kwargs):
            first = next((t for t in _tensors((args, kwargs)) if t.dim() > 0), None)
            self._ts_rows = None if first is None else first.shape[0]
            if self._ts_autocast is None:
                return super().forward(*args, **kwargs)
            with torch.autocast("xla", dtype=self._ts_autocast):
                output = self.module(*args, **kwargs)
            self._shard_output(output, self._mesh)
            return output

        def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
            for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
                yield state_keys.clean(name), p

        def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
            for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
                yield state_keys.clean(name), b

    XlaFSDPv2.__name__ = XlaFSDPv2.__qualname__ = "SpmdFullyShardedDataParallel"
    _XLA_FSDP.append(XlaFSDPv2)
    return XlaFSDPv2


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):  # also a transformers ModelOutput
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _clean_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {state_keys.clean(k): v for k, v in model.state_dict().items()}


def _no_dist() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized()


class XlaEngine(Engine):
    name = "xla"
    backends = ("xla",)
    capabilities = Capabilities(process_per_device=False, static_shapes=True, lazy_tensors=True, fused_optimizers=False,
                                hub_kernels=False, transformers_shards=True, tuple_axes_in_mesh_order=False,
                                checkpoint_in_place=True)

    def __init__(self):
        self._warned_pjrt = False

    # -- choice and start ----------------------------------------------------------------------
    def default_backend(self) -> str | None:
        """``xla`` when ``PJRT_DEVICE`` is set and torch_xla is installed (torch_xla's own switch)."""
        if not os.environ.get(PJRT_DEVICE):
            return None
        if installed():
            return "xla"
        if not self._warned_pjrt:
            self._warned_pjrt = True
            warnings.warn(f"{PJRT_DEVICE}={os.environ[PJRT_DEVICE]} is set but torch_xla is not installed: torchspmd "
                          f"uses its native engine ({INSTALL.split(' (')[0]} for the torch_xla engine)")
        return None

    def usable(self, backend: str, where: str, explicit: bool) -> str | None:
        if installed():
            return None
        try:
            require(where)
        except SpmdError as e:
            return str(e)
        return None

    def start(self, backend: str, *, auto: bool, num_devices: int | None) -> torch.device:
        """SPMD mode, one process for all local devices. ``num_devices`` must match what
        PJRT shows; on the CPU client it sets ``CPU_NUM_DEVICES`` when that is unset."""
        source = "use_spmd(num_devices=...)"
        if num_devices is None and os.environ.get(ENV_NUM_DEVICES):
            num_devices, source = parse_count(os.environ[ENV_NUM_DEVICES], ENV_NUM_DEVICES, "leave it unset on the torch_xla engine"), ENV_NUM_DEVICES
        if num_devices is not None and (type(num_devices) is not int or num_devices < 1):
            raise SpmdError(f"{source}: {num_devices!r} is not a positive number of devices")
        if num_devices is not None and os.environ.get(PJRT_DEVICE, "").upper() == "CPU" \
                and not os.environ.get("CPU_NUM_DEVICES"):
            os.environ["CPU_NUM_DEVICES"] = str(num_devices)  # CPU PJRT reads it when the runtime starts
        require()
        import torch_xla

        xr = _xr()
        xr.use_spmd(auto=auto)
        have = xr.addressable_runtime_device_count()
        if num_devices is not None and num_devices != have:
            raise SpmdError(
                f"{source} = {num_devices}: torch_xla drives all {have} devices of this host from one process and "
                f"the count is fixed by PJRT ({PJRT_DEVICE}={os.environ.get(PJRT_DEVICE, '')!r}, CPU_NUM_DEVICES "
                f"on the CPU client); leave it unset on the torch_xla engine"
            )
        if xr.process_count() > 1:
            import torch.distributed as dist

            if not dist.is_initialized():  # host-side coordination for distributed checkpoints
                import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// init method)

                dist.init_process_group("gloo", init_method="xla://")
        return torch_xla.device()

    # -- topology: torch_xla's meanings ------------------------------------------------------
    def _count(self, name: str) -> int:
        require(f"torchspmd.{name}() (the torch_xla engine)")
        return getattr(_xr(), name)()

    def global_runtime_device_count(self) -> int:
        return self._count("global_runtime_device_count")

    def addressable_runtime_device_count(self) -> int:
        return self._count("addressable_runtime_device_count")

    def global_device_count(self) -> int:
        return self._count("global_device_count")

    def addressable_device_count(self) -> int:
        return self._count("addressable_device_count")

    def local_device_count(self) -> int:
        return self._count("local_device_count")

    def global_ordinal(self) -> int:
        return self._count("global_ordinal")

    def local_ordinal(self) -> int:
        return self._count("local_ordinal")

    def process_index(self) -> int:
        return self._count("process_index")

    def process_count(self) -> int:
        return self._count("process_count")

    def world_size(self) -> int:
        return self._count("world_size")

    def planned_processes(self, backend: str, num_devices: int | None) -> int | None:
        return None  # torch_xla counts its devices when it starts; one process drives them

    def describe(self, backend: str) -> list[str]:
        return [f"local devices {self.addressable_runtime_device_count()} (one process drives them: torch_xla)"]

    def peak_memory_gb(self) -> float | None:
        if os.environ.get(PJRT_DEVICE, "").upper() == "CPU":
            return None  # the CPU client reports no device memory: the process's peak RSS is it
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(_device())
        return info.get("peak_bytes_used", info.get("bytes_used", 0)) / 2**30

    # -- steps ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, index: int = 0) -> Iterator[None]:
        import torch_xla

        with torch_xla.step():
            yield

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()

    # -- meshes --------------------------------------------------------------------------------
    def own_class(self, kind: str):
        if kind == "Mesh":
            return _xs().Mesh
        if kind == "HybridMesh":
            return (_xs().HybridMesh, _host_hybrid_class())
        if kind == "ShardingSpec":
            return _xs().ShardingSpec
        if kind == "MpDeviceLoader":
            from torch_xla.distributed.parallel_loader import MpDeviceLoader

            return MpDeviceLoader
        if kind == "FSDPv2":
            from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
                SpmdFullyShardedDataParallel,
            )

            return SpmdFullyShardedDataParallel
        return None

    def own_mesh(self, view):
        _check_size(view)
        return _remember(_xs().Mesh(view.device_ids, view.mesh_shape, view.axis_names))

    def own_hybrid_mesh(self, ici_mesh_shape, dcn_mesh_shape, axis_names, view: Callable):
        """torch_xla's HybridMesh (laid out by the TPU topology) on TPUs; on other PJRT
        devices, where torch_xla's needs TPU coordinates, the devices laid out host by host
        as on the native engine."""
        import torch_xla.core.xla_model as xm

        if xm.xla_device_hw(_device()) == "TPU":
            return _remember(_xs().HybridMesh(ici_mesh_shape=tuple(ici_mesh_shape),
                                              dcn_mesh_shape=None if dcn_mesh_shape is None else tuple(dcn_mesh_shape),
                                              axis_names=None if axis_names is None else tuple(axis_names)))
        ici, dcn, full = hybrid_layout(ici_mesh_shape, dcn_mesh_shape, _xr().global_runtime_device_count(),
                                       _xr().addressable_runtime_device_count())
        checked = view(full.reshape(-1), full.shape, axis_names)  # torchspmd's checks of the names
        out = _host_hybrid_class()(checked.device_ids, checked.mesh_shape, checked.axis_names)
        out.ici_mesh_shape, out.dcn_mesh_shape = ici, dcn
        return _remember(out)

    def set_global_mesh(self, mesh) -> None:
        _xs().set_global_mesh(mesh)

    def get_global_mesh(self):
        return _xs().get_global_mesh()

    def get_1d_mesh(self, axis_name: str | None):
        return _remember(_xs().get_1d_mesh(axis_name))

    # -- sharding ------------------------------------------------------------------------------
    def mark_sharding(self, t, mesh, spec, resolved):
        t = getattr(t, "global_tensor", t)  # an XLAShardedTensor
        if t.device.type != "xla":
            if isinstance(t, nn.Parameter):
                raise SpmdError("mark_sharding: the parameter is on the CPU; move its module to torchspmd.device() "
                                "first")
            t = t.to(_device())
        _xs().mark_sharding(t, mesh, tuple(spec))
        return t

    def mark_sharding_with_gradients(self, t, mesh, spec, resolved):
        return _xs().mark_sharding_with_gradients(_on_device(t), mesh, tuple(spec))

    def enable_manual_sharding(self, t, mesh, spec, resolved):
        return _xs().enable_manual_sharding(_on_device(t), tuple(spec), mesh=mesh)

    def disable_manual_sharding(self, t, mesh, spec, resolved, full_shape):
        return _xs().disable_manual_sharding(t, tuple(spec), full_shape, mesh=mesh)

    def clear_sharding(self, t):
        return _xs().clear_sharding(t)

    def get_sharding(self, t):
        """The partition spec of ``t`` (None when replicated or unannotated), read from
        torch_xla's annotation against the global mesh, else the newest mesh built through
        torchspmd that expresses it."""
        import torch_xla

        text = torch_xla._XLAC._get_xla_sharding_spec(getattr(t, "global_tensor", t))
        if text in ("", hlo.REPLICATED):
            return None
        meshes = [m for m in [self.get_global_mesh(), *reversed(_MESHES)] if m is not None]
        for mesh in meshes:
            grid = np.asarray(mesh.device_ids).reshape(tuple(mesh.mesh_shape))
            spec = hlo.partition_spec(text, grid, mesh.axis_names, t.dim())
            if spec is not None:
                return spec
        raise SpmdError(f"get_sharding: the tensor's sharding {text} is no partition spec of "
                        f"{'the meshes built so far' if meshes else 'any mesh: none was built'}")

    def visualize_sharding(self, t, use_color: bool):
        from torch_xla.distributed.spmd import debugging

        if isinstance(t, str):  # an HLO sharding text, as torch_xla's visualize_sharding takes
            return debugging.visualize_sharding(t, use_color=use_color)
        return debugging.visualize_tensor_sharding(getattr(t, "global_tensor", t), use_color=use_color)

    def sharding_spec(self, mesh, spec, minibatch: bool):
        return _xs().ShardingSpec(mesh, spec, minibatch=minibatch)

    # -- data ----------------------------------------------------------------------------------
    def loader(self, loader, device, input_sharding, *, fixed_batch_size: bool = False, **options):
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        if fixed_batch_size:
            raise SpmdError("MpDeviceLoader(fixed_batch_size=True) is not available on the torch_xla engine "
                            "(torch_xla's loader has no such option); drop the odd last batch in the DataLoader "
                            "(drop_last=True)")
        options.pop("host_to_device_transfer_threads", None)
        return MpDeviceLoader(loader, device, input_sharding=input_sharding, **options)

    def shard_batch(self, batch: Any, input_sharding, device) -> Any:
        """Each tensor moved to the device and marked as its spec says (a tensor the spec does
        not fit stays replicated, as in torch_xla's loader). Marked after the transfer: torch_xla
        2.9's sharded host-to-device transfer fails for 1-D tensors split over part of a mesh."""
        def place(t, spec):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.to(device)
            if spec.can_apply(t):
                _xs().mark_sharding(t, spec.mesh, spec.partition_spec)
            return t

        if isinstance(input_sharding, dict):
            if not isinstance(batch, dict):
                raise SpmdError("shard_batch: input_sharding is a dict, so the batch must be a dict with the same "
                                "keys")
            missing = [k for k in batch if isinstance(batch[k], torch.Tensor) and k not in input_sharding]
            if missing:
                raise KeyError(f"shard_batch: input_sharding has no spec for batch key {missing[0]!r}")
            return {k: place(v, input_sharding.get(k)) for k, v in batch.items()}
        if isinstance(batch, torch.Tensor):
            return place(batch, input_sharding)
        if isinstance(batch, dict):
            return {k: place(v, input_sharding) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(place(v, input_sharding) for v in batch)
        return batch

    # -- wrappers ------------------------------------------------------------------------------
    def replicate(self, module, mesh, data_dims, shard_output, ddp_kwargs):
        """Data parallelism under GSPMD: parameters are replicated unless annotated, the batch's
        input sharding splits the work (so ``data_axes`` has nothing to add), XLA reduces the
        gradients."""
        if ddp_kwargs:
            raise SpmdError(f"replicate({', '.join(ddp_kwargs)}=...): DistributedDataParallel options have no "
                            f"meaning on the torch_xla engine, where GSPMD reduces the gradients; drop them")
        module.to(_device())
        if shard_output is not None:
            module.register_forward_hook(lambda mod, args, out: shard_output(out, mesh))
        return module

    def fully_shard(self, module, mesh, shard_output, auto_wrap_policy, auto_wrapper_callable, extra_data_axis,
                    options):
        if options.get("cpu_offload"):
            raise SpmdError("FSDPv2(cpu_offload=True) is not available on the torch_xla engine: torch_xla's FSDPv2 "
                            "keeps the shards in device memory; use the native engine for host offload")
        reshard = options.get("reshard_after_forward")
        if reshard is not None and reshard is not True:
            raise SpmdError(f"FSDPv2(reshard_after_forward={reshard!r}) is not available on the torch_xla engine: "
                            f"the XLA compiler decides when gathered parameters are freed; leave it unset")
        if options.get("collectives", "auto") != "auto":
            raise SpmdError(f"FSDPv2(collectives={options['collectives']!r}) is not available on the torch_xla "
                            f"engine: GSPMD inserts its own collectives; leave it 'auto'")
        if options.get("compile", False) not in (False, True):
            raise SpmdError("FSDPv2(compile={...}): torch.compile options belong to the native engine; on the "
                            "torch_xla engine every step is compiled by XLA already (compile=True is accepted and "
                            "changes nothing)")
        if options.get("per_process"):
            raise SpmdError("FSDPv2(per_process=True) is not available on the torch_xla engine: GSPMD computes the "
                            "global view of the program; leave it unset")
        names = tuple(mesh.axis_names)
        if "context" in names and mesh.mesh_shape[names.index("context")] > 1:
            raise SpmdError(f"FSDPv2 over a mesh with a 'context' axis of {mesh.mesh_shape[names.index('context')]} "
                            f"is the native engine's (parameters sharded over 'fsdp' x 'context', ring attention "
                            f"over the split sequence); torch_xla's FSDPv2 shards over 'fsdp' alone: run on the "
                            f"native engine (use_spmd(backend='native')), or name the axis otherwise to let GSPMD "
                            f"partition a sequence annotated over it")
        dtype = _autocast_dtype(options.get("mixed_precision"))
        return _fsdp_class()(module, mesh=mesh, shard_output=shard_output, auto_wrap_policy=auto_wrap_policy,
                             auto_wrapper_callable=auto_wrapper_callable, extra_data_axis=extra_data_axis,
                             autocast_dtype=dtype)

    def shard_in_place(self, module, mesh, shard_output, extra_data_axis, options):
        raise SpmdError("shard_in_place is the native engine's (FSDP2 units without wrapper modules); on the "
                        "torch_xla engine wrap with FSDPv2")

    def is_fully_sharded(self, module) -> bool:
        return isinstance(module, self.own_class("FSDPv2"))

    def checkpoint_module(self, module):
        from torch_xla.distributed.fsdp import (
            checkpoint_module as xla_checkpoint_module,
        )

        return xla_checkpoint_module(module)

    # -- gradients and state -------------------------------------------------------------------
    def clip_grad_norm_(self, params, max_norm, norm_type, error_if_nonfinite):
        params = [p for p in params if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def full_state_dict(self, model, rank0_only, cpu):
        keep = not rank0_only or _xr().process_index() == 0
        out = {}
        for key, value in _clean_state_dict(model).items():
            value = value.detach()
            if keep:
                out[key] = value.cpu() if cpu else value.clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, model, state_dict, strict):
        import torch_xla

        pairs, missing = state_keys.match(model, _clean_state_dict(model), state_dict, strict)
        for _, cur, src in pairs:
            sharding = torch_xla._XLAC._get_xla_op_sharding(cur)
            cur.copy_(src.to(dtype=cur.dtype))
            if sharding is not None:  # an in-place copy drops the annotation: put it back
                torch_xla._XLAC._xla_mark_sharding(cur, sharding)
        self.sync()
        return missing

    # -- sharded checkpoints -------------------------------------------------------------------
    def save_state(self, state_dict: dict, storage_writer) -> None:
        """torch_xla's planner writes each device's shards; the layout and keys are the
        native engine's."""
        import torch.distributed.checkpoint as dcp
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        self.sync()
        dcp.save(state_dict, storage_writer=storage_writer, planner=SPMDSavePlanner(), no_dist=_no_dist())

    def load_state(self, state_dict: dict, storage_reader) -> None:
        """Loaded in place into the (sharded) device tensors of ``state_dict``."""
        import torch.distributed.checkpoint as dcp
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        self.sync()
        dcp.load(state_dict, storage_reader=storage_reader, planner=SPMDLoadPlanner(), no_dist=_no_dist())
        self.sync()

    def prime_optimizer(self, optimizer) -> None:
        """Create the optimizer's state on the device (zero gradients, one step, undone)."""
        from torch_xla.experimental.distributed_checkpoint import (
            prime_optimizer as xla_prime,
        )

        lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:  # a step that changes no parameter (AdamW's decay scales with lr)
            g["lr"] = 0.0
        xla_prime(optimizer)
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
