"""The native engine's ``SpmdFullyShardedDataParallel`` (``FSDPv2``): torch_xla's FSDPv2 on PyTorch FSDP2.

Each wrapped module is one FSDP2 communication unit (``fully_shard``) over the mesh's
``'fsdp'`` axis (with ``extra_data_axis``: replicated over that axis, as HSDP): its
parameters, gradients and optimizer state are split over ``'fsdp'``. The outermost
wrapper is the boundary of the global view: its inputs arrive as global batches, its
module computes with plain tensors (FSDP2 gathers the parameters) on this process's rows
where that is proven to give one device's result, else on the whole batch (``unit_rows``),
and its outputs leave as global DTensors through ``shard_output``.

Gradients equal the single-device gradients of the global-mean loss: the loss already
divides by the global batch, so FSDP2 reduces with a sum (never an average).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchspmd import accelerators
from torchspmd.checkpoint_format import keys as state_keys
from torchspmd.engines.native.communication import replicas
from torchspmd.engines.native.global_view import implicit_replication, sequence_split, sharding, unit_rows
from torchspmd.engines.native.start import global_mode
from torchspmd.engines.native.wrappers import pair_proofs, tensor_parallel
from torchspmd.engines.native.global_view import replaced_parameters as _stale
from torchspmd.engines.native.communication.collectives import install as install_collectives
from torchspmd.engines.native.start.device_mesh import device_mesh
from torchspmd.launch.host import release_freed_memory
from torchspmd.engines.native.global_view.module_edges import (
    BatchLayout,
    inputs_to_local,
    local_rows_stream,
    marking_outputs,
    output_to_global,
    replace_marked,
)
from torchspmd.errors import SpmdError
from torchspmd.tree import map_tensors
from torchspmd.wrapping import recursive_wrap

__all__ = ["SpmdFullyShardedDataParallel", "shard_in_place"]


def _mp_policy(mixed_precision: Any):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}.get(
        mixed_precision, mixed_precision
    )
    if not isinstance(dtype, torch.dtype):
        raise SpmdError(
            f"FSDPv2(mixed_precision={mixed_precision!r}): give 'bf16', a torch.dtype or a "
            f"torch.distributed.fsdp.MixedPrecisionPolicy"
        )
    # Compute in `dtype`, keep fp32 master weights (the shards), reduce gradients in fp32.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class SpmdFullyShardedDataParallel(nn.Module):
    """The native engine's FSDPv2 (``torchspmd.FSDPv2`` documents the arguments, checked
    there; ``mesh`` is given)."""

    def __init__(
        self,
        module: nn.Module,
        mesh,
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
        _check_wrap_order(module)
        super().__init__()
        sharding.untile_parameters(module)
        # Values FSDP2 splits (or leaves whole) must be one value before they are split:
        # checked once, rank 0's copied where a process differs (docs/launching.md).
        replicas.agree_once([t for t in (*module.parameters(), *module.buffers()) if not isinstance(t, DTensor)])
        before = list(module.named_parameters(remove_duplicate=False))  # (an optimizer built on them is refused)
        options = dict(mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
                       cpu_offload=cpu_offload, collectives=collectives, strict_sharding=strict_sharding)
        fqn = {m: n for n, m in module.named_modules()}
        if auto_wrap_policy is not None:
            for name, sub in module.named_modules():
                if isinstance(sub, SpmdFullyShardedDataParallel):
                    raise ValueError(
                        f"Expected {name} to NOT be SpmdFullyShardedDataParallel if using an `auto_wrap_policy`: "
                        f"wrap by hand or by policy, not both"
                    )
            with tensor_parallel.naming(fqn):  # messages name parameters as the model does
                recursive_wrap(
                    module, auto_wrap_policy, auto_wrapper_callable or SpmdFullyShardedDataParallel,
                    only_wrap_children=True, mesh=mesh, shard_output=shard_output, extra_data_axis=extra_data_axis,
                    **options,
                )
        self._orig_module = module
        module.register_forward_hook(_traversable_output)
        self._mesh = mesh
        self._shard_output = shard_output
        self._is_root = True
        self._fp32_outputs = mixed_precision is not None  # losses are computed in full precision
        self._param_dtype = _mp_policy(mixed_precision).param_dtype  # (the dtype the model computes in)
        #: where each kind of call computes: this process's rows where proven, else the whole batch
        self._rows = unit_rows.RowPaths(per_process)
        # FSDP2 keeps the root's gathered parameters after forward for the backward that
        # follows; a forward without gradients has none: freed then (eval loops keep 1/n).
        self._reshard_after_eval = reshard_after_forward is None
        for sub in module.modules():
            if isinstance(sub, SpmdFullyShardedDataParallel):
                sub._is_root = False  # only the outermost wrapper is the global-view boundary
        self._data_dims, self._fsdp_mesh = _unit_meshes(mesh, extra_data_axis)
        #: the data axes a batch split on a later dim does not count as its rows' ('context' is one
        #: of the data axes for FSDP's sharding, but splits a batch on its sequence)
        self._batch_dims = [d for d in self._data_dims if mesh.axis_names[d] != "context"]
        with tensor_parallel.naming(fqn):
            _shard_unit(module, mesh, self._data_dims, self._fsdp_mesh, **options)
        #: which tensor-parallel pairs keep their activation split, per kind of call (proven)
        self._pairs = pair_proofs.PairProofs(module)
        _tag_replaced(module, before)
        del before  # (the whole parameters: freed before handing their memory back)
        release_freed_memory()  # the whole parameters this process no longer holds
        if compile:
            _compile_units(module, compile if isinstance(compile, dict) else {})
        self._register_state_dict_hook(state_keys.strip_prefix_hook)
        self._register_load_state_dict_pre_hook(state_keys.add_prefix_hook)

    @property
    def module(self) -> nn.Module:
        """The wrapped module (as DDP's ``.module``)."""
        return self._orig_module

    # -- forward: the global-view boundary ------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._is_root:
            return self._orig_module(*args, **kwargs)
        given = (args, kwargs)
        if sequence_split.axes_splitting_positions(given, self._batch_dims):
            return self._forward_global(args, kwargs)
        args, kwargs, layout = inputs_to_local(args, kwargs, device_mesh(self._mesh), self._data_dims, "FSDPv2")
        kind = (unit_rows.call_kind(*given), self._orig_module.training)
        watch = self._pairs.watch(kind)  # (the same trace decides the pairs)
        with global_mode.local_region():  # (analysed as the local path would run it)
            local = self._rows.local(self._orig_module, kind, args, kwargs, layout, self._data_dims, self._param_dtype,
                                     watch)
            self._pairs.decide(kind, self._orig_module, args, kwargs, watch, self._param_dtype,
                               device_mesh(self._mesh))
        with self._pairs.in_effect(kind):
            if not local:
                return self._forward_whole(given, layout)
            return self._forward_rows(args, kwargs, layout)

    def _run(self, args: tuple, kwargs: dict, *regions) -> Any:
        """The wrapped module's forward inside ``regions`` (context managers), resharded after
        a forward without gradients, its outputs in fp32 under mixed precision."""
        with contextlib.ExitStack() as stack, warnings.catch_warnings():
            for region in regions:
                stack.enter_context(region)
            # A tensor-parallel LM head returns its gathered logits as a view; FSDP2 warns
            # about in-place ops on it, but the output goes on to become a global DTensor here.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            output = self._orig_module(*args, **kwargs)
            if self._reshard_after_eval and not torch.is_grad_enabled():
                self._orig_module.reshard()
        if self._fp32_outputs:
            output = map_tensors(output, lambda t: t.float() if t.is_floating_point() else t)
        return output

    def _forward_rows(self, args: tuple, kwargs: dict, layout: BatchLayout) -> Any:
        """Each process computes its own rows (proven to give one device's result)."""
        output = self._run(args, kwargs, global_mode.local_region(), local_rows_stream(layout, self._data_dims))
        if self._shard_output is not None:
            with marking_outputs(layout, output) as marked:
                returned = self._shard_output(output, self._mesh)
            return returned if returned is not None else replace_marked(output, marked)
        return _default_shard_output(output, layout)

    def _forward_global(self, args: tuple, kwargs: dict) -> Any:
        """A batch split on another dim than its rows (a sequence over 'context'): the model
        computes on the global DTensors, as a program without a wrapper does (DTensor's rules
        and the global view's handlers keep each process on its positions where they can, and
        are exact everywhere), with FSDP2 gathering the parameters as usual. Each parameter's
        gradient comes back as this process's share over the data axes (summed over the
        others), which FSDP2 sums."""
        names = self._mesh.axis_names
        if "model" in names and self._mesh.mesh_shape[names.index("model")] > 1:
            raise SpmdError("FSDPv2: a batch split on its sequence dim (over 'context') inside FSDPv2 with a 'model' "
                            "axis of size > 1 is not supported yet: use a mesh without 'model' (or of size 1) with "
                            "'context'")
        if self._shard_output is not None:
            raise SpmdError("FSDPv2(shard_output=...): with a batch split on its sequence dim (over 'context') the "
                            "outputs are already global DTensors; leave shard_output out")
        return self._run(args, kwargs, implicit_replication.gradient_shares(self._data_dims))

    def _forward_whole(self, given: tuple, layout: BatchLayout) -> Any:
        """The global view (``unit_rows``): every process computes the whole batch and keeps
        its own rows of the outputs."""
        args, kwargs = unit_rows.whole_inputs(*given, layout, self._data_dims)
        output = self._run(args, kwargs, global_mode.local_region(), local_rows_stream(None, self._data_dims))
        if self._shard_output is not None:
            # (the callable marks this process's rows, as it does on the local path)
            rows = map_tensors(output, lambda t: t.narrow(0, layout.local_start, layout.local_rows)
                               if t.dim() and t.shape[0] == layout.global_rows else t)
            with marking_outputs(layout, rows) as marked:
                returned = self._shard_output(rows, self._mesh)
            return returned if returned is not None else replace_marked(rows, marked)
        return unit_rows.outputs_from_whole(output, layout, self._data_dims, "FSDPv2")

    @property
    def per_process(self) -> bool:
        """``FSDPv2(per_process=True)``: every call on this process's rows, unanalysed."""
        return self._rows.per_process

    def pair_paths(self) -> list[tuple[str, str, str | None]]:
        """Each kind of call decided so far, each tensor-parallel pair (its row-parallel
        partner's name) and None where its activation stays split (proven), else why it is
        gathered (``pair_proofs``)."""
        return self._pairs.describe()

    def row_paths(self) -> list[tuple[str, str | None]]:
        """Each kind of call decided so far (its inputs) and where it computes: None on this
        process's rows (proven), else why on the global view (``unit_rows``)."""
        return self._rows.describe()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication (as DDP's ``no_sync``): inside,
        backward keeps whole gradients on every process; the first backward after it
        reduces the accumulated sum."""
        self._orig_module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._orig_module.set_requires_gradient_sync(True)

    # -- clean names: the unwrapped module's keys ------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield state_keys.clean(name), p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
            yield state_keys.clean(name), b

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("_orig_module")
            if inner is None:
                raise
            return getattr(inner, name)

    def __getitem__(self, key):
        return self._orig_module.__getitem__(key)


def _check_wrap_order(module: nn.Module) -> None:
    """Refuse wrappers applied in an order that cannot work, naming the fix."""
    from torch.distributed.fsdp import FSDPModule

    for name, sub in module.named_modules():
        if getattr(sub, "_torchspmd_replicate", None) is not None:
            raise SpmdError(
                f"FSDPv2: module {name or type(module).__name__!r} was made data-parallel by ts.replicate, "
                f"which keeps whole parameters and all-reduces their gradients; FSDPv2 shards them and reduces "
                f"their gradients itself. Wrap the plain model with FSDPv2 alone"
            )
    inside = {id(p) for sub in module.modules() if sub is not module
              and isinstance(sub, (SpmdFullyShardedDataParallel, FSDPModule)) for p in sub.parameters()}
    for name, p in module.named_parameters():
        if _stale.made_by_fsdp(p) and id(p) not in inside:
            raise SpmdError(
                f"FSDPv2: parameter {state_keys.clean(name)!r} is already sharded by an FSDPv2 around a module that contains "
                f"this one: wrap inner modules first (FSDPv2(layer) for each layer, then FSDPv2(model)), or give "
                f"the outer FSDPv2 an auto_wrap_policy"
            )


def _tag_replaced(module: nn.Module, before: list) -> None:
    """The parameters wrapping replaced (an optimizer still holding one is refused at its
    step) and the sharded ones it made (not to be wrapped or annotated again)."""
    now = {id(p) for p in module.parameters()}
    had = {id(p) for _, p in before}
    for name, p in before:
        if id(p) not in now:
            _stale.mark_replaced(p, f"parameter {state_keys.clean(name)!r}, which FSDPv2 replaced with its shard")
    for p in module.parameters():
        if id(p) not in had:
            _stale.mark_fsdp(p)


def _unit_meshes(mesh, extra_data_axis: str | None):
    """(mesh dims splitting the batch, the DeviceMesh FSDP2 shards over).

    A 'context' axis of more than one process shards the parameters together with 'fsdp'
    (FSDP2 over the two flattened into one dim, as torchtitan's ``dp_shard_cp``): each
    process holds ``1 / (fsdp x context)`` of them, and FSDP2's reduce-scatter sums the
    gradients over both. It counts as a data axis here: a batch split over 'context' on its
    sequence computes on the global view (each process's gradient is its share, summed by
    FSDP2), and one not split over it is split on its rows over 'fsdp' x 'context'."""
    dmesh = device_mesh(mesh)
    shard = ["fsdp"]
    if "context" in mesh.axis_names and mesh.mesh_shape[mesh.axis_names.index("context")] > 1:
        shard.append("context")
    shard.sort(key=mesh.axis_names.index)
    names = sorted(([extra_data_axis] if extra_data_axis else []) + shard, key=mesh.axis_names.index)
    data_dims = [mesh.axis_names.index(n) for n in names]
    if len(shard) > 1:
        flat = dmesh[tuple(shard)]._flatten("_".join(shard))
        if not extra_data_axis:
            return data_dims, flat
        return data_dims, dmesh[(extra_data_axis, flat.mesh_dim_names[0])]
    return data_dims, (dmesh[tuple(names)] if len(names) > 1 else dmesh["fsdp"])


def _shard_unit(module: nn.Module, mesh, data_dims: list[int], fsdp_mesh, mixed_precision,
                reshard_after_forward, cpu_offload, collectives: str = "auto", strict_sharding: bool = False) -> None:
    """Make ``module`` one FSDP2 unit (in place), summing gradients over the data axes."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        OffloadPolicy,
        fully_shard,
    )

    managed = {p for m in module.modules() if isinstance(m, FSDPModule) and m is not module for p in m.parameters()}
    # Parameters the user sharded (mark_sharding): over 'model', tensor-parallel compute;
    # over the data axes only, FSDP's own sharding; the rest keep their layout and are
    # gathered whole on use.
    ignored = tensor_parallel.prepare(module, mesh, data_dims, managed, strict_sharding)
    if ignored:
        _gather_on_use(module, ignored, mesh, data_dims)
    offload = CPUOffloadPolicy(pin_memory=accelerators.current() is not None) if cpu_offload else OffloadPolicy()
    extra = {}
    if any(hasattr(p, "_torchspmd_fsdp_dim") for p in module.parameters()):
        # a parameter split by heads on dim 0 (tensor_parallel.py) is split over 'fsdp' on dim 1
        from torch.distributed.tensor import Shard

        extra["shard_placement_fn"] = lambda p: Shard(p._torchspmd_fsdp_dim) if hasattr(p, "_torchspmd_fsdp_dim") \
            else None
    fully_shard(
        module,
        mesh=fsdp_mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=_mp_policy(mixed_precision),
        offload_policy=offload,
        ignored_params=ignored or None,
        **extra,
    )
    _sum_reductions(module)
    install_collectives(module, collectives, one_group=reshard_after_forward is None or isinstance(reshard_after_forward, bool))


def _compile_units(root: nn.Module, options: dict) -> None:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in root.modules() if isinstance(m, FSDPModule) and m is not root] or [root]
    for unit in units:
        # The instance's forward: FSDP2's hooks run around it, eagerly; the module keeps its
        # names and class (state dicts unchanged).
        unit.forward = torch.compile(unit.forward, **options)


def shard_in_place(module: nn.Module, mesh, shard_output: Callable | None = None,
                   extra_data_axis: str | None = None, *, mixed_precision: Any = None,
                   reshard_after_forward: bool | int | None = None, cpu_offload: bool = False,
                   collectives: str = "auto", strict_sharding: bool = False) -> nn.Module:
    """An ``auto_wrapper_callable`` making each auto-wrapped module an FSDPv2 unit without
    a wrapper module around it: the model keeps its module names (for libraries that
    walk them, e.g. PEFT's adapter saving). Returns ``module`` itself, sharded. Only
    inside an FSDPv2 root, which is the global-view boundary."""
    data_dims, fsdp_mesh = _unit_meshes(mesh, extra_data_axis)
    _shard_unit(module, mesh, data_dims, fsdp_mesh, mixed_precision, reshard_after_forward, cpu_offload,
                collectives, strict_sharding)
    return module


def _sum_reductions(module: nn.Module) -> None:
    """FSDP2 averages gradients over the group by default; the global-mean loss already
    divides by the whole batch, so every unit must sum instead."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # With a factor of 1 FSDP2 would ask for PREMUL_SUM, which gloo rejects.
            m.set_force_sum_reduction_for_comms(True)


def _gather_on_use(module: nn.Module, params: set, mesh, data_dims: list[int]) -> None:
    """Inside the unit, a parameter the user sharded is used whole: its owner module sees
    the gathered value during its forward. The gradient flows back as a pending sum over
    the data axes (each process saw its own rows), resolved into the parameter's own
    layout: the parameter, its gradient and optimizer state keep the user's sharding."""
    owners: dict[nn.Module, list[str]] = {}
    for owner in module.modules():
        if getattr(owner, "_torchspmd_checkpointed", False) and any(
            p in params for p in owner.parameters()
        ):
            raise SpmdError(
                "FSDPv2: a module holding parameters sharded with mark_sharding cannot also use "
                "checkpoint_module; checkpoint another module, or leave those parameters unannotated"
            )
        for name, p in owner.named_parameters(recurse=False):
            if p in params:
                if p.device_mesh != device_mesh(mesh):
                    raise SpmdError(
                        f"FSDPv2: parameter {name!r} is sharded over another mesh than FSDPv2's; "
                        f"mark it with the same Mesh"
                    )
                owners.setdefault(owner, []).append(name)

    def gather(p: DTensor) -> torch.Tensor:
        whole = p.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim)
        return whole.to_local(grad_placements=[Partial() if i in data_dims else Replicate()
                                               for i in range(p.device_mesh.ndim)])

    for owner, names in owners.items():
        def pre(mod, args, names=names):
            mod._torchspmd_user_params = {}
            for n in names:
                p = mod._parameters.pop(n)
                mod._torchspmd_user_params[n] = p
                setattr(mod, n, gather(p))

        def post(mod, args, output, names=names):
            for n in names:
                delattr(mod, n)
                mod._parameters[n] = mod._torchspmd_user_params.pop(n)

        owner.register_forward_pre_hook(pre)
        owner.register_forward_hook(post, always_call=True)


def _traversable_output(module, args, output):
    """An output object of the program's own class (Pattern 4's ``output.logits``): FSDP2
    looks for the tensors that backward starts from only in dicts, lists, tuples and
    dataclasses, so it would not re-gather the parameters in backward; its pre-backward
    hook is put on the object's tensor attributes here, as FSDP2 puts it on those it finds."""
    if isinstance(output, (torch.Tensor, dict, list, tuple)) or not hasattr(output, "__dict__") \
            or dataclasses.is_dataclass(output):
        return None
    tensors = [v for v in vars(output).values() if isinstance(v, torch.Tensor) and v.requires_grad]
    if tensors and torch.is_grad_enabled() and hasattr(module, "_get_fsdp_state"):
        module._get_fsdp_state()._register_pre_backward_hook(tensors)
    return None


def _scalar_to_global(t: torch.Tensor, layout: BatchLayout) -> DTensor:
    """A scalar computed from this process's rows (a mean over them): the global value is
    the row-weighted mean over processes."""
    weight = layout.local_rows / layout.global_rows if layout.global_rows else 0.0
    placements = [Partial("sum") if p.is_shard() else Replicate() for p in layout.placements]
    return DTensor.from_local(t * weight, layout.device_mesh, placements, run_check=False)


def _default_shard_output(output: Any, layout: BatchLayout | None) -> Any:
    def convert(t: torch.Tensor):
        if isinstance(t, DTensor) or layout is None:
            return t
        if t.dim() == 0:
            return _scalar_to_global(t, layout)
        if t.shape[0] == layout.local_rows:
            return output_to_global(t, layout, "FSDPv2")
        return None

    if isinstance(output, torch.Tensor):
        out = convert(output)
        if out is None:
            raise RuntimeError(
                f"FSDPv2: the output of shape {tuple(output.shape)} does not have this process's "
                f"{layout.local_rows} batch rows on dim 0. Please provide your own shard_output callable."
            )
        return out
    if isinstance(output, (tuple, list, dict)):
        left: list[str] = []

        def each(t):
            out = convert(t)
            if out is None:
                left.append(str(tuple(t.shape)))
                return t
            return out

        result = map_tensors(output, each)
        if left:
            warnings.warn(
                f"FSDPv2: output tensors of shapes {', '.join(left)} have no batch dim 0 and are returned as "
                f"this process's local values; provide your own shard_output callable to mark them."
            )
        return result
    raise RuntimeError(f"The output type is not supported: {type(output)}. Please provide your own shard_output callable.")
