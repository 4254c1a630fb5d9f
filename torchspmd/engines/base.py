"""The engine interface: what the public API needs from a runtime that realises the SPMD model.

An engine starts the process (or joins its launcher's job), reports the topology, realises
meshes and partition specs, places batches, and builds the wrappers (FSDPv2, replicate,
activation checkpointing). The public functions check their arguments once, so that every
engine gives the same errors, and then call the selected engine (``torchspmd.engines.current``).

Arguments reach an engine already checked: a ``mesh`` has the public ``Mesh``'s accessors
(``device_ids``, ``mesh_shape``, ``axis_names``, ``get_axis_name_idx``), a partition spec is
given with its resolution (per tensor dim, the tuple of mesh axis indices that split it).

Integrations (the train job, the Hugging Face trainer, checkpoints, the CLI) ask an engine's
``capabilities``; they never compare with an engine's name.

A third engine (a PrivateUse1 device speaking torch.distributed and DTensor, such as the
TorchTPU stack) is best the native engine on another device type; an engine that delegates to
another runtime subclasses ``Engine``, fills in its abstract methods (19, in four roles: start
and topology, sharding and data, wrappers, checkpoints; the rest have defaults or are
optional) and registers itself with ``torchspmd.engines.register`` (docs/design.md).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an engine can do, for the integrations to ask instead of comparing names."""

    #: one process per device (native); False: one process drives every local device (torch_xla)
    process_per_device: bool
    #: every step has the same shapes (a compiled graph per shape): pad batches to one length
    static_shapes: bool
    #: tensors are lazy (torch_xla): a model materialised whole before sharding allocates
    #: nothing until it runs, so it is materialised before FSDPv2 rather than shard by shard
    lazy_tensors: bool
    #: fused optimizer kernels (``torch.optim.AdamW(fused=True)``) run on its devices
    fused_optimizers: bool
    #: transformers' hub kernels (the ``kernels`` library) support its device type
    hub_kernels: bool
    #: transformers' Trainer shards the model itself on this engine (its torch_xla FSDPv2 path)
    transformers_shards: bool
    #: the axes of a tuple entry of a partition spec must follow the mesh's order
    tuple_axes_in_mesh_order: bool
    #: a checkpoint is read into the device tensors in place: the optimizer's state is made
    #: first, and the model is not reloaded from the state dict after reading
    checkpoint_in_place: bool = False
    #: pipeline stages over a mesh axis (``torchspmd.pipeline``)
    pipeline_stages: bool = False


def _absent(engine, what: str):
    raise NotImplementedError(f"{what}: the {engine.name} engine does not provide it")  # by design: an optional role


class Start(abc.ABC):
    """Role: choosing and starting the runtime, and the job's topology. An engine gives five
    counts (``world_size``, ``process_count``, ``process_index``, ``local_device_count``,
    ``local_ordinal``); torch_xla's other five are derived from them (an engine whose runtime
    reports them itself may override them)."""

    #: short name: ``"native"``, ``"xla"``
    name: str
    #: the backend names ``use_spmd(backend=...)`` accepts for it (named in messages; ``serves``
    #: may accept more)
    backends: tuple[str, ...]
    capabilities: Capabilities

    def serves(self, backend: str) -> bool:
        """Whether ``use_spmd(backend=backend)`` is this engine's (a name no engine lists
        exactly)."""
        return backend in self.backends

    @abc.abstractmethod
    def default_backend(self) -> str | None:
        """The backend to use when none is named, where this engine's environment asks for
        it (torch_xla's: ``PJRT_DEVICE`` set); None: leave the choice to the next engine."""

    @abc.abstractmethod
    def usable(self, backend: str, where: str, explicit: bool) -> str | None:
        """None when ``backend`` can run here; else why not, with the fix (``where`` names the
        setting that asked for it; ``explicit``: an argument, not the environment)."""

    @abc.abstractmethod
    def start(self, backend: str, *, auto: bool, num_devices: int | None) -> torch.device:
        """Enter SPMD mode on ``backend``; returns this process's device. Applies the
        engine's patches (``torchspmd.patches``)."""

    # -- topology (also asked before start: what the job will have) ---------------------------
    @abc.abstractmethod
    def world_size(self) -> int:
        """The devices of the job."""

    @abc.abstractmethod
    def process_count(self) -> int: ...

    @abc.abstractmethod
    def process_index(self) -> int: ...

    @abc.abstractmethod
    def local_device_count(self) -> int:
        """The devices of this host."""

    @abc.abstractmethod
    def local_ordinal(self) -> int:
        """This process's place among its host's processes."""

    def global_runtime_device_count(self) -> int:
        return self.world_size()

    def global_device_count(self) -> int:
        return self.world_size()

    def addressable_runtime_device_count(self) -> int:
        """The devices this process drives."""
        return self.world_size() // self.process_count()

    def addressable_device_count(self) -> int:
        return self.addressable_runtime_device_count()

    def global_ordinal(self) -> int:
        """The job-wide index of this process's first device."""
        return self.process_index() * self.addressable_runtime_device_count()

    def planned_processes(self, backend: str, num_devices: int | None) -> int | None:
        """Processes a job started as ``python script.py`` runs on this host, before it
        starts (None: the engine counts its devices when it starts)."""
        return None

    def describe(self, backend: str) -> list[str]:
        """Lines for ``torchspmd info``."""
        return []

    def interrupted(self) -> bool:
        """This process was interrupted (SIGINT) and its job is being stopped."""
        return False

    def peak_memory_gb(self) -> float | None:
        """This device's peak memory use, where the engine can measure it."""
        return None

    # -- steps --------------------------------------------------------------------------------
    def step(self, index: int) -> contextlib.AbstractContextManager:
        """Around one training step (``index``: steps completed before it); nothing by default."""
        return contextlib.nullcontext()

    def sync(self) -> None:
        """Run what the program queued (a lazy runtime's step); nothing by default."""

class Sharding(abc.ABC):
    """Role: meshes, partition specs and data placement."""

    # -- meshes -------------------------------------------------------------------------------
    def own_class(self, kind: str) -> type | None:
        """The engine's own class for the public ``kind`` ('Mesh', 'HybridMesh',
        'ShardingSpec', 'MpDeviceLoader', 'FSDPv2'), registered as a virtual subclass of
        the public one; None where the public class is the engine's."""
        return None

    def own_mesh(self, mesh) -> Any:
        """The engine's mesh for a checked public ``Mesh`` (the mesh itself by default)."""
        return mesh

    def own_hybrid_mesh(self, ici_mesh_shape, dcn_mesh_shape, axis_names, view: Callable) -> Any:
        """A hybrid mesh, where the engine lays it out itself; None: the public layout.
        ``view(device_ids, shape, names)`` builds a checked public Mesh."""
        return None

    def device_mesh(self, mesh):
        """The ``torch.distributed.DeviceMesh`` of ``mesh``, on engines built on DTensor."""
        raise NotImplementedError(f"the {self.name} engine has no DeviceMesh")  # by design: engines without DTensor

    def set_global_mesh(self, mesh) -> None:
        """Engines with meshes of their own keep the global mesh (the public layer keeps it
        for the others)."""

    def get_global_mesh(self):
        return None

    def get_1d_mesh(self, axis_name: str | None):
        """The engine's own 1-D mesh; None: the public one."""
        return None

    # -- sharding -----------------------------------------------------------------------------
    @abc.abstractmethod
    def mark_sharding(self, t: torch.Tensor, mesh, spec: tuple, resolved: tuple) -> torch.Tensor: ...

    def in_local_compute(self) -> bool:
        """Whether the caller runs inside a wrapped module's local compute (its tensors are this
        process's shares, not global values)."""
        return False

    def result_taken(self, marked: torch.Tensor) -> bool:
        """Whether ``mark_sharding``'s result ``marked`` is used by the engine itself though the
        program drops it (a wrapper's ``shard_output`` marking the module's output: the
        wrapper returns the marked value)."""
        return False

    def mark_sharding_with_gradients(self, t: torch.Tensor, mesh, spec: tuple, resolved: tuple) -> torch.Tensor:
        return _absent(self, "mark_sharding_with_gradients")

    def enable_manual_sharding(self, t: torch.Tensor, mesh, spec: tuple, resolved: tuple) -> torch.Tensor:
        return _absent(self, "enable_manual_sharding")

    def disable_manual_sharding(self, t: torch.Tensor, mesh, spec: tuple, resolved: tuple,
                                full_shape: tuple[int, ...]) -> torch.Tensor:
        return _absent(self, "disable_manual_sharding")

    @abc.abstractmethod
    def clear_sharding(self, t: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def get_sharding(self, t: torch.Tensor) -> tuple | None: ...

    def visualize_sharding(self, t: torch.Tensor | str, use_color: bool):
        """Print which device holds which block of ``t`` (or of an HLO sharding text); return
        the table."""
        return _absent(self, "visualize_sharding")

    def sharding_spec(self, mesh, spec: tuple, minibatch: bool):
        """The engine's own ``ShardingSpec``; None: the public one."""
        return None

    # -- data ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def loader(self, loader, device, input_sharding, **options): ...

    @abc.abstractmethod
    def shard_batch(self, batch: Any, input_sharding, device) -> Any: ...


class Wrappers(abc.ABC):
    """Role: the wrappers that place a module's parameters (FSDPv2 at least)."""

    # -- wrappers -----------------------------------------------------------------------------
    def replicate(self, module: nn.Module, mesh, data_dims: list[int], shard_output: Callable | None,
                  ddp_kwargs: dict) -> nn.Module:
        return _absent(self, "replicate")

    def pipeline(self, model: nn.Module, mesh, axis: str, layers: list[str], microbatches: int, schedule: str,
                 example_inputs):
        """The runner of ``model`` cut into stages over ``axis`` (engines with ``pipeline_stages``)."""
        raise NotImplementedError(f"the {self.name} engine has no pipeline stages")  # by design: optional

    @abc.abstractmethod
    def fully_shard(self, module: nn.Module, mesh, shard_output: Callable | None, auto_wrap_policy: Callable | None,
                    auto_wrapper_callable: Callable | None, extra_data_axis: str | None, options: dict) -> nn.Module: ...

    def shard_in_place(self, module: nn.Module, mesh, shard_output: Callable | None, extra_data_axis: str | None,
                       options: dict) -> nn.Module:
        """``module`` made an FSDPv2 unit without a wrapper module (inside an FSDPv2 root)."""
        return _absent(self, "shard_in_place")

    @abc.abstractmethod
    def is_fully_sharded(self, module: nn.Module) -> bool:
        """``module`` is one of this engine's FSDPv2 wrappers."""

    def checkpoint_module(self, module: nn.Module) -> nn.Module:
        return _absent(self, "checkpoint_module")


class Checkpoints(abc.ABC):
    """Role: gradients, whole and sharded state."""

    # -- gradients and state ------------------------------------------------------------------
    def clip_grad_norm_(self, params: Sequence[torch.Tensor], max_norm: float, norm_type: float,
                        error_if_nonfinite: bool) -> torch.Tensor:
        return _absent(self, "clip_grad_norm_")

    @abc.abstractmethod
    def full_state_dict(self, model: nn.Module, rank0_only: bool, cpu: bool) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def load_full_state_dict(self, model: nn.Module, state_dict: dict, strict: bool) -> list[str]: ...

    # -- sharded checkpoints ------------------------------------------------------------------
    @abc.abstractmethod
    def save_state(self, state_dict: dict, storage_writer) -> None:
        """Write ``state_dict`` (sharded tensors) with ``torch.distributed.checkpoint``."""

    @abc.abstractmethod
    def load_state(self, state_dict: dict, storage_reader) -> None:
        """Read a checkpoint into ``state_dict``'s tensors."""

    def prime_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Create an optimizer's state (one step that changes no parameter) before a
        checkpoint is loaded into it."""
        return _absent(self, "prime_optimizer")


class Engine(Start, Sharding, Wrappers, Checkpoints):
    """One runtime for the SPMD programming model, in four roles (see the module's docstring):
    :class:`Start`, :class:`Sharding`, :class:`Wrappers`, :class:`Checkpoints`. The abstract
    methods are what every engine gives; the others have a default or raise
    ``NotImplementedError`` naming the engine (optional: the public API checks the
    engine's ``capabilities`` first where one is optional)."""

    # -- what the integrations read from an engine (defaults: an engine without these paths) -----
    def set_auto_replicate(self, enabled: bool | None) -> bool | None:
        """Turn the automatic data-parallel path on (True), off (False) or back to the
        environment's setting (None); return the previous setting (``torchspmd.set_auto_replicate``).
        An engine without such a path keeps nothing and returns None."""
        return None

    def auto_path(self, module: nn.Module) -> dict:
        """What the automatic data-parallel path decided for ``module`` (``torchspmd.auto_path``)."""
        return {}

    def is_pipelined(self, model: nn.Module) -> bool:
        """``model`` was split into pipeline stages by this engine."""
        return False

    def tensor_parallel_layout(self, module: nn.Module) -> str | None:
        """The tensor-parallel style (``'colwise'``, ``'rowwise'``, ...) ``module`` computes in
        with no wrapper (its weight annotated over ``'model'``), or None (``explain``)."""
        return None

    def watching_fallbacks(self, where: Callable[[], tuple[str, str]]) -> contextlib.AbstractContextManager:
        """A context that records, as a list it yields, every time a value is gathered whole and
        split again because the runtime had no direct way (``explain``); ``where()`` names the
        phase and module. Its collectives go through the process group's backend, so that a
        communication counter sees them."""
        return contextlib.nullcontext([])

    def fallbacks_seen(self) -> dict:
        """The gather-and-split fallbacks this process made so far, each with its count."""
        return {}

    def sharding_string(self, t: torch.Tensor) -> str:
        """``t``'s layout in XLA's HLO sharding text (``--xla-compat``'s ``_XLAC``)."""
        return _absent(self, "sharding_string")

    def sharding_type(self, t: torch.Tensor):
        """``t``'s layout as torch_xla's ``ShardingType`` (None: not a sharded value)."""
        return _absent(self, "sharding_type")

    def quiet_gathers(self) -> contextlib.AbstractContextManager:
        """A context in which gathering a sharded value whole warns nothing (a program's own
        save of whole values)."""
        return contextlib.nullcontext()
