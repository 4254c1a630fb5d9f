"""Pipeline stages over a mesh axis, on ``torch.distributed.pipelining``: the runner (the plan is
``pipeline_plan``, the edits of the traced graph ``pipeline_graphs``).

The model is traced (``torch.distributed.pipelining.pipeline``, through ``torch.export``) with
one micro-batch of the step's inputs and cut before the modules that begin each stage; the
process at position ``k`` of the pipeline axis runs stage ``k`` (stages ``k``, ``k + S``, ...
with virtual stages), with PyTorch's schedules moving activations and their gradients between
neighbours. The stage modules compute with the model's own parameters (a parameter the trace
copied into a second stage, as an embedding tied to the LM head, is the model's one parameter
again), so an optimizer over ``parameters()`` updates the model itself. A parameter that
several processes' stages use has its gradient summed over them after the backward pass.

A trace is made per micro-batch shape and training mode, and kept.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
import weakref
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchspmd.engines.native.start import device_mesh as device_meshes
from torchspmd.engines.native.communication import replicas
from torchspmd.engines.native.global_view import row_locality
from torchspmd.engines.native.start import topology
from torchspmd.engines.native.wrappers import pipeline_graphs, pipeline_plan
from torchspmd.errors import SpmdError
from torchspmd.pipeline_schedules import SCHEDULES

__all__ = ["PipelineRunner", "is_split"]

def _pipelining():
    """``torch.distributed.pipelining``, imported when a model is first split (it takes
    seconds to import: torch.export comes with it)."""
    import torch.distributed.pipelining as pipelining

    return pipelining


# Live runners, for the optimizer check (an optimizer over another stage's parameters).
_RUNNERS: weakref.WeakSet = weakref.WeakSet()
_HOOK = None


def is_split(model: nn.Module) -> bool:
    """Whether ``model`` was split into pipeline stages (it then runs through its runner)."""
    return any(runner.model is model for runner in list(_RUNNERS))


def _check_optimizer(optimizer, args, kwargs) -> None:
    for runner in list(_RUNNERS):
        runner.check_optimizer(optimizer)


class PipelineRunner:
    """The training step of a model cut into pipeline stages. See ``torchspmd.pipeline``."""

    def __init__(self, model: nn.Module, mesh, axis: str, layers: list[str], microbatches: int, schedule: str,
                 example_inputs: torch.Tensor | None = None):
        global _HOOK
        dm = device_meshes.device_mesh(mesh)
        names = list(mesh.axis_names)
        others = [a for a in names if a not in (axis, "fsdp", "model") and mesh.mesh_shape[names.index(a)] > 1]
        if others:
            raise SpmdError(f"pipeline(mesh=...): the mesh's axes {others} have more than one device; inside a stage "
                            f"'fsdp' splits the parameters and the rows, 'model' the annotated weights: name the "
                            f"axes so, or make the others 1")
        self.model = model
        #: tensor parallelism inside each stage: the weights annotated over 'model'
        self.tp = dm["model"] if "model" in names and mesh.mesh_shape[names.index("model")] > 1 else None
        self.tp_rank = self.tp.get_local_rank() if self.tp is not None else 0
        _onto_stage_meshes(model, mesh, dm, self.tp)
        self.axis = axis
        #: FSDP inside each stage: the stage's processes along 'fsdp' split its parameters and the batch's rows
        self.fsdp = dm["fsdp"] if "fsdp" in names and mesh.mesh_shape[names.index("fsdp")] > 1 else None
        self.fsdp_size = self.fsdp.size() if self.fsdp is not None else 1
        self.fsdp_rank = self.fsdp.get_local_rank() if self.fsdp is not None else 0
        if self.fsdp is not None and example_inputs is None:
            raise SpmdError("pipeline(example_inputs=...): with 'fsdp' inside the stages, give one batch's inputs "
                            "(its shape is the steps' shape): the stages are traced and sharded before the optimizer "
                            "is built")
        self.layers = list(layers)
        self.group = dm.get_group(axis)
        self.ranks = dist.get_process_group_ranks(self.group)
        self.degree = len(self.ranks)
        self.position = self.ranks.index(dist.get_rank())
        self.schedule_name = schedule
        cls_name, per_process = SCHEDULES[schedule]
        pipelining = _pipelining()
        self.schedule_class = getattr(pipelining, cls_name, None)
        if self.schedule_class is None:
            have = [s for s, (c, _) in SCHEDULES.items() if hasattr(pipelining, c)]
            raise SpmdError(f"pipeline(schedule={schedule!r}): torch {torch.__version__} has no {cls_name}; choose "
                            f"one of {', '.join(have)}")
        self.num_stages = self.degree * per_process
        self.microbatches = microbatches
        if schedule == "1f1b" and microbatches < self.num_stages:
            raise SpmdError(f"pipeline(microbatches={microbatches}): the 1f1b schedule needs at least one micro-batch "
                            f"per stage ({self.num_stages}); give more, or schedule='gpipe'")
        if per_process > 1 and microbatches % self.degree:
            raise SpmdError(f"pipeline(microbatches={microbatches}): the {schedule} schedule needs a multiple of the "
                            f"'{axis}' axis's {self.degree} processes")
        self.plan = pipeline_plan.plan_stages(model, self.num_stages, layers)
        #: the stages this process runs (stage k on the process at position k % degree)
        self.stage_indices = [k for k in range(self.num_stages) if k % self.degree == self.position]
        mine = {n for k in self.stage_indices for n in self.plan.params[k]}
        #: each parameter's name in the model (its first, as model.named_parameters() gives it)
        self._canonical = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self._canonical.setdefault(id(p), n)
        self._mine = []
        seen = set()
        for n, p in model.named_parameters(remove_duplicate=False):
            if n in mine and id(p) not in seen:
                seen.add(id(p))
                self._mine.append((self._canonical[id(p)], p))
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        #: the model's persistent buffers: in every process's state_dict, as the model holds them
        self._buffers = [k for k in model.state_dict() if k not in params]
        held_by = {}
        for k in range(self.num_stages):
            for n in self.plan.params[k]:
                held_by.setdefault(id(model.get_parameter(n)), set()).add(k % self.degree)
        #: the parameters (one name each) that the stages of several processes use: summed gradients
        self._shared = [n for n, p in _unique(model) if len(held_by.get(id(p), ())) > 1]
        mine_ids = {id(p) for _, p in self._mine}
        # other stages' parameters, kept (while the runner lives their ids name them alone)
        self._others = {id(p): p for _, p in _unique(model) if id(p) not in mine_ids}
        self._traces: dict = {}
        self._stages: dict = {}
        self._tracing = False
        #: each parameter's shape on this process before 'fsdp' (its 'model' block where split)
        self._shapes = {n: _local(p).shape for n, p in model.named_parameters(remove_duplicate=False)}
        #: traced when made (example_inputs): every step has its shape, and what this process's
        #: stages do not use is freed
        self._sent: dict = {}  # stage -> (shape, bytes) of one micro-batch's output, as first computed
        self._seed, self._runs = torch.initial_seed(), 0  # the stages' random stream (_own_random_stream)
        self._mesh = mesh
        self.fixed = example_inputs is not None
        if self.fixed:
            rows = example_inputs.shape[0]
            if rows % (self.microbatches * self.fsdp_size):
                raise SpmdError(f"pipeline(example_inputs=...): its {rows} rows do not split into "
                                f"microbatches={self.microbatches}{self._over()}; give a batch of the steps' shape")
            micro = self._local_rows(example_inputs)[: rows // self.microbatches // self.fsdp_size]
            stages = self._stages[self._shape_key(micro)] = self._trace(micro, rows)
            if self.fsdp is not None:  # the stages' shards replace the model's own parameters
                self._others = {id(p): p for _, p in _unique(model)}
                self._mine, seen = [], set()
                for st in stages:
                    for n, p in st.submod.named_parameters(remove_duplicate=False):
                        if id(p) not in seen:
                            seen.add(id(p))
                            self._mine.append((self._canonical[id(model.get_parameter(n))], p))
            for p in self._others.values():  # other stages' parameters (all the model's with 'fsdp')
                _free(p)
        model.register_forward_pre_hook(self._direct_call)
        _RUNNERS.add(self)
        if _HOOK is None:
            _HOOK = register_optimizer_step_pre_hook(_check_optimizer)

    # -- what the program asks ------------------------------------------------------------------
    def parameters(self):
        """This process's stages' parameters (each once): what its optimizer steps (with 'fsdp'
        inside the stages, DTensors holding this process's shards)."""
        return iter([p for _, p in self._mine])

    @property
    def stages(self) -> list:
        """This process's ``torch.distributed.pipelining`` stage objects, of every trace made
        so far (one trace when made with ``example_inputs``): for instruments (benchmarks)."""
        return [st for traced in self._stages.values() for st in traced]

    @property
    def schedules(self) -> list:
        """The ``torch.distributed.pipelining`` schedules made so far (one per trace and loss
        function, made at its first step)."""
        return list(self._traces.values())

    def named_parameters(self):
        """``(name, parameter)`` of ``parameters()``, each by its name in the model (its first
        name: a tied embedding is the embedding's on every stage)."""
        return iter(list(self._mine))

    # -- checkpoints: this process's part of the model's state ----------------------------------
    def state_dict(self) -> dict:
        """This process's part of ``model.state_dict()``: its stages' parameters under every
        name the model gives them (with 'fsdp', DTensors of its shards), and the model's
        persistent buffers. The processes' parts together have the model's keys: a checkpoint
        saved from them loads into the model unsplit, or split another way."""
        out = {n: self._held(n) for k in self.stage_indices for n in self.plan.params[k]}
        whole = self.model.state_dict()
        out.update({k: whole[k] for k in self._buffers})
        return out

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for k, target in self.state_dict().items():
                if state[k] is not target:
                    target.copy_(state[k])

    def gather_keys(self, keys) -> set:
        """The union of ``keys`` over every process (a collective)."""
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(keys))
        return {k for part in everyone for k in part}

    def gather_group_names(self, groups: list[list[str]]) -> list[list[str]]:
        """An optimizer's parameter groups by name over every process (a collective): group
        ``i`` holds the parameters every process's group ``i`` holds, each once."""
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, groups)
        if len({len(g) for g in everyone}) != 1:
            raise SpmdError(f"the processes' optimizers have {sorted({len(g) for g in everyone})} parameter groups: "
                            f"build the same groups on every process")
        merged = []
        for i in range(len(groups)):
            names: dict = {}
            for part in everyone:
                names.update(dict.fromkeys(part[i]))
            merged.append(list(names))
        return merged

    def _shape_key(self, micro: torch.Tensor):
        return (tuple(micro.shape), micro.dtype, self.model.training)

    def _over(self) -> str:
        return f" x the 'fsdp' axis's {self.fsdp_size} processes" if self.fsdp is not None else ""

    def _local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This process's rows of a global batch: its share along 'fsdp' (all of it without)."""
        if self.fsdp is None:
            return batch
        share = batch.shape[0] // self.fsdp_size
        return batch[self.fsdp_rank * share:(self.fsdp_rank + 1) * share]

    def check_optimizer(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if self._others.get(id(p)) is p:
                    raise SpmdError("an optimizer over the whole model stepped after pipeline(model): it holds "
                                    "parameters of other processes' stages; build the optimizer after "
                                    "torchspmd.pipeline(...), from runner.parameters()")

    def _check_rows_apart(self, micro: torch.Tensor, rows: int) -> None:
        """The stages compute each micro-batch on its own: the model must compute each row
        from that row alone, and not use the batch size (proven: ``row_locality``), else
        one device's result is not what the stages would give."""
        proof = row_locality.batch_size_proof(self.model, (micro,), {}, micro.shape[0], one_row=True)
        why = proof.rows_apart([micro.shape[0], rows])
        if why is not None:
            raise SpmdError(
                f"pipeline: the stages compute each micro-batch of {micro.shape[0]} rows on its own, and "
                f"{type(self.model).__name__}'s forward is not proven to compute each row from that row alone: "
                f"{why}. On one device the batch's {rows} rows are computed together; compute what combines "
                f"rows outside the pipelined model (in the loss), or train this model with FSDPv2 or "
                f"Pattern 1 instead of pipeline stages")

    def _direct_call(self, module, args):
        if not self._tracing:
            raise SpmdError(f"{type(module).__name__} is split into pipeline stages over the '{self.axis}' axis; run "
                            f"it through its runner (runner.step(inputs, targets, loss_fn)), not model(...)")

    # -- the step -------------------------------------------------------------------------------
    def _trace(self, micro: torch.Tensor, rows: int):
        pipelining = _pipelining()
        self._tracing = True
        try:
            with _plain_stand_ins(self.model):
                self._check_rows_apart(micro, rows)
            with warnings.catch_warnings():
                # torch.export's own use of a deprecated pytree check on this torch: not the program's
                warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                        category=FutureWarning)
                with _plain_stand_ins(self.model):
                    pipe = pipelining.pipeline(self.model, mb_args=(micro,), split_spec={
                        name: pipelining.SplitPoint.BEGINNING for name in self.plan.starts})
        finally:
            self._tracing = False
        if pipe.num_stages != self.num_stages:
            raise SpmdError(f"pipeline(split=...): the traced model gave {pipe.num_stages} stages, not "
                            f"{self.num_stages}: a split point the forward pass does not reach")
        if SCHEDULES[self.schedule_name][1] > 1:
            # (the single-stage schedules send a value straight to any later stage)
            pipeline_graphs.relay_skip_connections(pipe.split_gm)
        # Every process traced every stage: each checks them all, so that a stage's parameter
        # registered with another stage's modules is the same error on every process (a check of
        # this process's stages alone left the others waiting for it in the schedule).
        for k in range(self.num_stages):
            planned = {id(self.model.get_parameter(n)) for n in self.plan.params[k]}
            for n, _ in pipe.get_stage_module(k).named_parameters(remove_duplicate=False):
                try:
                    original = self.model.get_parameter(n)
                except AttributeError:
                    raise SpmdError(f"pipeline: stage {k}'s parameter {n!r} is not one of the model's") from None
                if id(original) not in planned:
                    raise SpmdError(f"pipeline: the forward pass uses {n!r} in stage {k}, but it is registered with "
                                    f"the modules of another stage; register the model's modules in the order its "
                                    f"forward uses them, or give split= the module names so that the modules a "
                                    f"stage uses are registered with it")
        stages = []
        for k in self.stage_indices:
            sub = pipe.get_stage_module(k)
            for n, p in list(sub.named_parameters(remove_duplicate=False)):
                original = self.model.get_parameter(n)
                parent, leaf = pipeline_plan.parent_and_leaf(sub, n)
                if getattr(parent, leaf) is not original:
                    parent.register_parameter(leaf, original)  # the model's own parameter
            sub.train(self.model.training)
            if self.tp is not None:
                pipeline_graphs.drop_metadata_checks(sub)
                pipeline_graphs.reduce_lookups_at_once(sub)
                sub.register_forward_hook(_plain_outputs)
                # its whole parameters are replicas over 'model' (and over nothing else): checked there, so
                # that meeting the split weights does not check them over every process
                replicas.agree_once([p for p in sub.parameters() if not isinstance(p, DTensor)],
                                    group=self.tp.get_group())
            sub.register_forward_hook(functools.partial(self._record_output, k))
            if self.fsdp is not None:
                self._shard(sub)
            if self.tp is not None:
                # (after fully_shard: its hooks that put the gathered parameters in place run first)
                for unit in [sub, *(m for m in sub.modules() if m is not sub and _is_unit(m))]:
                    unit.register_forward_pre_hook(_gradients_laid_out_as_parameters)
            stages.append(pipelining.build_stage(sub, k, pipe.info(), topology.device(), self.group))
        # the trace's copies for other processes' stages (of a parameter two stages use): the
        # stages keep the traced graph, and with it those copies
        used = {id(p) for st in stages for p in st.submod.parameters()}
        originals = {id(p) for _, p in _unique(self.model)}
        for p in pipe.split_gm.parameters():
            if id(p) not in used and id(p) not in originals:
                _free(p)
        return stages

    def _shard(self, sub: nn.Module) -> None:
        """FSDP2 over 'fsdp' for a stage: each of its layers a unit, the rest the stage's. A
        unit stays gathered from its forward to its backward (``reshard_after_forward=False``,
        as torchtitan does with stages): the schedule runs every micro-batch through it, and
        regathering it for each would cost a gather per micro-batch."""
        from torch.distributed.fsdp import fully_shard

        for name in self.layers:
            try:
                layer = sub.get_submodule(name)
            except AttributeError:
                continue
            fully_shard(layer, mesh=self.fsdp, reshard_after_forward=False)
        fully_shard(sub, mesh=self.fsdp, reshard_after_forward=False)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of the global batch over the micro-batches; the global loss."""
        return self._run(inputs, targets, loss_fn, "step")

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """The global loss of a batch, forward only (no gradients), through the same stages
        (traced in the model's training mode of their trace)."""
        with torch.no_grad():
            return self._run(inputs, targets, loss_fn, "eval")

    def _run(self, inputs, targets, loss_fn, kind: str) -> torch.Tensor:
        call = "step" if kind == "step" else "evaluate"
        rows = inputs.shape[0]
        if rows % (self.microbatches * self.fsdp_size):
            raise SpmdError(f"pipeline.{call}(inputs=...): the batch's {rows} rows do not split into "
                            f"microbatches={self.microbatches}{self._over()}; give a batch whose rows are a multiple "
                            f"of {self.microbatches * self.fsdp_size}")
        if targets.shape[0] != rows:
            raise SpmdError(f"pipeline.{call}(targets=...): {targets.shape[0]} rows, the inputs have {rows}")
        inputs, targets = self._local_rows(inputs), self._local_rows(targets)
        micro = inputs[: inputs.shape[0] // self.microbatches]
        shape = self._shape_key(micro)
        if kind == "eval" and self.fixed:  # evaluated with the stages as traced, whatever the mode now
            shape = (shape[0], shape[1], next(iter(self._stages))[2])
        if shape not in self._stages:
            if self._stages:
                # (torch's pipeline tracer cannot trace the model again once it is split into stages:
                # one shape for the runner's life; every process sees the same global shape)
                traced = next(iter(self._stages))
                when = "example_inputs" if self.fixed else f"the first {call}"
                raise SpmdError(f"pipeline.{call}(inputs=...): micro-batches of shape {tuple(micro.shape)} "
                                f"(training {self.model.training}), but the stages were traced for {traced[0]} "
                                f"(training {traced[2]}, at {when}); the stages keep that shape and mode: pad every "
                                f"batch to it (a collator padding to a fixed length; drop_last=True for a short last "
                                f"batch) and switch train()/eval() before making the runner")
            self._stages[shape] = self._trace(micro, rows)
        key = (shape, loss_fn)
        if key not in self._traces:
            stages = self._stages[shape]
            one = stages if len(stages) > 1 else stages[0]
            self._traces[key] = self.schedule_class(one, self.microbatches, loss_fn=loss_fn, scale_grads=True)
        schedule = self._traces[key]
        losses: list = []
        kwargs = {}
        if 0 in self.stage_indices:
            args = (inputs,)
        else:
            args = ()
        if self.num_stages - 1 in self.stage_indices:
            kwargs = {"target": targets, "losses": losses}
        # (the stages' plain tensors are replicas over 'model' by construction: not checked while they run)
        with self._own_random_stream(), replicas.trusted():
            if kind == "step":
                # (the last stage's outputs are not returned: kept, torch would hold every micro-batch's
                # logits through the step and concatenate them at its end, memory the loss does not need)
                schedule.step(*args, **kwargs, **_no_outputs(schedule))
            else:
                schedule.eval(*args, **kwargs)
        if kind == "step":
            self._sum_shared_grads()
        loss = (torch.stack([l.detach().float() for l in losses]).mean() if losses
                else torch.zeros((), device=topology.device()))
        if self.fsdp is not None and losses:  # the last stage's processes: the mean of their rows' losses
            dist.all_reduce(loss, group=self.fsdp.get_group())
            loss /= self.fsdp_size
        last = self.ranks[(self.num_stages - 1) % self.degree]
        dist.broadcast(loss, src=last, group=self.group)
        return loss

    @contextlib.contextmanager
    def _own_random_stream(self):
        """The stages draw (dropout) from a stream of their own: seeded from the program's
        seed (``torch.initial_seed()``), the run's count and this process's place (stage
        position, 'fsdp' rank), so each stage and each share of rows get their own masks, a
        seeded program's alike run after run; the program's own random state is left as it
        was, the same on every process (one program)."""
        self._runs += 1
        device = topology.device()
        devices = [device] if device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(hash((self._seed, self._runs, self.position, self.fsdp_rank)) % 2**63)
            yield

    def _held(self, name: str):
        """This process's tensor of the model's parameter ``name`` (one of its stages' shards
        with 'fsdp' inside them), or None where its stages do not use it."""
        original = self.model.get_parameter(name)
        if self.fsdp is None:
            return original if any(p is original for _, p in self._mine) else None
        aliases = [n for n, p in self.model.named_parameters(remove_duplicate=False) if p is original]
        for stage in next(iter(self._stages.values())):
            for alias in aliases:
                try:
                    return stage.submod.get_parameter(alias)
                except AttributeError:
                    continue
        return None

    def _local_shape(self, name: str) -> torch.Size:
        """The shape of this process's part of the parameter ``name`` (FSDP2's dim-0 chunk)."""
        full = torch.empty(self._shapes[name], device="meta")
        if self.fsdp is None:
            return full.shape
        chunks = full.chunk(self.fsdp_size, dim=0)
        return chunks[self.fsdp_rank].shape if self.fsdp_rank < len(chunks) else torch.Size([0, *full.shape[1:]])

    def _sum_shared_grads(self) -> None:
        for n in self._shared:
            p = self._held(n)
            if p is None:  # another process's: this one adds nothing, and keeps no gradient
                dist.all_reduce(torch.zeros(self._local_shape(n), device=topology.device()), group=self.group)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=self.group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every stage by their global norm (each parameter counted once),
        as one device would; returns that norm on every process."""
        norm_type = float(norm_type)
        first_holder = {}
        for k in range(self.num_stages):
            for n in self.plan.params[k]:
                first_holder.setdefault(id(self.model.get_parameter(n)), k % self.degree)
        counted = set()
        for n in self._shared:  # counted by the processes of the lowest stage that uses it only
            if first_holder[id(self.model.get_parameter(n))] != self.position:
                p = self._held(n)
                if p is not None:
                    counted.add(id(p))
        if self.tp is not None and self.tp_rank != 0:  # a gradient whole on each 'model' process: counted once
            counted |= {id(p) for _, p in self._mine if not _split_over(p, "model")}
        grads = [_local(p.grad).detach() for _, p in self._mine if p.grad is not None and id(p) not in counted]
        device = topology.device()
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads if g.numel()] or [torch.zeros((), device=device)])
            local = local.max().float()
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            total = local
        else:
            local = torch.stack([g.float().norm(norm_type) ** norm_type for g in grads]
                                or [torch.zeros((), device=device)]).sum()
            dist.all_reduce(local)
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, p in self._mine:
            if p.grad is not None:
                _local(p.grad).detach().mul_(coef.to(p.grad.dtype))
        return total

    def _record_output(self, stage: int, module, args, output) -> None:
        if stage not in self._sent:
            tensors = [t for t in (output if isinstance(output, (tuple, list)) else [output])
                       if isinstance(t, torch.Tensor)]
            self._sent[stage] = ([tuple(t.shape) for t in tensors], sum(t.numel() * t.element_size() for t in tensors))

    def _order(self, position: int) -> list[str] | None:
        """The process's actions in one step: ``F<stage>.<micro-batch>`` forward, ``B...``
        backward (``W...``: the weights' part of a split backward), ``-`` idle; gpipe and 1f1b
        as those schedules run them, the others by torch's schedule's own order."""
        m, p = self.microbatches, self.degree
        if self.schedule_name == "gpipe":
            k = position
            return [f"F{k}.{i}" for i in range(m)] + [f"B{k}.{i}" for i in range(m)]
        if self.schedule_name == "1f1b":
            k, warm = position, min(m, p - 1 - position)
            out = [f"F{k}.{i}" for i in range(warm)]
            f = warm
            for b in range(m):
                if f < m:
                    out.append(f"F{k}.{f}")
                    f += 1
                out.append(f"B{k}.{b}")
            return out
        schedule = next(iter(self._traces.values()), None)
        order = getattr(schedule, "pipeline_order", None)
        if order is None:
            return None

        def text(a) -> str:
            if a is None:
                return "-"
            kind = {"F": "F", "B": "B", "I": "B", "W": "W", "FULL_BACKWARD": "B",
                    "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}.get(getattr(a.computation_type, "value", ""), "?")
            if kind == "?":
                kind = str(a.computation_type)
            return f"{kind}{a.stage_index}.{a.microbatch_index}"

        return [text(a) for a in order.get(position, [])]

    def explain(self) -> str:
        """The stages, which modules each holds, each process's schedule for one step and the
        point-to-point sends of a step (their sizes once a step has run). Every process calls
        it (it gathers what each process's stages sent)."""
        logical = self._mesh.get_logical_mesh()
        along = list(self._mesh.axis_names).index(self.axis)
        lines = [f"pipeline over '{self.axis}': {self.degree} process positions, {self.num_stages} stages, schedule "
                 f"{self.schedule_name}, {self.microbatches} micro-batches per step"
                 + (f", 'fsdp' x {self.fsdp_size} inside each stage" if self.fsdp is not None else "")]
        for k in range(self.num_stages):
            procs = sorted(int(d) for d in np.take(logical, k % self.degree, axis=along).reshape(-1))
            lines.append(f"  stage {k} on process(es) {procs}: {_modules_text(self.plan.params[k], self.layers)}; "
                         f"{self.plan.sizes[k]:,} parameters")
        lines.append("schedule per position (F/B/W<stage>.<micro-batch>: forward, backward, weight gradients; "
                     "-: waiting):")
        for pos in range(self.degree):
            order = self._order(pos)
            lines.append(f"  position {pos}: " + (" ".join(order) if order is not None
                                                  else "(this torch's schedule does not list its order)"))
        boundaries = self.num_stages - 1
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self._sent)  # (each process saw its own stages' outputs)
        seen = {k: v for part in everyone for k, v in part.items()}
        sent = [seen.get(k) for k in range(boundaries)]
        size = ("" if any(x is None for x in sent) else "; per micro-batch " + ", ".join(
            f"{k}->{k + 1}: {' + '.join('x'.join(map(str, sh)) for sh in x[0])} ({x[1]:,} bytes)"
            for k, x in enumerate(sent)))
        lines.append(f"point-to-point per step: {boundaries} stage boundar{'y' if boundaries == 1 else 'ies'} x "
                     f"{self.microbatches} micro-batches = "
                     f"{boundaries * self.microbatches} activation sends forward and as many gradient sends backward"
                     + (f", within each 'fsdp' column of {self.fsdp_size}" if self.fsdp is not None else "") + size)
        return "\n".join(lines)

    def describe(self) -> dict:
        return {"axis": self.axis, "processes": self.degree, "stages": self.num_stages, "schedule": self.schedule_name,
                "microbatches": self.microbatches, "stage starts": list(self.plan.starts),
                "parameters per stage": list(self.plan.sizes), "this process's stages": self.stage_indices}


def _modules_text(names: tuple[str, ...], layers: list[str]) -> str:
    """A stage's modules from its parameters' names: its layers as a range, the others by name."""
    held = [layer for layer in layers if any(n.startswith(layer + ".") for n in names)]
    others = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names if not any(n.startswith(x + ".") for x in held)))
    parts = ([held[0] if len(held) == 1 else f"{held[0]} .. {held[-1]} ({len(held)} layers)"] if held else [])
    return ", ".join(_ordered(names, held, others, parts))


def _ordered(names, held, others, parts) -> list[str]:
    """The stage's modules in the order its parameters come: the modules before its layers,
    the layers, the modules after."""
    if not held:
        return others
    first_layer = min(i for i, n in enumerate(names) if any(n.startswith(x + ".") for x in held))
    position = {o: min(i for i, n in enumerate(names) if n.rsplit(".", 1)[0] == o) for o in others}
    before = [o for o in others if position[o] < first_layer]
    after = [o for o in others if position[o] > first_layer]
    return before + parts + after


def _no_outputs(schedule) -> dict:
    """``return_outputs=False`` where the schedule's ``step`` takes it."""
    import inspect

    return {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t

def _split_over(p: torch.Tensor, axis: str) -> bool:
    """Whether ``p`` (a DTensor) is split over the mesh axis named ``axis``."""
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return axis in names and p.placements[names.index(axis)].is_shard()

def _free(p: torch.Tensor) -> None:
    """Release ``p``'s storage (a parameter this process's stages do not use)."""
    local = p._local_tensor if isinstance(p, DTensor) else p
    local.data = torch.empty(0, dtype=local.dtype, device=local.device)

def _slots(model: nn.Module):
    """(module, name, parameter) of every parameter slot of ``model``, tied ones included."""
    for module in model.modules():
        for leaf, p in list(module._parameters.items()):
            if p is not None:
                yield module, leaf, p

def _onto_stage_meshes(model: nn.Module, mesh, dm, tp) -> None:
    """The model's annotated parameters (DTensors over the whole mesh) made what the stages
    compute with: a weight split over 'model' becomes a DTensor over the 'model' axis alone,
    holding its block of that split (its split over 'fsdp', if annotated, is FSDP's part and
    over the pipeline axis it is whole); any other annotated parameter becomes whole."""
    from torchspmd.engines.native.global_view.replaced_parameters import mark_replaced

    made: dict = {}
    for module, leaf, p in _slots(model):
        if not isinstance(p, DTensor):
            continue
        if id(p) not in made:
            names = list(p.device_mesh.mesh_dim_names or ())
            if p.device_mesh != dm:
                raise SpmdError(f"pipeline: the parameter {leaf!r} of {type(module).__name__} is sharded over another "
                                f"mesh ({p.device_mesh}); annotate it over the mesh given to pipeline()")
            if any(not (pl.is_shard() or pl.is_replicate()) for pl in p.placements):
                raise SpmdError(f"pipeline: the parameter {leaf!r} of {type(module).__name__} has placements "
                                f"{p.placements}; annotate parameters with mark_sharding (splits only)")
            with torch.no_grad():
                if tp is not None and _split_over(p, "model"):
                    keep = [pl if n == "model" else Replicate() for n, pl in zip(names, p.placements)]
                    local = p.redistribute(dm, keep).to_local()
                    value = DTensor.from_local(local, tp, [p.placements[names.index("model")]], run_check=False,
                                               shape=p.shape, stride=p.stride())
                else:
                    value = p.full_tensor()
            new = nn.Parameter(value, requires_grad=p.requires_grad)
            mark_replaced(p, f"parameter {leaf!r} of {type(module).__name__}, which pipeline() replaced with the "
                             f"stages' own")
            made[id(p)] = new
        module._parameters[leaf] = made[id(p)]

@contextlib.contextmanager
def _plain_stand_ins(model: nn.Module):
    """While the model is traced: its DTensor parameters stood in for by plain tensors of
    their global shape (torch.export traces shapes; the values are never read)."""
    swapped, plain = [], {}
    for module, leaf, p in _slots(model):
        if isinstance(p, DTensor):
            if id(p) not in plain:
                plain[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device),
                                            requires_grad=p.requires_grad)
            swapped.append((module, leaf, p))
            module._parameters[leaf] = plain[id(p)]
    try:
        yield
    finally:
        for module, leaf, p in swapped:
            module._parameters[leaf] = p

def _is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` made its class a subclass of FSDPModule)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)

def _gradients_laid_out_as_parameters(module, args) -> None:
    """The traced graph computes with DTensors by DTensor's sharding rules, which may leave a
    weight's gradient partial or whole where the weight is split: each DTensor parameter the
    module computes with (with FSDP, the gathered one) gets its gradient laid out as itself
    before it accumulates (a reduce-scatter of a partial one), so that the optimizer, the
    global norm and FSDP's reduction see blocks of the weight's own split."""
    for p in module.parameters():
        if isinstance(p, DTensor) and p.requires_grad and not getattr(p, "_torchspmd_grad_layout", False):
            p.register_hook(functools.partial(_laid_out, p.device_mesh, tuple(p.placements)))
            p._torchspmd_grad_layout = True

def _laid_out(mesh, placements, grad):
    if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
        return grad.redistribute(mesh, placements)
    return grad

def _plain_outputs(module, args, output):
    """A stage's outputs as plain tensors (whole: gathered over 'model' where split), what
    the schedule sends to the next stage."""
    def plain(t):
        if isinstance(t, DTensor):
            return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()
        return t
    if isinstance(output, (tuple, list)):
        return type(output)(plain(t) for t in output)
    return plain(output)

def _unique(model: nn.Module):
    seen = set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            yield n, p
