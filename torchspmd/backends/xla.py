"""The XLA backend: every public call handed to torch_xla (TPUs; CPU PJRT for tests).

One process drives all of its host's devices and torch_xla's GSPMD partitioner inserts
the collectives, so a program runs at torch_xla's own speed. Each function here has the
name of the public call it serves (``torchspmd._delegate`` routes the call). What
torch_xla has no equivalent for is refused with an error that says so.

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
import importlib.util
import itertools
import os
import sys
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from torchspmd._errors import SpmdError

INSTALL = (
    "pip install 'torchspmd[tpu]' (torch_xla needs the torch of its own version: on a TPU VM "
    "`pip install torch==2.9.0 'torch_xla[tpu]==2.9.0'`; to try it on CPUs "
    "`pip install torch==2.9.0 torch_xla==2.9.0` and run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4)"
)


def installed() -> bool:
    """torch_xla can be imported (under --xla-compat, `torch_xla` is torchspmd's layer: no)."""
    from torchspmd import compat

    if compat.active():
        return False
    return importlib.util.find_spec("torch_xla") is not None


def require(api: str = "use_spmd(backend='xla')") -> None:
    """Import torch_xla, or explain how to get it."""
    if not installed():
        raise SpmdError(
            f"{api}: torch_xla is not installed in this Python environment ({sys.executable}); install it with "
            f"{INSTALL}, or use the native engine (backend='cpu' or 'cuda')"
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


def counterpart(factory: str):
    """torch_xla's class built by ``factory`` (for ``isinstance``), once torch_xla is loaded."""
    if "torch_xla" not in sys.modules:
        return None
    if factory == "mesh":
        return _xs().Mesh
    if factory == "hybrid_mesh":
        return (_xs().HybridMesh, _host_hybrid_class())
    if factory == "sharding_spec":
        return _xs().ShardingSpec
    if factory == "loader":
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        return MpDeviceLoader
    if factory == "fsdpv2":
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        return SpmdFullyShardedDataParallel
    return None


# -- runtime ----------------------------------------------------------------------------

def start(auto: bool, num_devices: int | None, source: str = "use_spmd(num_devices=...)") -> torch.device:
    """``use_spmd()`` on torch_xla: SPMD mode, one process for all local devices.
    ``num_devices`` (named by ``source`` in errors) must match what PJRT shows; on the CPU
    client it sets ``CPU_NUM_DEVICES`` when that is unset."""
    if num_devices is not None and (type(num_devices) is not int or num_devices < 1):
        raise SpmdError(f"{source}: {num_devices!r} is not a positive number of devices")
    if num_devices is not None and os.environ.get("PJRT_DEVICE", "").upper() == "CPU" \
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
            f"the count is fixed by PJRT (PJRT_DEVICE={os.environ.get('PJRT_DEVICE', '')!r}, CPU_NUM_DEVICES on "
            f"the CPU client); leave it unset on the XLA backend"
        )
    if xr.process_count() > 1:
        import torch.distributed as dist

        if not dist.is_initialized():  # host-side coordination for distributed checkpoints
            import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// init method)

            dist.init_process_group("gloo", init_method="xla://")
    return torch_xla.device()


@contextlib.contextmanager
def step() -> Iterator[None]:
    import torch_xla

    with torch_xla.step():
        yield


def sync() -> None:
    import torch_xla

    torch_xla.sync()


# -- meshes -----------------------------------------------------------------------------

def _check_size(mesh) -> None:
    n = _xr().global_runtime_device_count()
    if int(np.prod(mesh.mesh_shape)) != n:
        raise SpmdError(
            f"Mesh of shape {tuple(mesh.mesh_shape)} is not mappable over {n} devices: the product of "
            f"mesh_shape must equal global_runtime_device_count() ({n})"
        )


def mesh(cls, device_ids, mesh_shape, axis_names=None):
    from torchspmd.mesh import Mesh

    view = type.__call__(Mesh, device_ids, mesh_shape, axis_names)  # torchspmd's checks and messages
    _check_size(view)
    return _remember(_xs().Mesh(view.device_ids, view.mesh_shape, view.axis_names))


def hybrid_mesh(cls, *, ici_mesh_shape, dcn_mesh_shape=None, axis_names=None):
    """torch_xla's HybridMesh (laid out by the TPU topology) on TPUs; on other PJRT devices,
    where torch_xla's needs TPU coordinates, the devices laid out host by host as on the
    native engine."""
    import torch_xla.core.xla_model as xm

    if xm.xla_device_hw(_device()) == "TPU":
        return _remember(_xs().HybridMesh(ici_mesh_shape=tuple(ici_mesh_shape),
                                          dcn_mesh_shape=None if dcn_mesh_shape is None else tuple(dcn_mesh_shape),
                                          axis_names=None if axis_names is None else tuple(axis_names)))
    from torchspmd.mesh import Mesh, hybrid_layout

    ici, dcn, full = hybrid_layout(ici_mesh_shape, dcn_mesh_shape, _xr().global_runtime_device_count(),
                                   _xr().addressable_runtime_device_count())
    view = type.__call__(Mesh, full.reshape(-1), full.shape, axis_names)  # torchspmd's checks of the names
    out = _host_hybrid_class()(view.device_ids, view.mesh_shape, view.axis_names)
    out.ici_mesh_shape, out.dcn_mesh_shape = ici, dcn
    return _remember(out)


_HOST_HYBRID = None


def _host_hybrid_class():
    """A torch_xla ``Mesh`` laid out host by host (``HybridMesh`` off TPUs)."""
    global _HOST_HYBRID
    if _HOST_HYBRID is None:
        _HOST_HYBRID = type("HybridMesh", (_xs().Mesh,), {"__module__": __name__})
    return _HOST_HYBRID


_MESHES: list = []  # meshes built through torchspmd, newest last: get_sharding reads specs against them


def _remember(mesh):
    _MESHES.append(mesh)
    del _MESHES[:-16]
    return mesh


def _as_view(mesh, api: str):
    """torchspmd's view of a torch_xla mesh (for checking partition specs)."""
    from torchspmd.mesh import Mesh

    if not isinstance(mesh, _xs().Mesh):
        if type.__instancecheck__(Mesh, mesh):
            raise SpmdError(f"{api}: this Mesh was built before use_spmd() chose the XLA backend; call "
                            f"torchspmd.use_spmd() first, then build the mesh")
        raise SpmdError(f"{api}: mesh must be a Mesh, got {type(mesh).__name__}")
    return type.__call__(Mesh, np.asarray(mesh.device_ids), mesh.mesh_shape, mesh.axis_names)


def _check_spec(mesh, partition_spec, ndim: int | None, api: str):
    from torchspmd.sharding import resolve_partition_spec

    return resolve_partition_spec(_as_view(mesh, api), partition_spec, ndim, api, mesh_order=False)


def set_global_mesh(mesh) -> None:
    if mesh is not None:
        _as_view(mesh, "set_global_mesh(mesh=...)")
    _xs().set_global_mesh(mesh)


def get_global_mesh():
    return _xs().get_global_mesh()


def get_1d_mesh(axis_name: str | None = None):
    return _remember(_xs().get_1d_mesh(axis_name))


# -- sharding -----------------------------------------------------------------------------

def _device():
    import torch_xla

    return torch_xla.device()


def mark_sharding(t: torch.Tensor, mesh, partition_spec):
    if not isinstance(t, torch.Tensor):
        raise SpmdError(f"mark_sharding: t must be a torch.Tensor, got {type(t).__name__}")
    t = getattr(t, "global_tensor", t)  # an XLAShardedTensor
    _check_spec(mesh, partition_spec, t.dim(), "mark_sharding")
    if t.device.type != "xla":
        if isinstance(t, nn.Parameter):
            raise SpmdError("mark_sharding: the parameter is on the CPU; move its module to torchspmd.device() first")
        t = t.to(_device())
    _xs().mark_sharding(t, mesh, tuple(partition_spec))
    return t


def mark_sharding_with_gradients(t: torch.Tensor, mesh, partition_spec):
    if not isinstance(t, torch.Tensor):
        raise SpmdError(f"mark_sharding_with_gradients: t must be a torch.Tensor, got {type(t).__name__}")
    _check_spec(mesh, partition_spec, t.dim(), "mark_sharding_with_gradients")
    if t.device.type != "xla":
        t = t.to(_device())
    return _xs().mark_sharding_with_gradients(t, mesh, tuple(partition_spec))


def enable_manual_sharding(t: torch.Tensor, partition_spec, *, mesh=None):
    if isinstance(t, torch.Tensor) and t.device.type != "xla":
        t = t.to(_device())
    return _xs().enable_manual_sharding(t, tuple(partition_spec), mesh=mesh)


def disable_manual_sharding(t: torch.Tensor, partition_spec, full_shape, *, mesh=None):
    return _xs().disable_manual_sharding(t, tuple(partition_spec), full_shape, mesh=mesh)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    return _xs().clear_sharding(t)


def _sharding_string(t: torch.Tensor) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(getattr(t, "global_tensor", t))


def op_sharding_string(mesh_shape, partition_spec_axes) -> str:
    """The HLO sharding XLA reports for a tensor laid out by ``partition_spec_axes`` (per
    tensor dim, the tuple of mesh axis indices) on a mesh of ``mesh_shape`` whose device
    ids are ``0..n-1`` in order."""
    shape = tuple(mesh_shape)
    tiles = [int(np.prod([shape[a] for a in axes])) if axes else 1 for axes in partition_spec_axes]
    used = [a for axes in partition_spec_axes for a in axes]
    rest = [a for a in range(len(shape)) if a not in used]
    replicas = int(np.prod([shape[a] for a in rest])) if rest else 1
    if all(t == 1 for t in tiles):
        return "{replicated}"
    ids = np.arange(int(np.prod(shape))).reshape(shape).transpose(used + rest).reshape(-1)
    dims = tiles + ([replicas] if replicas > 1 else [])
    text = "{devices=[" + ",".join(map(str, dims)) + "]" + ",".join(map(str, ids))
    return text + (" last_tile_dim_replicate}" if replicas > 1 else "}")


def get_sharding(t: torch.Tensor):
    """The partition spec of ``t`` (None when replicated or unannotated), read from torch_xla's
    annotation against the global mesh, else the newest mesh built through torchspmd that
    expresses it."""
    text = _sharding_string(t)
    if text in ("", "{replicated}"):
        return None
    meshes = [m for m in [get_global_mesh(), *reversed(_MESHES)] if m is not None]
    for mesh in meshes:
        spec = _spec_on(mesh, t.dim(), text)
        if spec is not None:
            return spec
    raise SpmdError(f"get_sharding: the tensor's sharding {text} is no partition spec of "
                    f"{'the meshes built so far' if meshes else 'any mesh: none was built'}")


def _spec_on(mesh, ndim: int, text: str):
    shape = tuple(mesh.mesh_shape)
    if "]" not in text:
        return None
    tiles = [int(x) for x in text.split("[", 1)[1].split("]", 1)[0].split(",")][:ndim]
    if len(tiles) != ndim:
        return None
    axes = [a for a in range(len(shape)) if shape[a] > 1]  # size-1 axes change nothing: left out
    groups = [p for r in range(1, len(axes) + 1) for c in itertools.combinations(axes, r)
              for p in itertools.permutations(c)]
    # per tensor dim, only the axis groups whose sizes multiply to that dim's tile count
    choices = [[()] if t == 1 else [g for g in groups if int(np.prod([shape[a] for a in g])) == t] for t in tiles]
    for combo in itertools.product(*choices):
        flat = [a for axes_ in combo for a in axes_]
        if len(flat) != len(set(flat)):
            continue
        want = op_sharding_string(mesh.mesh_shape, combo)
        if _renumber(want, np.asarray(mesh.device_ids)) == text:
            names = mesh.axis_names
            label = (lambda a: names[a]) if names else (lambda a: a)
            return tuple(None if not c else label(c[0]) if len(c) == 1 else tuple(label(a) for a in c)
                         for c in combo)
    return None


def _renumber(text: str, device_ids: np.ndarray) -> str:
    """Replace positions 0..n-1 by the mesh's device ids in an op-sharding string."""
    if "]" not in text:
        return text
    head, tail = text.split("]", 1)
    suffix = " last_tile_dim_replicate}" if tail.endswith(" last_tile_dim_replicate}") else "}"
    body = tail[: -len(suffix)]
    ids = [str(int(device_ids[int(i)])) for i in body.split(",")]
    return head + "]" + ",".join(ids) + suffix


def visualize_sharding(t: torch.Tensor | str, use_color: bool = True):
    from torch_xla.distributed.spmd import debugging

    if isinstance(t, str):  # an HLO sharding text, as torch_xla's visualize_sharding takes
        return debugging.visualize_sharding(t, use_color=use_color)
    return debugging.visualize_tensor_sharding(getattr(t, "global_tensor", t), use_color=use_color)


visualize_tensor_sharding = visualize_sharding


def sharding_spec(cls, mesh, partition_spec, minibatch: bool = False):
    spec = tuple(partition_spec) if isinstance(partition_spec, list) else partition_spec
    _check_spec(mesh, spec, None, "ShardingSpec")
    return _xs().ShardingSpec(mesh, spec, minibatch=minibatch)


# -- data ---------------------------------------------------------------------------------

def _check_input_sharding(input_sharding, api: str) -> None:
    xs = _xs()
    specs = input_sharding.values() if isinstance(input_sharding, dict) else [input_sharding]
    for s in specs:
        if s is not None and not isinstance(s, xs.ShardingSpec):
            raise SpmdError(f"{api}(input_sharding=...): expected a ShardingSpec, a dict of them, or None; "
                            f"got {type(s).__name__}")


def loader(cls, loader, device, *, input_sharding=None, fixed_batch_size: bool = False, **kwargs):
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    _check_input_sharding(input_sharding, "MpDeviceLoader")
    if fixed_batch_size:
        raise SpmdError("MpDeviceLoader(fixed_batch_size=True) is not available on the XLA backend (torch_xla's "
                        "loader has no such option); drop the odd last batch in the DataLoader (drop_last=True)")
    return MpDeviceLoader(loader, device, input_sharding=input_sharding, **kwargs)


def shard_batch(batch: Any, input_sharding, device=None) -> Any:
    """Each tensor moved to the device and marked as its spec says (a tensor the spec does
    not fit stays replicated, as in torch_xla's loader). Marked after the transfer: torch_xla
    2.9's sharded host-to-device transfer fails for 1-D tensors split over part of a mesh."""
    _check_input_sharding(input_sharding, "shard_batch")
    if input_sharding is None or (isinstance(input_sharding, dict) and any(v is None for v in input_sharding.values())):
        raise SpmdError("shard_batch(input_sharding=...): give a ShardingSpec, or a dict of them (no None values)")
    device = device if device is not None else _device()

    def place(t, spec):
        if not isinstance(t, torch.Tensor):
            return t
        if spec.minibatch:
            raise SpmdError("shard_batch(input_sharding=...): minibatch=True specs describe per-process parts; "
                            "shard_batch takes the whole batch")
        t = t.to(device)
        if spec.can_apply(t):
            _xs().mark_sharding(t, spec.mesh, spec.partition_spec)
        return t

    if isinstance(input_sharding, dict):
        if not isinstance(batch, dict):
            raise SpmdError("shard_batch: input_sharding is a dict, so the batch must be a dict with the same keys")
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


def replicate(module: nn.Module, mesh=None, *, data_axes=None, shard_output: Callable | None = None, **ddp_kwargs):
    """Data parallelism under GSPMD: parameters are replicated unless annotated, the batch's
    input sharding splits the work (so ``data_axes`` has nothing to add and is not used),
    XLA reduces the gradients."""
    if ddp_kwargs:
        raise SpmdError(f"replicate({', '.join(ddp_kwargs)}=...): DistributedDataParallel options have no meaning "
                        f"on the XLA backend, where GSPMD reduces the gradients; drop them")
    module.to(_device())
    if shard_output is not None:
        m = mesh or get_global_mesh() or get_1d_mesh("data")
        module.register_forward_hook(lambda mod, args, out: shard_output(out, m))
    return module


# -- FSDPv2 -------------------------------------------------------------------------------

def _autocast_dtype(mixed_precision):
    if mixed_precision is None:
        return None
    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}.get(mixed_precision, mixed_precision)
    if dtype is not torch.bfloat16:
        raise SpmdError(
            f"FSDPv2(mixed_precision={mixed_precision!r}) on the XLA backend: only 'bf16' maps to torch_xla "
            f"(autocast to bfloat16 with fp32 master weights); FSDP2 MixedPrecisionPolicy objects and other "
            f"dtypes belong to the native engine"
        )
    return dtype


_XLA_FSDP = None


def _fsdp_class():
    """torch_xla's SpmdFullyShardedDataParallel, with torchspmd's clean state-dict keys,
    every-batch-tensor output sharding and bf16 autocast."""
    global _XLA_FSDP
    if _XLA_FSDP is not None:
        return _XLA_FSDP
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel,
        _prepare_spmd_partition_spec,
    )

    from torchspmd.fsdp.fsdpv2 import _add_prefix_hook, _clean, _strip_prefix_hook

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
                if p.device.type == "xla" and torch_xla._XLAC._get_xla_sharding_spec(p) == "{replicated}":
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
            self._register_state_dict_hook(_strip_prefix_hook)
            self._register_load_state_dict_pre_hook(_add_prefix_hook)

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
                yield _clean(name), p

        def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
            for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
                yield _clean(name), b

    XlaFSDPv2.__name__ = XlaFSDPv2.__qualname__ = "SpmdFullyShardedDataParallel"
    _XLA_FSDP = XlaFSDPv2
    return XlaFSDPv2


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):  # also a transformers ModelOutput
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def fsdpv2(cls, module: nn.Module, mesh=None, shard_output: Callable | None = None,
           auto_wrap_policy: Callable | None = None, auto_wrapper_callable: Callable | None = None,
           extra_data_axis: str | None = None, *, mixed_precision: Any = None,
           reshard_after_forward: bool | int | None = None, cpu_offload: bool = False, collectives: str = "auto",
           compile: bool | dict = False):
    if cpu_offload:
        raise SpmdError("FSDPv2(cpu_offload=True) is not available on the XLA backend: torch_xla's FSDPv2 keeps "
                        "the shards in device memory; use the native engine for host offload")
    if reshard_after_forward is not None and reshard_after_forward is not True:
        raise SpmdError(f"FSDPv2(reshard_after_forward={reshard_after_forward!r}) is not available on the XLA "
                        f"backend: the XLA compiler decides when gathered parameters are freed; leave it unset")
    if collectives != "auto":
        raise SpmdError(f"FSDPv2(collectives={collectives!r}) is not available on the XLA backend: GSPMD inserts "
                        f"its own collectives; leave it 'auto'")
    if compile not in (False, True):
        raise SpmdError("FSDPv2(compile={...}): torch.compile options belong to the native engine; on the XLA "
                        "backend every step is compiled by XLA already (compile=True is accepted and changes nothing)")
    if mesh is not None:
        _as_view(mesh, "FSDPv2(mesh=...)")
    dtype = _autocast_dtype(mixed_precision)
    return _fsdp_class()(module, mesh=mesh, shard_output=shard_output, auto_wrap_policy=auto_wrap_policy,
                         auto_wrapper_callable=auto_wrapper_callable, extra_data_axis=extra_data_axis,
                         autocast_dtype=dtype)


def checkpoint_module(module: nn.Module) -> nn.Module:
    from torch_xla.distributed.fsdp import checkpoint_module as xla_checkpoint_module

    if isinstance(module, counterpart("fsdpv2")):
        raise SpmdError(
            "checkpoint_module: the module is already wrapped by FSDPv2; apply checkpoint_module before FSDPv2, to the "
            "module first and wrap the result: FSDPv2(checkpoint_module(module), ...)"
        )
    if not isinstance(module, nn.Module):
        raise SpmdError(f"checkpoint_module: expected an nn.Module, got {type(module).__name__}")
    return xla_checkpoint_module(module)


# -- gradients and state dicts ------------------------------------------------------------

def clip_grad_norm_(model_or_params, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
    from torchspmd.fsdp.utils import _params

    params = [p for p in _params(model_or_params) if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)


def _clean_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    from torchspmd.fsdp.fsdpv2 import _clean

    return {_clean(k): v for k, v in model.state_dict().items()}


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    keep = not rank0_only or _xr().process_index() == 0
    out = {}
    for key, value in _clean_state_dict(model).items():
        value = value.detach()
        if keep:
            out[key] = value.cpu() if cpu else value.clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> list[str]:
    import torch_xla

    from torchspmd.fsdp.utils import _match

    pairs, missing = _match(model, _clean_state_dict(model), state_dict, strict)
    for _, cur, src in pairs:
        sharding = torch_xla._XLAC._get_xla_op_sharding(cur)
        cur.copy_(src.to(dtype=cur.dtype))
        if sharding is not None:  # an in-place copy drops the annotation: put it back
            torch_xla._XLAC._xla_mark_sharding(cur, sharding)
    sync()
    return missing


# -- distributed checkpoints --------------------------------------------------------------

def _no_dist() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized()


def dcp_save(state_dict: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    sync()
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path), planner=SPMDSavePlanner(), no_dist=_no_dist())


def dcp_load(state_dict: dict, path: str) -> None:
    """Load in place into the (sharded) device tensors of ``state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    sync()
    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), planner=SPMDLoadPlanner(), no_dist=_no_dist())
    sync()


def prime_optimizer(optimizer) -> None:
    """Create the optimizer's state on the device (zero gradients, one step, undone)."""
    from torch_xla.experimental.distributed_checkpoint import prime_optimizer as xla_prime

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:  # a step that changes no parameter (AdamW's decay scales with lr)
        g["lr"] = 0.0
    xla_prime(optimizer)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
