"""The training loop of ``torchspmd train``."""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from torchspmd import accelerators
from torchspmd import checkpoint as ckpt
from torchspmd import faults, runtime
from torchspmd.checkpoint_format.files import barrier
from torchspmd.data import MpDeviceLoader
from torchspmd.errors import SpmdError
from torchspmd.explain import explain
from torchspmd.hf.fsdp_v2 import shard_by_tp_plan, tp_plan
from torchspmd.mesh import Mesh, set_global_mesh
from torchspmd.parallel import (
    FSDPv2,
    checkpoint_module,
    clip_grad_norm_,
    pipeline,
    transformer_auto_wrap_policy,
)
from torchspmd.sharding import ShardingSpec, mark_sharding
from torchspmd.train import data as tdata
from torchspmd.train import plan
from torchspmd.train.config import TrainConfig, device_count, mesh_checks, pipeline_microbatches
from torchspmd.train.models import (
    build_model,
    import_model_code,
    init_weights,
    layer_classes,
    load_pretrained,
    logits_of,
    model_vocab,
)

# Dense bf16 peak FLOP/s per device, for model FLOPs utilisation; other devices report none.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}


def _peak_flops() -> float | None:
    name = accelerators.device_name(runtime.device())
    if name is None:
        return None
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def _memory_gb() -> float:
    """Peak memory of this device (CUDA allocations, a TPU's peak use), else the process's
    peak RSS."""
    measured = runtime.require_spmd("train").peak_memory_gb()
    if measured is not None:
        return measured
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _lr_lambda(cfg: TrainConfig):
    o = cfg.optim

    def f(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / max(1, o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / max(1, o.max_steps - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class _Metrics:
    """metrics.csv and TensorBoard (rank 0 only)."""

    FIELDS = ["step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_gb", "skipped"]

    def __init__(self, out: Path, tensorboard: bool, first_step: int, rank: int):
        self.on = rank == 0
        self.path = out / "metrics.csv"
        self.tb = None
        if not self.on:
            return
        rows = []
        if self.path.exists() and first_step > 0:  # resumed: keep the rows up to the checkpoint
            with self.path.open() as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= first_step]
        with self.path.open("w", newline="") as f:
            w = csv.DictWriter(f, self.FIELDS)
            w.writeheader()
            w.writerows(rows)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed: metrics go to metrics.csv only (pip install tensorboard)")

    def write(self, row: dict) -> None:
        if not self.on:
            return
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.FIELDS).writerow({k: row.get(k, "") for k in self.FIELDS})
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v == v:
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()

    def plot(self, out: Path) -> None:
        if not self.on:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with self.path.open() as f:
            rows = list(csv.DictReader(f))
        train = [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]]
        evals = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), label="train")
        if evals:
            ax.plot(*zip(*evals), "o-", label="held-out")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title("torchspmd train")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=100)
        plt.close(fig)


@torch.no_grad()
def _evaluate(model, batches, vocab: int) -> float:
    total, n = 0.0, 0
    for x, y in batches:
        logits = logits_of(model(x))
        total += F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)).item()
        n += 1
    return total / max(n, 1)


def _evaluate_stages(job, batches) -> float:
    loss_fn = functools.partial(_scaled_loss, vocab=job.vocab, accum=1)
    losses = [job.runner.evaluate(_whole(x), _whole(y), loss_fn).item() for x, y in batches]
    return sum(losses) / max(len(losses), 1)


@torch.no_grad()
def sample(model, tokenizer, prompt: str, tokens: int, seq_len: int, rows: int, seed: int = 0) -> str:
    """Sample text (top-k 10, temperature 0.8); every process draws the same tokens."""
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    g = torch.Generator().manual_seed(seed)
    fixed = runtime.capabilities().static_shapes  # one shape, one compiled graph: right-pad (the model is causal)
    for _ in range(tokens):
        window = ids[-seq_len:]
        ctx = torch.tensor([window + [tokenizer.eos_id] * (seq_len - len(window)) if fixed else window] * rows)
        logits = logits_of(model(ctx.to(runtime.device())))
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        last = logits[0, len(window) - 1].float().cpu()
        top = torch.topk(last / 0.8, 10)
        nxt = int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=g)])
        if nxt == tokenizer.eos_id:
            break
        ids.append(nxt)
    return tokenizer.decode(ids)


def shard_over_model(model, kind: str, mesh) -> None:
    """Annotate the weights that compute tensor-parallel over 'model': a transformers
    model's own plan; the seed decoder's attention (by heads), MLP pairs, embedding and LM
    head."""
    if kind == "seed":
        for layer in model.layers:
            mark_sharding(layer.attn.in_proj_weight, mesh, ("model", None))  # split by heads
            mark_sharding(layer.attn.out_proj.weight, mesh, (None, "model"))
            mark_sharding(layer.up.weight, mesh, ("model", None))
            mark_sharding(layer.down.weight, mesh, (None, "model"))
        mark_sharding(model.embed.weight, mesh, ("model", None))
        mark_sharding(model.lm_head.weight, mesh, ("model", None))
        return

    if not tp_plan(model):
        raise SpmdError(f"mesh.model = {mesh.shape()['model']}: {type(model).__name__} declares no tensor-parallel "
                        f"plan (config.base_model_tp_plan); use mesh.model = 1 for this model family")
    shard_by_tp_plan(model, mesh)


def _materialize(model, kind: str, seed: int, rank: int) -> None:
    """Give a model built on the meta device real (initialised) parameters on the device."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=runtime.device())
    for n, b in model.named_buffers():
        b.copy_(buffers[n])
    torch.manual_seed(seed + 1 + rank)
    init_weights(model, kind)
    torch.manual_seed(seed)


def _device_memory() -> tuple[float, str] | None:
    """Bytes of memory one device has, and what they are: an accelerator's total (where its
    device module reports it), a CPU process's share of the host's physical memory; None on
    XLA (unknown here)."""
    total = accelerators.total_memory(runtime.device())  # (None on the CPU, and for torch_xla's device)
    if total is not None:
        return float(total), f"this {runtime.device_type()} device's memory"
    if runtime.device_type() == accelerators.CPU:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total / local, f"this host's memory shared by {local} process{'es' if local > 1 else ''}"
    return None


def _announce_plan(cfg: TrainConfig, world: int) -> None:
    """Rank 0, before training: ``torchspmd plan``'s prediction of this run's peak memory per
    device, and a warning (with the planner's proposal) when it will not fit."""
    import sys

    try:
        facts = plan.config_facts(cfg)
    except Exception as e:  # the prediction is an aid: a model the planner cannot probe still trains
        print(f"plan: no memory prediction (the planner could not probe this model: {type(e).__name__}: {e})")
        return
    strategy = "FSDPv2 + checkpointing" if cfg.precision.checkpointing else "FSDPv2"
    o, m = cfg.optim, cfg.mesh
    axes = dict(model=m.model, pipeline=m.pipeline, schedule=cfg.pipeline.schedule, context=m.context,
                microbatches=pipeline_microbatches(cfg, world)[0] if m.pipeline > 1 else 0)
    total = plan.estimate(facts, world, o.batch_size, cfg.data.seq_len, cfg.precision.dtype, "adamw",
                          o.grad_accum, **axes)[strategy]["total"]
    rows = o.batch_size // o.grad_accum // (world // (m.model * m.pipeline * m.context))
    tokens = -(-cfg.data.seq_len // m.context)
    if m.model > 1 or m.pipeline > 1 or m.context > 1:
        strategy += "".join(f" x {k} {v}" for k, v in (("model", m.model), ("pipeline", m.pipeline),
                                                         ("context", m.context)) if v > 1)
    memory = _device_memory()
    of = f" of {memory[0] / 2**30:.1f} GB ({memory[1]})" if memory else ""
    print(f"plan: {total / 2**30:.2f} GB per device predicted{of}: {strategy}, {rows} x {tokens} tokens "
          f"per device per micro-batch, {cfg.precision.dtype}, AdamW (torchspmd plan shows the parts)")
    if memory and total > plan.HEADROOM * memory[0]:
        proposal = None
        if m.pipeline == 1:  # (train has no CPU offload, and no checkpointing with stages)
            proposal = plan.propose(facts, world, o.batch_size, cfg.data.seq_len, memory[0], cfg.precision.dtype,
                                    "adamw", strategy.split(" x ")[0], ladder=plan.LADDER[:2], model=m.model,
                                    schedule=cfg.pipeline.schedule, context=m.context)
        fix = (f"The planner proposes {plan.describe(proposal)}: set optim.grad_accum = {proposal.grad_accum}"
               f"{' and precision.checkpointing = true' if proposal.strategy != strategy.split(' x ')[0] else ''}"
               f"{f' and mesh.pipeline = {proposal.pipeline}' if proposal.pipeline > 1 else ''}"
               f"{f' and run on {proposal.devices} devices' if proposal.devices_changed else ''}." if proposal else
               "Nothing the planner knows fits: lower data.seq_len or use a larger 'model' or 'context' axis.")
        print(f"torchspmd: warning: this run is predicted to need {total / 2**30:.1f} GB per device, more than "
              f"{plan.HEADROOM:.0%} of the {memory[0] / 2**30:.1f} GB each device has; it will likely run out of "
              f"memory. {fix}", file=sys.stderr, flush=True)


def _resume_path(cfg: TrainConfig, out: Path) -> Path | None:
    r = cfg.checkpoint.resume
    if r == "none":
        return None
    if r == "auto":
        return ckpt.latest_checkpoint(out / "checkpoints")
    p = Path(r)
    if not p.is_dir():
        what = "a file, not a checkpoint directory" if p.exists() else "no such checkpoint directory"
        raise SpmdError(f"checkpoint.resume = {r!r}: {what}; give a step-NNNNNNNN directory "
                        f"under a job's out_dir/checkpoints, 'auto' (the newest in out_dir, if any) or 'none'")
    return p


def _bad_checkpoint(setting: str, path: Path, e: ckpt.BadCheckpoint) -> str:
    """The job's error for a checkpoint it cannot resume from, with the way out. Deleting
    the directory is offered only for a damaged checkpoint that ``auto`` chose: that is a
    ``step-N`` directory under this job's checkpoints, and the one before it (if any) is
    taken next. A path given by hand may be anything (the job's whole out_dir): it is never
    to be deleted; a checkpoint that is not damaged needs no deleting."""
    head = f"checkpoint.resume = {setting!r}: {e}"
    if not isinstance(e, ckpt.DamagedCheckpoint):
        return head  # a wrong path (the message names the checkpoints under it) or a state.pt it explains
    if setting == "auto":
        return (f"{head}; delete that directory to resume from the checkpoint before it, or set checkpoint.resume to "
                f"another checkpoint directory (or 'none' to start over)")
    others = [p for p in ckpt.list_checkpoints(path.parent) if p.resolve() != path.resolve()]
    if ckpt.NAME.match(path.name):
        others = [p for p in others if ckpt.step_of(p) < ckpt.step_of(path)]
    before = f" (the one before it is {others[-1]})" if others else ""
    return (f"{head}; point checkpoint.resume at another step-NNNNNNNN directory{before}, or set it to 'none' to "
            f"start over")


#: [model] settings that make another network with the same weight shapes (4 heads or 2 over
#: the same projections): a checkpoint loads, but it is not the model that was trained.
#: (dropout and how the weights were first made, meta_init and pretrained, may change.)
_ARCHITECTURE = ("name", "dim", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len",
                 "vocab_size")
#: Settings a resumed run may change, but then it does not continue the saved run exactly.
_CONTINUITY = (("data", "seq_len"), ("optim", "batch_size"), ("optim", "grad_accum"), (None, "seed"))


def _compare_config(cfg: TrainConfig, resume: Path, rank: int) -> None:
    """Refuse a checkpoint saved with other [model] architecture settings (its
    config.toml), and warn (rank 0) when the batches or the data order differ from the
    saved run's. Run after the load: a checkpoint of other weight shapes is refused there."""
    import sys

    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    try:
        saved = tomllib.loads((resume / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none (a checkpoint saved by another program): nothing to compare
        return
    now = tomllib.loads(cfg.to_toml())
    if not now["model"].get("pretrained"):  # (a pretrained model's architecture is its own)
        for key in _ARCHITECTURE:
            there, here = saved.get("model", {}).get(key), now["model"][key]
            if there is not None and there != here:
                raise SpmdError(f"checkpoint.resume = {cfg.checkpoint.resume!r}: checkpoint {resume} was saved with "
                                f"model.{key} = {there!r} (its config.toml) and this job has model.{key} = {here!r}: "
                                f"the weights load, but into another network; resume with model.{key} = {there!r}, "
                                f"or start this job in another out_dir")
    if rank == 0:
        for section, key in _CONTINUITY:
            there = (saved.get(section, {}) if section else saved).get(key)
            here = (now[section] if section else now)[key]
            name = f"{section}.{key}" if section else key
            if there is not None and there != here:
                print(f"torchspmd: warning: checkpoint {resume} was saved with {name} = {there!r} and this job has "
                      f"{name} = {here!r}: it resumes, but does not continue the saved run exactly (its batches or "
                      f"their order differ from here on)", file=sys.stderr, flush=True)


def _explain_one_step(model, opt, train_iter, vocab: int, cfg: TrainConfig) -> dict:
    """``torchspmd explain``: the job's parameter layouts and the collectives of one
    training step (its micro-batches, the gradient clipping, the optimizer step), printed
    by rank 0; nothing is saved."""

    def one_step():
        with runtime.step():
            for _ in range(cfg.optim.grad_accum):
                x, y = next(train_iter)
                loss = F.cross_entropy(logits_of(model(x)).reshape(-1, vocab), y.reshape(-1)) / cfg.optim.grad_accum
                loss.backward()
            clip_grad_norm_(model, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)

    result = explain(model, one_step)
    return {"explanation": result}


def _scaled_loss(logits, targets, vocab: int, accum: int):
    return F.cross_entropy(logits_of(logits).reshape(-1, vocab), targets.reshape(-1)) / accum


def _whole(t):
    """A batch the loader gave: with stages, every process takes the whole global batch."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _explain_stages(job, train_iter) -> dict:
    """``torchspmd explain`` of a job with pipeline stages: one training step, then the
    stages, the modules each holds, each process's schedule and the sends of a step, printed
    by rank 0; nothing is saved."""
    _stages_step(job, train_iter, set())
    text = job.runner.explain()
    if job.rank == 0:
        print(text, flush=True)
    return {"explanation": text}


@dataclasses.dataclass
class _Job:
    """What the steps of a run share."""

    cfg: TrainConfig
    rank: int
    world: int
    out: Path
    model: Any = None
    info: dict = dataclasses.field(default_factory=dict)
    vocab: int = 0
    opt: Any = None
    sched: Any = None
    mesh: Any = None
    step: int = 0
    resumed: dict | None = None  # the rest of the checkpoint's state, when resumed
    runner: Any = None  # with mesh.pipeline > 1: the stages' runner (job.model is it too)
    n_params: int = 0  # the model's parameters, whole

    def loss_fn(self):
        """A micro-step's loss of logits and targets: its mean / optim.grad_accum."""
        vocab, accum = self.vocab, self.cfg.optim.grad_accum
        return functools.partial(_scaled_loss, vocab=vocab, accum=accum)

    @property
    def micro(self) -> int:
        return self.cfg.optim.batch_size // self.cfg.optim.grad_accum


def run(cfg: TrainConfig, explain: bool = False) -> dict:
    """Train as ``cfg`` says (``torchspmd train``): start the engine, build the model and its
    data, shard it over the mesh, resume from a checkpoint, train, sample. With ``explain``,
    stop after one step's layouts and collectives (``torchspmd explain``)."""
    job = _start(cfg)
    tokenizer = tdata.make_tokenizer(cfg.data.tokenizer)
    train_ds, eval_ds = _build(job, tokenizer)
    job.mesh = _mesh(job)
    _parallelize(job)
    _optimizer(job)
    _resume(job)
    train_iter, eval_batches = _loaders(job, train_ds, eval_ds, explain)
    if job.resumed is not None:  # after the train iterator, which drew its seed from the generator, as when saved
        torch.set_rng_state(job.resumed["rng"])
        device_rng = device_rng_of(job.resumed)
        if device_rng is not None and device_rng[0] == runtime.device_type():
            accelerators.set_rng_state(device_rng[0], device_rng[1])
    if explain and job.runner is not None:
        return _explain_stages(job, train_iter)
    if explain:
        return _explain_one_step(job.model, job.opt, train_iter, job.vocab, cfg)
    result = _train(job, train_iter, eval_batches)
    result["sample"] = _finish(job, tokenizer)
    return result


def _start(cfg: TrainConfig) -> _Job:
    """SPMD mode on the job's devices, and the output directory."""
    import_model_code(cfg.model)  # before use_spmd() forks the workers: imported once, for all of them
    try:
        runtime.use_spmd(backend=cfg.mesh.backend or None, num_devices=device_count(cfg))
    except SpmdError as e:
        if cfg.mesh.devices and "num_devices" in str(e):
            raise SpmdError(f"mesh.devices = {cfg.mesh.devices}: {e}") from None
        raise
    job = _Job(cfg, runtime.process_index(), runtime.global_runtime_device_count(), Path(cfg.out_dir))
    if job.rank == 0:
        job.out.mkdir(parents=True, exist_ok=True)
        print(f"torchspmd train: {job.world} device(s), backend {runtime.backend()}, output {job.out}\n")
        print(cfg.to_toml())
        for line in getattr(cfg, "adapted", ()):
            print(f"# {line}")
    barrier()
    torch.manual_seed(cfg.seed)
    return job


def _build(job: _Job, tokenizer) -> tuple:
    """The model (on meta when ``model.meta_init`` asks) and the train and held-out sequences."""
    cfg = job.cfg
    # model.meta_init with model.pretrained (the llama-1b / llama2-7b presets set meta_init): the
    # architecture on meta, the pretrained weights loaded into the shards; with lazy tensors
    # (torch_xla), built whole
    model_cfg = cfg.model
    if cfg.model.meta_init and cfg.model.pretrained and runtime.capabilities().lazy_tensors:
        model_cfg = dataclasses.replace(cfg.model, meta_init=False)
        if job.rank == 0:
            print("model.meta_init: the pretrained model is loaded whole on XLA, then sharded")
    job.model, job.info = build_model(model_cfg, model_vocab(cfg.model, tokenizer))
    job.vocab = job.info["config"].vocab_size if job.info["config"] is not None else model_vocab(cfg.model, tokenizer)
    if tokenizer.vocab_size > job.vocab:
        raise SpmdError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {job.vocab}; "
                        f"use the model's own tokenizer (data.tokenizer = its directory)")
    if job.info["positions"] and cfg.data.seq_len > job.info["positions"]:
        raise SpmdError(f"data.seq_len = {cfg.data.seq_len} is beyond the model's {job.info['positions']} positions")
    tokens = tdata.load_tokens(cfg.data, tokenizer, job.out / "cache")
    return tdata.split(tokens, cfg.data.seq_len, cfg.data.eval_fraction)


def _mesh(job: _Job) -> Mesh:
    """('data', 'fsdp'), with 'model' when ``mesh.model`` > 1 or 'context' when ``mesh.context`` > 1;
    made the global mesh."""
    cfg, world = job.cfg, job.world
    mesh_checks(cfg, world)
    if job.rank == 0:
        _announce_plan(cfg, world)
    tp = cfg.mesh.model
    if cfg.mesh.pipeline > 1:
        p = cfg.mesh.pipeline
        mesh = Mesh(np.arange(world), (p, world // (p * tp), tp), ("pipeline", "fsdp", "model"))
    elif tp > 1:
        mesh = Mesh(np.arange(world), (cfg.mesh.data, world // (cfg.mesh.data * tp), tp), ("data", "fsdp", "model"))
    elif cfg.mesh.context > 1:
        c = cfg.mesh.context
        mesh = Mesh(np.arange(world), (cfg.mesh.data, world // (cfg.mesh.data * c), c), ("data", "fsdp", "context"))
    else:
        mesh = Mesh(np.arange(world), (cfg.mesh.data, world // cfg.mesh.data), ("data", "fsdp"))
    set_global_mesh(mesh)
    return mesh


def _parallelize(job: _Job) -> None:
    """Tensor parallelism over 'model' (annotations), then FSDPv2 over 'fsdp' with 'data' as the
    extra data axis, a unit per decoder layer (checkpointed when asked); a model built on meta
    is materialised (before wrapping with lazy tensors, else shard by shard after) or gets its
    pretrained weights."""
    cfg, model, info = job.cfg, job.model, job.info
    job.n_params = sum(p.numel() for p in model.parameters())
    if cfg.mesh.pipeline > 1:
        _split_into_stages(job)
        return
    lazy = runtime.capabilities().lazy_tensors
    tp = cfg.mesh.model
    if tp > 1:
        shard_over_model(model, info["kind"], job.mesh)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes(model))

    def checkpointed(m, *a, **k):
        return FSDPv2(checkpoint_module(m), *a, **k)

    meta_init = cfg.model.meta_init and not cfg.model.pretrained  # initialised here (else loaded)
    if meta_init and lazy:  # lazy tensors: nothing is allocated until marked sharded and run
        _materialize(model, info["kind"], cfg.seed, job.rank)
    job.model = model = FSDPv2(model, mesh=job.mesh, auto_wrap_policy=policy,
                               auto_wrapper_callable=checkpointed if cfg.precision.checkpointing else None,
                               extra_data_axis="data", mixed_precision="bf16" if cfg.precision.dtype == "bf16" else None,
                               compile=cfg.compile)
    if cfg.compile and job.rank == 0:
        compiled = sum(1 for m in model.modules() if getattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable",
                                                             None) is not None)
        print(f"torch.compile: {compiled} compiled blocks (compiled at their first use)")
    if meta_init and not lazy:
        # each shard draws its own values; the processes along 'model' hold the same FSDP
        # shards of what is not split over 'model', which must agree
        _materialize(model, info["kind"], cfg.seed, job.rank // tp)
    if cfg.model.meta_init and cfg.model.pretrained and not lazy:
        load_pretrained(model, cfg.model.pretrained, runtime.device())


def _split_into_stages(job: _Job) -> None:
    """``mesh.pipeline`` stages cut between the decoder layers, FSDP over 'fsdp' inside each
    and the annotated weights split over 'model' (torchspmd.pipeline), traced with a
    micro-step's batch shape; the model's parameters other stages hold are freed."""
    cfg = job.cfg
    layers = layer_classes(job.model)
    if len(layers) != 1:
        raise SpmdError(f"mesh.pipeline = {cfg.mesh.pipeline}: the model has {len(layers)} kinds of layers "
                        f"({', '.join(sorted(c.__name__ for c in layers))}); stages are cut between layers of one")
    micro, bubble = pipeline_microbatches(cfg, job.world)
    if cfg.mesh.model > 1:  # annotated first: each stage computes its share of them tensor-parallel
        shard_over_model(job.model, job.info["kind"], job.mesh)
    rows = cfg.optim.batch_size // cfg.optim.grad_accum
    example = torch.zeros((rows, cfg.data.seq_len), dtype=torch.long, device=runtime.device())
    job.runner = job.model = pipeline(job.model, job.mesh, split=next(iter(layers)), microbatches=micro,
                                      schedule=cfg.pipeline.schedule, example_inputs=example)
    if job.rank == 0:
        d = job.runner.describe()
        print(f"pipeline: {cfg.mesh.pipeline} processes, {d['stages']} stages cut before {', '.join(d['stage starts'])}"
              f" ({', '.join(f'{n / 1e6:.2f}M' for n in d['parameters per stage'])} parameters), "
              f"{cfg.pipeline.schedule}, {micro} micro-batches per micro-step: idle share (bubble) {bubble:.0%} by the "
              f"schedule's formula")


def _optimizer(job: _Job) -> None:
    """AdamW (no decay for biases and norms) and the warm-up + cosine schedule."""
    cfg = job.cfg
    decay = [p for p in job.model.parameters() if p.ndim >= 2]
    no_decay = [p for p in job.model.parameters() if p.ndim < 2]
    job.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                fused=cfg.optim.fused and runtime.capabilities().fused_optimizers)
    job.sched = torch.optim.lr_scheduler.LambdaLR(job.opt, _lr_lambda(cfg))


def _resume(job: _Job) -> None:
    """Continue from the checkpoint ``checkpoint.resume`` names (none by default in a new
    out_dir): weights, optimizer state, schedule, step and RNG state; this job's optimizer
    settings apply from here on."""
    cfg, rank = job.cfg, job.rank
    removed = ckpt.clean(job.out / "checkpoints")  # what a save interrupted last time left
    if removed and rank == 0:
        print(f"removed the unfinished checkpoint(s) {', '.join(removed)} of an interrupted save")
    resume = _resume_path(cfg, job.out)
    if resume is None:
        return
    try:
        state = ckpt.load(resume, job.model, job.opt)
    except ckpt.BadCheckpoint as e:
        raise SpmdError(_bad_checkpoint(cfg.checkpoint.resume, resume, e)) from None
    except ckpt.CheckpointMismatch as e:
        raise SpmdError(f"checkpoint.resume = {cfg.checkpoint.resume!r}: {e}; the job that saved it had other "
                        f"[model] settings (in its config.toml): resume with those, or start this job in another "
                        f"out_dir") from None
    _compare_config(cfg, resume, rank)
    job.sched.load_state_dict(state["scheduler"])
    job.step, job.resumed = state["step"], state
    _apply_optimizer_settings(job)
    if rank == 0:
        print(f"resumed from {resume} at step {job.step} (saved on {state.get('world_size', '?')} devices)")


def _apply_optimizer_settings(job: _Job) -> None:
    """The checkpoint's param groups and LambdaLR's base_lrs hold the saved run's lr, betas and
    weight decay; this job's settings (printed at its start, saved in its config.toml) are the
    ones used from here on: equal to the saved ones when the run continues unchanged."""
    cfg, opt, sched = job.cfg, job.opt, job.sched
    g0 = opt.param_groups[0]
    changed = [f"{name} = {now!r} (the checkpoint's: {then!r})" for name, then, now in (
        ("optim.lr", sched.base_lrs[0], cfg.optim.lr),
        ("optim.weight_decay", g0["weight_decay"], cfg.optim.weight_decay),
        ("optim.beta1", g0["betas"][0], cfg.optim.beta1), ("optim.beta2", g0["betas"][1], cfg.optim.beta2))
        if then != now]
    if changed and job.rank == 0:
        print(f"resuming with this job's {', '.join(changed)}")
    sched.base_lrs = [cfg.optim.lr] * len(opt.param_groups)
    factor = _lr_lambda(cfg)(sched.last_epoch)
    betas = (cfg.optim.beta1, cfg.optim.beta2)  # (one tuple for all groups, as the constructor gives)
    for g, wd in zip(opt.param_groups, (cfg.optim.weight_decay, 0.0)):
        # only what differs: an unchanged resume keeps the checkpoint's groups as they were
        # (the next checkpoint then pickles them byte for byte as an uninterrupted run)
        for key, value in (("initial_lr", cfg.optim.lr), ("lr", cfg.optim.lr * factor), ("weight_decay", wd),
                           ("betas", betas)):
            if g.get(key) != value:
                g[key] = value
    sched._last_lr = [g["lr"] for g in opt.param_groups]


def _loaders(job: _Job, train_ds, eval_ds, explain: bool) -> tuple:
    """The training batches (from the step the job starts at) and the held-out ones, split over
    ('data', 'fsdp')."""
    cfg, micro = job.cfg, job.micro
    # stages take the global batch on every process (the runner splits it); else split over ('data', 'fsdp')
    rows = ("data", "fsdp")
    spec = ShardingSpec(job.mesh, (None, None) if job.runner is not None else
                        (rows, "context") if "context" in job.mesh.axis_names else (rows, None))
    sampler = tdata.ResumableBatchSampler(len(train_ds), micro, cfg.seed, start=job.step * cfg.optim.grad_accum)
    train_iter = iter(MpDeviceLoader(torch.utils.data.DataLoader(train_ds, batch_sampler=sampler), runtime.device(),
                                     input_sharding=spec))
    eval_batches = []
    if len(eval_ds) >= micro:
        n_eval = min(cfg.logging.eval_batches, len(eval_ds) // micro)
        eval_loader = torch.utils.data.DataLoader(torch.utils.data.Subset(eval_ds, range(n_eval * micro)),
                                                  batch_size=micro)
        eval_batches = MpDeviceLoader(eval_loader, runtime.device(), input_sharding=spec)
    elif cfg.data.eval_fraction > 0 and job.rank == 0 and not explain:
        print(f"no evaluation: the {len(eval_ds)} held-out sequences (data.eval_fraction = {cfg.data.eval_fraction}) "
              f"are fewer than one micro-batch of {micro}; raise data.eval_fraction or give more text")
    return train_iter, eval_batches


def _train_step(job: _Job, train_iter, nan_steps: set[int]) -> tuple[float, float, bool]:
    """One optimizer step over ``optim.grad_accum`` micro-batches: (loss, gradient norm,
    whether the update was made). The global loss and norm are the same on every process, so
    all skip a non-finite step together; a skipped step leaves the weights, the optimizer state
    and the learning-rate schedule as they were."""
    cfg, vocab = job.cfg, job.vocab
    with runtime.step():
        # Each micro-batch's mean loss / grad_accum: the gradients sum to those of the global batch's mean.
        loss_sum = 0.0
        if job.runner is not None:
            return _stages_step(job, train_iter, nan_steps)
        for _ in range(cfg.optim.grad_accum):
            x, y = next(train_iter)
            logits = logits_of(job.model(x))
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)) / cfg.optim.grad_accum
            if job.step + 1 in nan_steps and job.rank == job.world - 1:  # tests: a bad batch on one process
                loss = loss * float("nan")
            loss.backward()
            loss_sum += loss.item()
        grad_norm = float(clip_grad_norm_(job.model, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")))
        finite = _update(job, loss_sum, grad_norm)
    return loss_sum, grad_norm, finite


def _update(job: _Job, loss_sum: float, grad_norm: float) -> bool:
    """The optimizer and schedule step of a step whose loss and gradient norm are finite (the
    same on every process, so all decide alike); a non-finite one is skipped and said."""
    finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
    if finite:
        job.opt.step()
        job.sched.step()
    elif job.rank == 0:
        print(f"step {job.step + 1}: non-finite loss or gradient ({loss_sum}, norm {grad_norm}): update skipped")
    job.opt.zero_grad(set_to_none=True)
    return finite


def _stages_step(job: _Job, train_iter, nan_steps: set[int]) -> tuple[float, float, bool]:
    """``_train_step`` through the pipeline stages: each micro-step's global batch through the
    runner (forward and backward), the gradients clipped over every stage."""
    cfg, runner = job.cfg, job.runner
    loss_fn = job.loss_fn()
    loss_sum = 0.0
    for _ in range(cfg.optim.grad_accum):
        x, y = next(train_iter)
        loss = runner.step(_whole(x), _whole(y), loss_fn)
        if job.step + 1 in nan_steps:  # tests: a bad batch (on every stage: the loss is the last's)
            loss = loss * float("nan")
        loss_sum += loss.item()
    grad_norm = float(runner.clip_grad_norm_(cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")))
    return loss_sum, grad_norm, _update(job, loss_sum, grad_norm)


def _device_rng() -> tuple[str, torch.Tensor] | None:
    state = accelerators.rng_state(runtime.device_type())  # (None on the CPU, and for torch_xla's device)
    return None if state is None else (runtime.device_type(), state)


def device_rng_of(resumed: dict) -> tuple[str, torch.Tensor] | None:
    """The accelerator's random state a checkpoint holds: ``device_rng`` (type, state), or the
    device-specific key of checkpoints written before it (``accelerators.legacy_rng``)."""
    if resumed.get("device_rng") is not None:
        return tuple(resumed["device_rng"])
    return accelerators.legacy_rng(resumed)


def _save(job: _Job) -> None:
    state = {"step": job.step, "scheduler": job.sched.state_dict(), "rng": torch.get_rng_state(),
             # the accelerator's generator, under its device type (None on the CPU and XLA)
             "device_rng": _device_rng(),
             "world_size": job.world, "sampler": {"consumed": job.step * job.cfg.optim.grad_accum}}
    ckpt.save(job.out / "checkpoints", job.step, job.model, job.opt, state, job.cfg.to_toml(),
              keep=job.cfg.checkpoint.keep)


def _train(job: _Job, train_iter, eval_batches) -> dict:
    """Steps until ``optim.max_steps``: metrics, evaluation, checkpoints; a run of non-finite
    steps stops the job, and Ctrl-C says where it stands."""
    cfg, rank = job.cfg, job.rank
    metrics = _Metrics(job.out, cfg.logging.tensorboard, job.step, rank)
    peak = _peak_flops()
    tokens_per_step = cfg.optim.batch_size * cfg.data.seq_len
    n_params = job.n_params
    progress = _Progress(cfg, job.step, n_params, job.world) if rank == 0 else None
    bad = 0
    nan_steps = faults.nan_steps()
    last_saved = job.step if job.resumed is not None else -1
    losses: list[float] = []
    eval_loss = float("nan")
    try:
        while job.step < cfg.optim.max_steps:
            t0 = time.perf_counter()
            loss_sum, grad_norm, finite = _train_step(job, train_iter, nan_steps)
            bad = 0 if finite else bad + 1
            job.step += 1
            faults.after_step(job.step)
            tps = tokens_per_step / (time.perf_counter() - t0)
            losses.append(loss_sum)
            row = {"step": job.step, "loss": loss_sum, "lr": job.sched.get_last_lr()[0], "grad_norm": grad_norm,
                   "tokens_per_s": tps, "mfu": (6 * n_params * tps / (peak * job.world)) if peak else "",
                   "memory_gb": _memory_gb(), "skipped": int(not finite)}
            last = job.step == cfg.optim.max_steps
            if eval_batches and (job.step % cfg.logging.eval_every == 0 or last):
                eval_loss = row["eval_loss"] = (_evaluate_stages(job, eval_batches) if job.runner is not None
                                                else _evaluate(job.model, eval_batches, job.vocab))
            if job.step % cfg.logging.every == 0 or "eval_loss" in row or last or not finite:
                metrics.write(row)  # a skipped step always gets its row
            if progress:
                progress.update(job.step, row)
            if not finite and bad >= cfg.optim.max_bad_steps:  # every process decides alike and stops here
                if progress:
                    progress.close()
                barrier()  # none exits (and gets its peers stopped) before all have their error
                raise SpmdError(f"stopping at step {job.step}: {bad} consecutive steps had a non-finite loss or "
                                f"gradient (optim.max_bad_steps = {cfg.optim.max_bad_steps}); lower optim.lr, check "
                                f"the data, or raise optim.max_bad_steps")
            if job.step % cfg.checkpoint.every == 0 or last:
                _save(job)
                last_saved = job.step
    except BaseException:
        if runtime.require_spmd("train").interrupted():  # Ctrl-C: where the job stands, once, not per process
            if progress:
                progress.close()
            if rank == 0:
                _say_interrupted(job.step, job.out)
        raise
    if progress:
        progress.close()
    metrics.plot(job.out)
    return {"losses": losses, "eval_loss": eval_loss, "last_saved": last_saved}


def _finish(job: _Job, tokenizer) -> str:
    """A sample of generated text (``logging.sample_tokens``) and where the results are."""
    cfg, text = job.cfg, ""
    if cfg.logging.sample_tokens > 0 and job.runner is not None:
        if job.rank == 0:
            print("no sample: generating through pipeline stages is not available yet (the checkpoints hold the "
                  "model: torchspmd generate samples from them)")
    elif cfg.logging.sample_tokens > 0:
        text = sample(job.model, tokenizer, cfg.logging.prompt, cfg.logging.sample_tokens, cfg.data.seq_len,
                      job.world)
        if job.rank == 0:
            print("\n--- sample ---\n" + text + "\n--------------")
    if job.rank == 0:
        print(f"done: {job.step} steps; metrics {job.out / 'metrics.csv'}, plot {job.out / 'loss.png'}, "
              f"checkpoints {job.out / 'checkpoints'}")
    return text


def _say_interrupted(step: int, out: Path) -> None:
    last = ckpt.latest_checkpoint(out / "checkpoints")
    where = (f"the newest checkpoint is {last}: run the job again with the same out_dir (checkpoint.resume = "
             f"'auto', the default) to continue from it" if last is not None else "no checkpoint was saved yet")
    print(f"torchspmd train: interrupted after step {step}; {where}", file=sys.stderr, flush=True)


class _Progress:
    """A live progress bar on rank 0 (rich), plus a log line every ``logging.every`` steps."""

    def __init__(self, cfg: TrainConfig, start: int, n_params: int, world: int):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.cfg = cfg
        self.console = Console()
        self.console.print(f"model: {n_params / 1e6:.2f}M parameters, sharded over {world} device(s)")
        self.progress = None
        if cfg.logging.progress and self.console.is_terminal:
            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), console=self.console)
            self.task = self.progress.add_task("train", total=cfg.optim.max_steps, completed=start, info="")
            self.progress.start()

    def update(self, step: int, row: dict) -> None:
        info = (f"loss {row['loss']:.3f}  {row['tokens_per_s']:.0f} tok/s  {row['memory_gb']:.2f} GB/device"
                + (f"  mfu {row['mfu']:.1%}" if row["mfu"] != "" else ""))
        if self.progress:
            self.progress.update(self.task, completed=step, info=info)
        if step % self.cfg.logging.every == 0 or "eval_loss" in row or step == self.cfg.optim.max_steps:
            extra = f"  eval {row['eval_loss']:.3f}" if "eval_loss" in row else ""
            self.console.print(f"step {step:>6}  {info}  lr {row['lr']:.2e}  grad {row['grad_norm']:.2f}{extra}")

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
