"""``torchspmd plan``: the peak memory of one device for a training step, before running it.

    torchspmd plan --model llama-1b --devices 8 --batch 256 --seq 2048 --dtype bf16
    torchspmd plan --model path/to/config.json --devices 4 --batch 32 --seq 1024

For DDP, FSDPv2, FSDPv2 with activation checkpointing and FSDPv2 with CPU offload it
prints the predicted peak bytes per device and which device sizes hold it; then, for each
device size, what fits with the global batch kept (:func:`propose`): the largest
micro-batch per device (and the ``grad_accum`` that keeps the batch), else checkpointing,
CPU offload, more devices. ``torchspmd train`` prints the prediction for its own run.

What the prediction is made of (bytes on one of ``n`` devices, one micro-batch of
``b = ceil(batch / grad_accum / n)`` rows of ``seq`` tokens each, ``c`` bytes per compute
element, optimizer with ``k`` fp32 states per parameter):

- model state: fp32 parameters and ``k`` optimizer states of all ``P`` parameters under
  DDP (plus DDP's gradient buckets, a copy of the gradients), of ``P / n`` under FSDPv2
  (nothing on the device with CPU offload); the fp32 gradients are counted at the end of
  backward, when the activations are gone (the peak is the larger of the start of
  backward and its end);
- FSDPv2's gathered parameters (compute dtype): the root unit (embeddings, head) and two
  decoder layers (the one computing and the one being gathered), plus the all-gather
  output and the reduce-scatter input of the largest unit;
- activations: what autograd keeps for backward, measured, not guessed: a one-layer
  copy of the model runs a forward on 16 tokens with ``torch.autograd.graph``'s
  saved-tensor hooks counting the bytes kept inside the decoder layer and outside it
  (the head's log-softmax included); per token, times ``b * seq`` tokens (and the
  layers). With checkpointing, each layer keeps only its input, and one layer is
  recomputed at a time;
- the loss: the fp32 logits the caller holds through backward, their gradient, and the
  cross-entropy's backward buffers of the same size (the gradient of its log-softmax, the
  one being computed), which meet the root unit's gathered parameters (kept from forward
  to backward): ``4 * b * seq * vocab * 4``.

The test suite checks the FSDPv2 prediction, and that of pipeline stages
(:func:`stages_estimate`), against the measured peak of real training runs on CPU
processes (within 15%).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from torchspmd.errors import SpmdError
from torchspmd.train.config import (PIPELINE_SCHEDULES, PRESETS, allowed_microbatches, bubble, did_you_mean,
                                    fewest_microbatches, preset, stages_per_process)
from torchspmd.train.data import make_tokenizer
from torchspmd.train.models import build_model, layer_classes, model_vocab

__all__ = ["ModelFacts", "Proposal", "model_facts", "config_facts", "estimate", "propose", "DEVICE_SIZES_GB", "OPTIMIZER_STATES", "main"]

#: Common accelerator memory sizes (GB) the report checks the prediction against.
DEVICE_SIZES_GB = {"16 GB (T4, V100)": 16, "24 GB (L4, A10, RTX 4090)": 24, "40 GB (A100)": 40,
                   "80 GB (A100, H100)": 80, "141 GB (H200)": 141}
#: fp32 states per parameter kept by each optimizer.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
PROBE_TOKENS = 16


@dataclass
class ModelFacts:
    name: str
    params: int            # all parameters
    layer_params: int      # the largest decoder layer (one FSDPv2 unit)
    root_params: int       # parameters outside the decoder layers (the root unit)
    layers: int
    hidden: int
    vocab: int
    act_layer: float       # bytes autograd keeps per token inside one decoder layer
    act_root: float        # ... outside the layers (embedding, final norm, head, log-softmax)
    layer_input: float     # bytes of one layer's input per token (kept under checkpointing)
    first_params: int = 0  # parameters registered before the first layer (the first stage's: embeddings)
    last_params: int = 0   # ... after the last layer (the last stage's: final norm, LM head, a tied table again)


def _spec(model: str) -> tuple[str, Callable[[int], nn.Module], Callable[[nn.Module], set], int, int, int]:
    """(name, build(num_layers), layer classes, layers, hidden, vocab) for a preset or an
    HF config file / directory."""

    path = Path(model)
    if path.exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg_path = path if path.is_file() else path / "config.json"
        if not cfg_path.is_file():
            raise SpmdError(f"plan --model {model}: no config.json there")
        config = AutoConfig.from_pretrained(str(cfg_path))
        layers = getattr(config, "num_hidden_layers", None)
        if layers is None:
            raise SpmdError(f"plan --model {model}: its config has no num_hidden_layers")

        def build(n: int) -> nn.Module:
            import copy

            c = copy.deepcopy(config)
            c.num_hidden_layers = n
            c.use_cache = False
            return AutoModelForCausalLM.from_config(c, dtype=torch.float32)

        return (path.name if path.is_dir() else path.parent.name or str(path), build, layer_classes, layers,
                config.hidden_size, config.vocab_size)

    if model not in PRESETS:
        raise SpmdError(f"plan --model {model!r}: not a preset{did_you_mean(model, PRESETS)} ({', '.join(PRESETS)}) "
                        f"nor a config file or directory")
    return _spec_of_config(preset(model), model)


def _spec_of_config(cfg, name: str):
    """The spec of the model a train configuration builds (``model.*``, its tokenizer's
    vocabulary or ``model.vocab_size``; a pretrained directory's config)."""

    if cfg.model.pretrained:
        return _spec(cfg.model.pretrained)
    vocab = model_vocab(cfg.model, make_tokenizer(cfg.data.tokenizer))

    def build(n: int) -> nn.Module:
        import copy

        m = copy.deepcopy(cfg.model)
        m.num_layers, m.meta_init, m.pretrained = n, False, ""
        return build_model(m, vocab)[0]

    return name, build, layer_classes, cfg.model.num_layers, cfg.model.dim, vocab


@contextlib.contextmanager
def _no_init():
    """Build modules without initialising (or touching) their parameters."""
    with torch.device("meta"):
        yield


def _activations(model: nn.Module, classes: set, dtype: torch.dtype, vocab: int) -> tuple[float, float, float]:
    """Per token: bytes saved for backward inside one layer, outside the layers, and one
    layer's input; measured on a forward of ``PROBE_TOKENS`` tokens."""
    inside = [0]
    layer_inputs: list[int] = []

    def enter(mod, args):
        inside[0] += 1
        x = args[0] if args else None
        if isinstance(x, torch.Tensor):
            layer_inputs.append(x.numel() * x.element_size())

    def leave(mod, args, out):
        inside[0] -= 1

    for m in model.modules():
        if isinstance(m, tuple(classes)):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    saved = {"in": 0, "out": 0}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            saved["in" if inside[0] else "out"] += storage.nbytes()
        return t

    tokens = torch.randint(0, vocab, (1, PROBE_TOKENS))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward(kernels) -> None:
        import warnings

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sdpa_kernel(kernels), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on the kernels it skipped: not the user's concern
            out = model(tokens)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))

    try:
        # Flash attention keeps no (seq x seq) matrix, as on GPUs: the bytes grow with the tokens.
        forward([SDPBackend.FLASH_ATTENTION])
    except RuntimeError:  # no flash kernel for this call on a CPU (attention dropout): torch's choice
        seen.clear()
        layer_inputs.clear()
        saved.update({"in": 0, "out": 0})
        inside[0] = 0
        forward(list(SDPBackend.__members__.values()))
    return saved["in"] / PROBE_TOKENS, saved["out"] / PROBE_TOKENS, (layer_inputs[0] / PROBE_TOKENS
                                                                      if layer_inputs else 0.0)


def config_facts(cfg) -> ModelFacts:
    """:func:`model_facts` of the model a ``torchspmd train`` configuration builds."""
    return _facts(_spec_of_config(cfg, cfg.preset), cfg.precision.dtype)


def model_facts(model: str, dtype: str = "fp32") -> ModelFacts:
    """Parameter counts (on the meta device) and measured activation bytes per token of a
    train preset or a transformers config file / directory."""
    return _facts(_spec(model), dtype)


def _facts(spec, dtype: str) -> ModelFacts:
    # The probe draws random numbers (its tokens, dropout): none of the caller's (a training
    # job's rank 0 asks before it trains, and must draw what the other processes draw).
    with torch.random.fork_rng(devices=[]):
        return _probe_facts(spec, dtype)


def _probe_facts(spec, dtype: str) -> ModelFacts:
    name, build, classes_of, layers, hidden, vocab = spec
    with _no_init():
        full = build(layers)
    classes = classes_of(full)
    params = sum(p.numel() for p in full.parameters())
    units = [m for m in full.modules() if isinstance(m, tuple(classes))]
    layer_params = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
    root_params = params - sum(sum(p.numel() for p in u.parameters()) for u in units)
    prefixes = tuple(n + "." for n, m in full.named_modules() if isinstance(m, tuple(classes)))
    named = list(full.named_parameters(remove_duplicate=False))
    inside = [i for i, (n, _) in enumerate(named) if n.startswith(prefixes)]
    first_params = sum(p.numel() for i, (n, p) in enumerate(named) if inside and i < inside[0])
    last_params = sum(p.numel() for i, (n, p) in enumerate(named) if inside and i > inside[-1])
    del full
    with _no_init():
        probe = build(1)
    probe = probe.to_empty(device="cpu")  # uninitialised: only the shapes matter
    for p in probe.parameters():
        p.data.zero_()
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    probe = probe.to(compute)
    for b in probe.buffers():  # rotary tables and the like: recompute their values on CPU
        if b.is_floating_point():
            b.data.normal_()
    act_layer, act_root, layer_input = _activations(probe, classes_of(probe), compute, vocab)
    return ModelFacts(name, params, layer_params, root_params, layers, hidden, vocab, act_layer, act_root,
                      layer_input, first_params, last_params)


def _in_flight(schedule: str, p: int, m: int) -> tuple[float, float]:
    """(first, last): the micro-batches whose activations the first and the last process of
    a ``p``-process pipeline hold at once, in units of one stage's layers (an interleaved
    process's stage is half its layers). gpipe: all ``m`` forwards before any backward;
    1f1b: ``min(p, m)`` on the first (its warm-up), one on the last; the interleaved
    schedules as torch's warm-up, ``(v - 1) p + 2 (p - 1 - rank) + 1`` stage-micro-batches,
    at most ``v m``."""
    if schedule == "gpipe":
        return m, m
    if schedule == "1f1b":
        return min(p, m), 1
    v = stages_per_process(schedule)
    first = min(v * m, (v - 1) * p + 2 * (p - 1) + 1) / v
    last = min(v * m, (v - 1) * p + 1) / v
    return first, last


def _in_flight_later(schedule: str, p: int, m: int) -> tuple[float, float]:
    """(first, last): as :func:`_in_flight`, at the start of a later backward, when the
    earlier micro-batches' gradients are held: gpipe one fewer (no forward runs between
    its backwards); the others run a forward before each backward while micro-batches
    remain, so they hold their warm-up's count again (one fewer when the warm-up took every
    micro-batch). 0: a single micro-batch, no later backward."""
    if schedule == "gpipe":
        return m - 1, m - 1
    v = stages_per_process(schedule)
    first, last = _in_flight(schedule, p, m)
    return min(first, (v * m - 1) / v), min(last, (v * m - 1) / v)


def estimate(facts: ModelFacts, devices: int, batch: int, seq: int, dtype: str = "fp32",
             optimizer: str = "adamw", grad_accum: int = 1, *, model: int = 1, pipeline: int = 1,
             microbatches: int = 0, schedule: str = "1f1b", context: int = 1) -> dict[str, dict[str, float]]:
    """Predicted peak bytes per device, by strategy, with their parts: ``batch`` sequences
    of ``seq`` tokens per optimizer step, in ``grad_accum`` micro-batches split over the
    devices' data-parallel groups.

    ``model``: the 'model' axis's size (tensor parallelism): it divides the parameters'
    state and FSDP's gathered units; the activations are counted whole on every process of
    the axis (an upper bound: Megatron pairs split the MLP's and the heads' activations).
    ``pipeline``: stages (``schedule``, ``microbatches``, 0: the fewest with a bubble of at
    most 25%, as ``torchspmd train`` chooses): FSDPv2 only (checkpointing and CPU offload do
    not combine with stages); see :func:`stages_estimate`.
    ``context``: the 'context' axis's size: each sequence is split over it, so a process
    holds ``ceil(seq / context)`` tokens of each of its rows and the activations, logits
    and loss buffers of those (ring attention keeps only the process's own keys and values
    for backward); FSDPv2 shards the parameters over 'fsdp' x 'context' together (the
    ``devices / model`` processes). It does not combine with 'model' or stages (as
    ``torchspmd train`` refuses)."""
    if (devices < 1 or batch < 1 or seq < 1 or grad_accum < 1 or model < 1 or pipeline < 1
            or context < 1):
        raise SpmdError("plan: devices, batch, seq, grad_accum, the 'model', 'pipeline' and 'context' axes must be "
                        "positive")
    if context > 1 and (model > 1 or pipeline > 1):
        raise SpmdError(f"plan: the 'context' axis ({context}) does not combine with the 'model' axis ({model}) or "
                        f"pipeline stages ({pipeline}); give one of them")
    if devices % context:
        raise SpmdError(f"plan: the 'context' axis ({context}) must divide the {devices} devices")
    if optimizer not in OPTIMIZER_STATES:
        raise SpmdError(f"plan --optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    if dtype not in ("fp32", "bf16"):
        raise SpmdError(f"plan --dtype {dtype!r}: choose fp32 or bf16")
    if devices % (model * pipeline):
        raise SpmdError(f"plan: the 'model' axis ({model}) x the stages ({pipeline}) must divide the {devices} devices")
    if pipeline > 1:
        return {"FSDPv2": stages_estimate(facts, devices, batch, seq, dtype, optimizer, grad_accum, model, pipeline,
                                          microbatches, schedule)}
    c = 2 if dtype == "bf16" else 4
    k = OPTIMIZER_STATES[optimizer]
    n = devices // model  # the processes FSDPv2 shards over ('fsdp' x 'context')
    rows = math.ceil(batch / grad_accum / (n // context))  # per data-parallel group
    tokens = rows * math.ceil(seq / context)  # this process's
    P = facts.params
    acts = tokens * (facts.layers * facts.act_layer + facts.act_root)
    acts_ckpt = tokens * (facts.layers * facts.layer_input + facts.act_layer + facts.act_root)
    # The fp32 logits the caller holds through backward, their gradient, and the
    # cross-entropy's backward buffers of that size (met by the root's gathered parameters).
    loss_grad = 4 * tokens * facts.vocab * 4
    unit = max(facts.layer_params, facts.root_params) / model
    # FSDPv2: the root unit stays gathered through backward; a layer computing and the next
    # one gathered; the all-gather output buffer and the reduce-scatter input of one unit.
    gathered = c * (facts.root_params + 2 * facts.layer_params) / model + c * unit + 4 * unit
    shard = P / (n * model)

    def peak(params_opt: float, grads: float, fixed: float, activations: float) -> dict[str, float]:
        return _peak(params_opt, grads, fixed, activations, loss_grad, grad_accum > 1)

    out = {
        # DDP: whole parameters, optimizer state and gradients, plus its gradient buckets.
        "DDP": peak((4 + 4 * k) * P / model, 4 * P / model, 4 * P / model, acts),
        "FSDPv2": peak((4 + 4 * k) * shard, 4 * shard, gathered, acts),
        "FSDPv2 + checkpointing": peak((4 + 4 * k) * shard, 4 * shard, gathered, acts_ckpt),
        "FSDPv2 + checkpointing + CPU offload": peak(0.0, 0.0, gathered, acts_ckpt),
    }
    return out


def _peak(params_opt: float, grads: float, fixed: float, activations: float, loss_grad: float,
          accumulating: bool) -> dict[str, float]:
    """The larger of the start of backward (all activations; no gradients yet, unless an
    earlier micro-batch of the step left its accumulated ones) and its end (all
    gradients, activations freed)."""
    start = params_opt + fixed + activations + loss_grad + (grads if accumulating else 0.0)
    end = params_opt + grads + fixed
    if start >= end:
        held = {"accumulated gradients": grads} if accumulating else {}
        return {"parameters + optimizer": params_opt, **held, "gathered + buffers": fixed,
                "activations": activations, "logits, loss buffers": loss_grad, "total": start}
    return {"parameters + optimizer": params_opt, "gradients": grads, "gathered + buffers": fixed,
            "total": end}


def stages_estimate(facts: ModelFacts, devices: int, batch: int, seq: int, dtype: str, optimizer: str,
                    grad_accum: int, model: int, pipeline: int, microbatches: int = 0,
                    schedule: str = "1f1b") -> dict[str, float]:
    """FSDPv2 inside ``pipeline`` stages (``torchspmd.pipeline``), the peak of the first and
    the last process of the axis (the others hold fewer micro-batches or no loss):

    - a stage holds ``ceil(layers / pipeline)`` layers (the most a stage holds; the
      runner's balance by parameter count gives the end stages fewer when their other
      modules are large), the first stage also the parameters registered before the first
      layer (embeddings), the last those after the last (final norm, LM head, a tied table
      again), split over its 'fsdp' processes and the 'model' axis;
    - FSDP keeps the stage's units gathered from their forward to their backward (as the
      runner does), so the whole stage is gathered through the step (compute dtype);
      without 'fsdp' (one process per stage and 'model' block) nothing is gathered;
    - activations: one micro-batch's (``rows / microbatches`` rows) per micro-batch in
      flight, plus the received activation and its gradient;
    - the last stage's loss: the logits buffers of the micro-batches in flight there;
    - gradients: the stage's whole (unsharded: torch's schedules reduce-scatter them over
      'fsdp' after the last micro-batch's backward only) fp32 gradients, from the first
      micro-batch's backward to the end of the step.

    The peak is the largest of: the first backward (:func:`_in_flight` micro-batches in
    flight, no gradients yet unless an earlier micro-step left its sharded ones), a later
    backward (:func:`_in_flight_later` micro-batches in flight, and the gradients), and the
    end of the step (the gradients, whole and sharded). The test suite checks it against
    the measured peak of real runs on CPU processes (within 15%), as FSDPv2's.

    Parts add ``"bubble"`` (the schedule's idle share by its formula, a fraction) and
    ``"microbatches"``."""
    if schedule not in PIPELINE_SCHEDULES:
        raise SpmdError(f"plan --schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if pipeline * stages_per_process(schedule) > facts.layers:
        raise SpmdError(f"plan --pipeline {pipeline}: {facts.name} has {facts.layers} layers, fewer than the "
                        f"{pipeline * stages_per_process(schedule)} stages of the {schedule} schedule")
    c = 2 if dtype == "bf16" else 4
    k = OPTIMIZER_STATES[optimizer]
    dp = devices // (model * pipeline)
    rows = math.ceil(batch / grad_accum / dp)
    m = microbatches or fewest_microbatches(rows, pipeline, schedule)
    if m is None or m not in allowed_microbatches(rows, pipeline, schedule):
        raise SpmdError(f"plan: {rows} rows per process per micro-step cannot be split into "
                        f"{microbatches or 'any number of'} micro-batches the {schedule} schedule over {pipeline} "
                        f"stages takes; raise --batch or choose --microbatches among "
                        f"{allowed_microbatches(rows, pipeline, schedule) or 'none'}")
    tokens = rows // m * seq  # one micro-batch's
    layers = math.ceil(facts.layers / pipeline)
    first, last = _in_flight(schedule, pipeline, m)
    first_later, last_later = _in_flight_later(schedule, pipeline, m)
    per_micro = tokens * (layers * facts.act_layer + facts.act_root)
    boundary = 2 * tokens * facts.hidden * c  # the received activation and its gradient
    known = facts.first_params or facts.last_params
    candidates = []
    for held, later, is_last, outside in (
            (first, first_later, False, facts.first_params if known else facts.root_params),
            (last, last_later, True, facts.last_params if known else facts.root_params)):
        stage = layers * facts.layer_params + outside
        shard = stage / (dp * model)
        # (without 'fsdp' inside the stages there is no FSDP: nothing gathered)
        gathered = c * stage / model + (c + 4) * max(facts.layer_params, outside) / model if dp > 1 else 0.0
        whole_grads = 4 * stage / model
        # an earlier micro-step's gradients: FSDP's sharded ones beside the whole being accumulated
        # (without 'fsdp' they are the same tensors)
        earlier = 4 * shard if grad_accum > 1 and dp > 1 else 0.0
        first_grads = whole_grads if grad_accum > 1 and dp == 1 else earlier
        base = {"parameters + optimizer": (4 + 4 * k) * shard}

        def loss(micro: float) -> float:
            """The last stage's logits of the micro-batches in flight (gpipe: all; the others: the
            last virtual stage's one) and the cross-entropy's backward buffers."""
            held_logits = micro if schedule == "gpipe" else min(micro, 1)
            return (held_logits + 3) * tokens * facts.vocab * 4 if is_last and held_logits else 0.0

        start = {**base, **({"accumulated gradients": first_grads} if first_grads else {}),
                 "gathered + buffers": gathered, "activations": held * per_micro + boundary,
                 "logits, loss buffers": loss(held)}
        candidates.append(start)
        if later > 0:
            candidates.append({**base, "gradients": whole_grads + earlier, "gathered + buffers": gathered,
                               "activations": later * per_micro + boundary, "logits, loss buffers": loss(later)})
        candidates.append({**base, "gradients": whole_grads + (4 * shard if dp > 1 else 0.0),
                           "gathered + buffers": gathered})
    for cand in candidates:
        cand["total"] = sum(cand.values())
    out = dict(max(candidates, key=lambda e: e["total"]))
    out["bubble"] = bubble(pipeline, schedule, m)
    out["microbatches"] = m
    return out


#: The FSDPv2 strategies in the order a proposal tries them: each costs more than the one
#: before (recomputation, then host transfers).
LADDER = ["FSDPv2", "FSDPv2 + checkpointing", "FSDPv2 + checkpointing + CPU offload"]
#: The share of a device's memory a prediction may take (allocator fragmentation, the CUDA
#: context and framework buffers take the rest).
HEADROOM = 0.9


@dataclass
class Proposal:
    """What fits a device of ``memory`` bytes: ``strategy`` with ``rows`` sequences per
    data-parallel group per micro-batch and ``grad_accum`` micro-batches per step (the global
    batch unchanged) on ``devices`` devices (more than asked for when ``devices_changed``),
    with ``pipeline`` stages (1: none; then ``microbatches`` pipeline micro-batches), predicted
    to peak at ``total`` bytes."""
    memory: float
    strategy: str
    devices: int
    rows: int
    grad_accum: int
    total: float
    devices_changed: bool
    pipeline: int = 1
    microbatches: int = 0


def propose(facts: ModelFacts, devices: int, batch: int, seq: int, memory: float, dtype: str = "fp32",
            optimizer: str = "adamw", strategy: str = "FSDPv2", max_devices: int = 4096,
            ladder: list[str] = LADDER, *, model: int = 1, stages: bool = True,
            schedule: str = "1f1b", context: int = 1) -> Proposal | None:
    """The cheapest way to run a global batch of ``batch`` x ``seq`` on devices of ``memory``
    bytes with a 'model' axis of ``model``: the largest micro-batch per data-parallel group (a
    divisor of its rows, the rest as ``grad_accum``) that fits with ``strategy``; if even one
    row does not fit, the next strategy of ``ladder`` (checkpointing, then CPU offload); then
    (``stages``) pipeline stages, 2, 4, ... (FSDPv2 inside them, ``schedule``); then twice the
    devices, up to ``max_devices`` (the global batch must still divide). With a 'context' axis
    of ``context`` (each sequence split over it) no stages are tried. None when nothing fits."""
    budget = memory * HEADROOM
    n = devices
    while n <= max_devices and n % (model * context) == 0 and batch % (n // (model * context)) == 0:
        dp = n // (model * context)
        for name in ladder[ladder.index(strategy):]:
            per = batch // dp
            for rows in sorted((r for r in range(1, per + 1) if per % r == 0), reverse=True):
                accum = per // rows
                total = estimate(facts, n, batch, seq, dtype, optimizer, accum, model=model,
                                 context=context)[name]["total"]
                if total <= budget:
                    return Proposal(memory, name, n, rows, accum, total, n != devices)
        pp = 2
        while stages and context == 1 and dp % pp == 0 and pp * stages_per_process(schedule) <= facts.layers:
            per = batch // (dp // pp)
            for rows in sorted((r for r in range(1, per + 1) if per % r == 0), reverse=True):
                accum = per // rows
                if fewest_microbatches(rows, pp, schedule) is None:
                    continue
                parts = estimate(facts, n, batch, seq, dtype, optimizer, accum, model=model, pipeline=pp,
                                 schedule=schedule)["FSDPv2"]
                if parts["total"] <= budget:
                    return Proposal(memory, "FSDPv2", n, rows, accum, parts["total"], n != devices, pp,
                                    int(parts["microbatches"]))
            pp *= 2
        n *= 2
    return None


def describe(p: Proposal) -> str:
    more = f" on {p.devices} devices" if p.devices_changed else ""
    stages = (f" in {p.pipeline} pipeline stages ({p.microbatches} micro-batches)" if p.pipeline > 1 else "")
    return (f"{p.strategy}{stages}, {p.rows} row{'s' if p.rows > 1 else ''} per device x grad_accum "
            f"{p.grad_accum}{more}: {p.total / 2**30:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="torchspmd plan",
                                description="Predict the peak memory per device of a training step, and propose "
                                            "the micro-batch (and what else) that fits each device size.")
    p.add_argument("--model", default="tiny", help="a train preset (tiny, small, llama-1b, llama2-7b, ...) or a "
                                                   "transformers config.json / model directory")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: the preset's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per step (default: the preset's, else 1)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: the preset's, else bf16")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    p.add_argument("--mesh-model", type=int, default=1, help="the 'model' axis's size (tensor parallelism)")
    p.add_argument("--pipeline", type=int, default=1, help="pipeline stages (the 'pipeline' axis's size)")
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b", help="the stages' schedule")
    p.add_argument("--context", type=int, default=None,
                   help="the 'context' axis's size: each sequence split over it (FSDPv2 shards over 'fsdp' x "
                        "'context'; default: the preset's mesh.context, else 1)")
    p.add_argument("--microbatches", type=int, default=0,
                   help="pipeline micro-batches per micro-step (0: the fewest with a bubble of at most 25%%)")
    p.add_argument("--memory-gb", type=float, action="append", default=None,
                   help="a device size (GB of memory) to propose for, instead of the common ones; repeatable")
    a = p.parse_args(argv)

    cfg = preset(a.model) if a.model in PRESETS else None
    batch = a.batch or (cfg.optim.batch_size if cfg else 8)
    seq = a.seq or (cfg.data.seq_len if cfg else 1024)
    accum = a.grad_accum or (cfg.optim.grad_accum if cfg and a.batch is None else 1)
    dtype = a.dtype or (cfg.precision.dtype if cfg else "bf16")
    a.context = a.context if a.context is not None else (cfg.mesh.context if cfg else 1)
    for name, v in (("--devices", a.devices), ("--batch", batch), ("--seq", seq), ("--grad-accum", accum),
                    ("--mesh-model", a.mesh_model), ("--pipeline", a.pipeline), ("--context", a.context)):
        if v < 1:
            raise SpmdError(f"plan {name} {v}: must be at least 1")
    if batch % accum:
        raise SpmdError(f"plan --batch {batch} is not divisible by --grad-accum {accum}")
    if any(m <= 0 for m in a.memory_gb or []):
        raise SpmdError("plan --memory-gb: give a positive size in GB")
    if a.devices % (a.mesh_model * a.pipeline * a.context):
        raise SpmdError(f"plan --mesh-model {a.mesh_model} x --pipeline {a.pipeline} x --context {a.context} must "
                        f"divide --devices {a.devices}")
    if a.context > 1 and (a.mesh_model > 1 or a.pipeline > 1):
        raise SpmdError(f"plan --context {a.context}: the 'context' axis does not combine with --mesh-model or "
                        f"--pipeline; give one of them")
    facts = model_facts(a.model, dtype)
    axes = dict(model=a.mesh_model, pipeline=a.pipeline, microbatches=a.microbatches, schedule=a.schedule,
                context=a.context)
    plan = estimate(facts, a.devices, batch, seq, dtype, a.optimizer, accum, **axes)
    gb = 2**30
    dp = a.devices // (a.mesh_model * a.pipeline * a.context)
    rows = math.ceil(batch / accum / dp)
    mesh = (f"; mesh: 'fsdp' {dp}" + (f" x 'model' {a.mesh_model}" if a.mesh_model > 1 else "")
            + (f" x 'pipeline' {a.pipeline}" if a.pipeline > 1 else "")
            + (f" x 'context' {a.context} ({math.ceil(seq / a.context)} tokens of each sequence per process)"
               if a.context > 1 else ""))
    print(f"{facts.name}: {facts.params / 1e6:.1f}M parameters ({facts.layers} layers of "
          f"{facts.layer_params / 1e6:.1f}M, {facts.root_params / 1e6:.1f}M outside them); {a.devices} devices{mesh}, "
          f"global batch {batch} x {seq} tokens ({rows} rows per data-parallel group per micro-batch, grad_accum "
          f"{accum}), {dtype}, {a.optimizer}")
    print(f"activations measured per token: {facts.act_layer / 1024:.1f} KiB per layer, "
          f"{facts.act_root / 1024:.1f} KiB outside the layers")
    if a.pipeline > 1:
        st = plan["FSDPv2"]
        print(f"stages: {a.pipeline} of up to {math.ceil(facts.layers / a.pipeline)} layers, {a.schedule}, "
              f"{int(st['microbatches'])} micro-batches: bubble {st['bubble']:.0%} by the schedule's formula; the "
              f"peak is the larger of the first stage's (micro-batches in flight) and the last's (the loss)")
    print()
    sizes = ({f"{m:g} GB": m for m in a.memory_gb} if a.memory_gb else DEVICE_SIZES_GB)
    header = f"{'strategy':40s} {'peak GB/device':>14s}  parts (GB)"
    print(header)
    print("-" * len(header))
    for name, parts in plan.items():
        detail = ", ".join(f"{k} {v / gb:.2f}" for k, v in parts.items() if k not in ("total", "bubble", "microbatches"))
        print(f"{name:40s} {parts['total'] / gb:14.2f}  {detail}")
    print()
    for name, parts in plan.items():
        fits = [label for label, size in sizes.items() if parts["total"] <= size * 1e9 * HEADROOM]
        print(f"{name}: fits {', '.join(fits) if fits else 'none of ' + ', '.join(sizes)}")
    print(f"\nProposed (FSDPv2{' x model ' + str(a.mesh_model) if a.mesh_model > 1 else ''}"
          f"{' x context ' + str(a.context) if a.context > 1 else ''}; global batch {batch} x "
          f"{seq} kept; the largest micro-batch per device that fits, else the cheapest change: checkpointing, CPU "
          f"offload, pipeline stages, more devices):")
    for label, size in sizes.items():
        proposal = propose(facts, a.devices, batch, seq, size * 1e9, dtype, a.optimizer, model=a.mesh_model,
                           schedule=a.schedule, context=a.context)
        print(f"  {label}: " + (describe(proposal) if proposal else
                                f"nothing fits, even with CPU offload, stages and more devices (up to 4096 that "
                                f"divide the batch of {batch}): lower --seq or use a larger --mesh-model"))
    print(f"\n(a device fits when the prediction is at most {HEADROOM:.0%} of its memory: allocator fragmentation, "
          f"the CUDA context and framework buffers take the rest; with a 'model' axis the activations are counted "
          f"whole on each of its processes, an upper bound)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
