"""The benchmark suite: every data-parallel strategy, on two models, at 2 and 4 processes.

    python bench/suite.py                       # everything, 3 rounds (about 80 minutes on 2 cores)
    python bench/suite.py --models seed --nproc 2 --repeats 2 --steps 6

Strategies, each training the same model on the same global batches (4 x 64 tokens,
fused Adam, one FSDP unit per decoder layer; every process gets the malloc settings of
``torchspmd run``, one process and torch_xla's included):

- ``single``: one process (all cores);
- ``ddp``: PyTorch DDP;
- ``fsdp2``: PyTorch FSDP2 (``fully_shard`` per layer and the root), its own collectives;
- ``fsdpv2``: torchspmd FSDPv2 (default ``collectives="auto"``);
- ``fsdpv2-native``: torchspmd FSDPv2 with FSDP2's own collectives (what torchspmd's
  layer costs over the engine underneath);
- ``fsdpv2-compile``: torchspmd FSDPv2 with ``compile=True``;
- ``fsdpv2-accelerator`` (only when named in ``--strategies``): torchspmd FSDPv2 on the code
  path a GPU or TPU takes (``TORCHSPMD_ACCELERATOR_PATH=1``: every CPU-only shortcut off,
  FSDP2's own collectives, sums through gloo): what the shortcuts are worth on CPU;
- ``fsdpv2-unbound`` (only when named in ``--strategies``): torchspmd FSDPv2 with its workers
  free to run on any core (``TORCHSPMD_BIND_CORES=0``; by default each runs on its own share);
- ``fsdpv2-mp`` (only when named, and only with ``--dtype bf16``): torchspmd FSDPv2 with
  ``mixed_precision='bf16'`` instead of autocast: each unit's parameters gathered and its
  forward and backward computed in bf16, fp32 shards, gradient reduction and Adam state;
- ``xla``: torch_xla's FSDPv2 in one process driving n CPU devices, when a virtual
  environment with torch_xla is found (``$TORCHSPMD_XLA_PYTHON`` or
  ``~/.cache/torchspmd/xla-venv``);
- ``xla-torchspmd``: the same program written with torchspmd's API on its XLA backend
  (what torchspmd's delegation costs over torch_xla itself).

Models: ``seed``, the 107M-parameter seed decoder (vocab 3200, dim 1024, 8 layers, MLP
4096), and ``llama``, a transformers Llama of the same shape built from a config (its
classes imported at the top of this file, as a program imports them: every run, of either
model, has transformers loaded). The scaling run trains torchspmd FSDPv2 on 1, 2 and 4 processes at two model sizes.

``--dtype bf16`` runs every strategy's forward and loss under bf16 autocast
(``torch.autocast('cpu')``; ``torch.autocast('xla')`` for torch_xla's runs) over fp32
parameters, gradients and Adam state (the like-for-like bf16 comparison), writing
``suite_bf16.*``. torch_xla's Llama
then uses transformers' eager attention (its SDPA fails under XLA's autocast: ``_xla_attn``).

``--2d`` runs only the 2D comparison (tensor parallel x FSDP, 4 processes on a (2, 2)
mesh, the ``small`` seed decoder, same global batches): torchspmd FSDPv2 with the MLP and
LM-head weights annotated over ``'model'`` (``2d-fsdpv2``), against the composition
PyTorch users write by hand as torchtitan does: ``parallelize_module`` over the ``'tp'``
mesh dimension, then ``fully_shard`` over ``'dp'`` (``2d-tp-fsdp2``). The two run
``--repeats`` times each, interleaved (A B, B A, ...), and the table gives the median
and the range over the runs; one plain process gives the reference losses and gradient
norm both must reproduce. Writes ``bench/results/suite_2d.md`` and ``suite_2d.json``
(nothing else).

A run's tokens/s is the median of its timed steps after warm-up; peak RSS is rank 0's
(the processes are alike); model state is the bytes of parameters, gradients and
optimizer state one process holds; CPU use is rank 0's user and system seconds and context
switches over the timed steps (``getrusage``), times the processes (torch_xla's one process
as it is), with the utilisation of the cores it implies (a table after each model's). Every configuration runs ``--repeats`` times: each
round runs all of them, in an order rotated by one each round, so that a slow stretch of
this shared machine falls on every strategy alike. The tables give the median and the
min-max over the runs, and ratios per round (this round's run against this round's
FSDP2, or torch_xla's FSDPv2) as median and min-max: a ratio whose range straddles 1 is
not a difference. Writes ``suite.md``, ``suite.json`` and ``suite.png`` under ``--out``
(default ``bench/results``) and nothing else: no other file, README.md included, is edited.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

# The Llama model's classes, imported at the top as a program imports them (under
# `torchspmd run` the launcher then imports them once for all its forked workers).
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    CpuUse,
    per_process_loader,
    provenance,
    run_measured,
    run_worker,
    timed_steps,
    write_result,
)

SEED = dict(vocab_size=3200, dim=1024, num_layers=8, num_heads=8, intermediate_size=4096, max_seq_len=64)
SMALL = dict(vocab_size=3200, dim=384, num_layers=4, num_heads=6, intermediate_size=1536, max_seq_len=64)
BATCH, SEQ = 4, 64
STRATEGIES = ["single", "ddp", "fsdp2", "fsdpv2", "fsdpv2-native", "fsdpv2-compile", "xla", "xla-torchspmd"]
XLA = ("xla", "xla-torchspmd")
NAMES = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2 fully_shard", "fsdpv2": "torchspmd FSDPv2",
         "fsdpv2-native": "torchspmd FSDPv2, FSDP2's collectives", "fsdpv2-compile": "torchspmd FSDPv2, compile",
         "fsdpv2-unbound": "torchspmd FSDPv2, workers not bound to cores",
         "fsdpv2-accelerator": "torchspmd FSDPv2, the accelerator path (TORCHSPMD_ACCELERATOR_PATH=1)",
         "fsdpv2-mp": "torchspmd FSDPv2, mixed_precision='bf16'",
         "xla": "torch_xla FSDPv2 (one process)", "xla-torchspmd": "torchspmd FSDPv2 on the XLA backend (one process)"}
TWO_D = ["2d-fsdpv2", "2d-tp-fsdp2"]
NAMES_2D = {"2d-fsdpv2": "torchspmd FSDPv2, weights annotated over 'model'",
            "2d-tp-fsdp2": "parallelize_module + fully_shard (torchtitan style)", "2d-single": "one process"}


#: What a worker reports of its CPU use per timed step (``_common.CpuUse``).
CPU_KEYS = ("cpu_user_s", "cpu_sys_s", "csw_voluntary", "csw_involuntary")


def _xla_python() -> str | None:
    cand = os.environ.get("TORCHSPMD_XLA_PYTHON") or str(Path.home() / ".cache/torchspmd/xla-venv/bin/python")
    return cand if Path(cand).exists() else None


def _build(model: str, size: str, attn: str | None = None):
    """The model (``attn``: the Llama's attention implementation, transformers' default if None)."""
    import torch

    torch.manual_seed(0)
    cfg = SEED if size == "seed" else SMALL
    if model == "seed":
        from torchspmd.models import DecoderLayer, DecoderModel

        return DecoderModel(**cfg), DecoderLayer, cfg["vocab_size"]
    config = LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["dim"], intermediate_size=cfg["intermediate_size"],
                         num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_heads"],
                         num_key_value_heads=cfg["num_heads"], max_position_embeddings=SEQ, use_cache=False,
                         **({"attn_implementation": attn} if attn else {}))
    return LlamaForCausalLM(config), LlamaDecoderLayer, cfg["vocab_size"]


def _xla_attn(dtype: str) -> str | None:
    """torch_xla's Llama in bf16 uses transformers' eager attention: its SDPA fails under
    ``torch.autocast('xla')`` (the rotary embedding leaves query and key in fp32, the value
    projection is bf16, and XLA's autocast does not cast SDPA's inputs as the CPU's does)."""
    return "eager" if dtype == "bf16" else None


def _state_bytes(model, opt) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(local(p) for p in model.parameters())
    total += sum(local(p.grad) for p in model.parameters() if p.grad is not None)
    total += sum(local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return total


def _data(vocab: int, steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (steps * BATCH, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _autocast(device: str, dtype: str):
    """The forward's and the loss's context: bf16 autocast (fp32 parameters, gradients and
    optimizer state; matrix products in bf16), the same for every strategy."""
    import functools

    import torch

    return functools.partial(torch.autocast, device, dtype=torch.bfloat16) if dtype == "bf16" else None


def worker(strategy: str, model_name: str, size: str, steps: int, warmup: int, result: str,
           dtype: str = "fp32") -> None:
    import torch

    model, layer_cls, vocab = _build(model_name, size)
    data = _data(vocab, steps)
    rank = 0
    if strategy == "single":
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    elif strategy in ("ddp", "fsdp2"):
        rank, _, loader = per_process_loader(data, BATCH)
        if strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for m in list(model.modules()):
                if isinstance(m, layer_cls):
                    fully_shard(m)
            fully_shard(model)
    else:
        import functools

        import numpy as np

        import torchspmd as ts

        ts.use_spmd()
        rank = ts.global_ordinal()
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
        policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
        options = {"fsdpv2": {}, "fsdpv2-native": {"collectives": "native"}, "fsdpv2-compile": {"compile": True},
                   "fsdpv2-unbound": {}, "fsdpv2-accelerator": {}, "fsdpv2-mp": {"mixed_precision": "bf16"}}
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, **options[strategy])
        loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=BATCH), ts.device(),
                                   input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)  # PyTorch's fused CPU Adam kernel
    cpu = CpuUse()
    # fsdpv2-mp computes in bf16 by its own policy (its outputs come back in fp32), not by autocast
    times = timed_steps(model, opt, loader, vocab, warmup, cpu,
                        None if strategy == "fsdpv2-mp" else _autocast("cpu", dtype))
    if rank == 0:
        write_result(result, strategy, BATCH * SEQ, times, state_gb=_state_bytes(model, opt) / 2**30,
                     **cpu.per_step())


def worker_2d(strategy: str, steps: int, warmup: int, result: str) -> None:
    """One 2D run (``2d-fsdpv2``, ``2d-tp-fsdp2``, or the one-process reference ``2d-single``)
    of the ``small`` seed decoder: every rank's peak RSS, the timed steps, the losses of all
    steps and the gradient norm of the first step, all as one device computes them."""
    import contextlib
    import functools
    import resource
    import statistics
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from torchspmd.models import DecoderLayer, DecoderModel

    torch.manual_seed(0)
    model = DecoderModel(**SMALL)
    vocab = SMALL["vocab_size"]
    batches = list(torch.utils.data.DataLoader(_data(vocab, steps), batch_size=BATCH))
    tokens = BATCH * SEQ
    step_ctx = contextlib.nullcontext
    dp_group = None
    if strategy == "2d-single":
        def feed(x, y):
            return x, y

        def loss_of(x, y):
            return F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    elif strategy == "2d-fsdpv2":
        import numpy as np

        import torchspmd as ts

        ts.use_spmd()
        mesh = ts.Mesh(np.arange(4), (2, 2), ("fsdp", "model"))
        for layer in model.layers:  # annotated in place, as torch_xla programs do
            ts.mark_sharding(layer.up.weight, mesh, ("model", None))
            ts.mark_sharding(layer.down.weight, mesh, (None, "model"))
        ts.mark_sharding(model.lm_head.weight, mesh, ("model", None))
        policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
        spec = ts.ShardingSpec(mesh, ("fsdp", None))
        step_ctx = ts.step

        def feed(x, y):
            return ts.shard_batch((x, y), spec)

        def loss_of(x, y):
            return F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        for m in [*model.layers, model]:
            fully_shard(m, mesh=mesh["dp"])
            m.set_gradient_divide_factor(1.0)  # gradients summed over dp: the loss is already / global tokens
            m.set_force_sum_reduction_for_comms(True)
        dp, rows = mesh["dp"].get_local_rank(), BATCH // mesh["dp"].size()
        dp_group = mesh["dp"].get_group()

        def feed(x, y):  # this process's dp rows of the global batch
            return x[dp * rows:(dp + 1) * rows], y[dp * rows:(dp + 1) * rows]

        def loss_of(x, y):
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction="sum") / tokens

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times, losses, grad_norm = [], [], None
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        with step_ctx():
            x, y = feed(x, y)
            loss = loss_of(x, y)
            loss.backward()
            if step == 0:  # a warm-up step: not timed
                grad_norm = sum(full(p.grad).double().pow(2).sum() for p in model.parameters()).sqrt().item()
            opt.step()
            opt.zero_grad()
        value = loss.item()  # wait for the step to finish
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(value)
    if dp_group is not None:  # each dp row group holds its part of the loss
        total = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(total, group=dp_group)
        losses = total.tolist()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, rss)
        rank = dist.get_rank()
    else:
        every, rank = [rss], 0
    if rank == 0:
        Path(result).write_text(json.dumps({
            "strategy": strategy, "tokens_per_s": tokens / statistics.median(times), "peak_rss_gb": every,
            "state_gb": _state_bytes(model, opt) / 2**30, "losses": losses, "grad_norm": grad_norm,
        }))


def run_2d(repeats: int, steps: int, warmup: int) -> None:
    """The 2D comparison, interleaved: A B, B A, A B, ... so that a slow stretch of this
    shared machine falls on both alike; writes bench/results/suite_2d.md and .json."""
    import statistics

    import torch

    def launch(strategy: str, nproc: int) -> dict:
        args = ["--worker", strategy, "--steps", str(steps), "--warmup", str(warmup)]
        return run_worker(__file__, args, nproc, HERE / "results" / f".{strategy}.json")

    ref = launch("2d-single", 1)
    runs: dict[str, list[dict]] = {s: [] for s in TWO_D}
    for r in range(repeats):
        for s in (TWO_D if r % 2 == 0 else TWO_D[::-1]):
            runs[s].append(launch(s, 4))
            print(f"2d repeat {r + 1}/{repeats}: {s} {runs[s][-1]['tokens_per_s']:.0f} tok/s", flush=True)

    rows = []
    for s in TWO_D:
        tps = [x["tokens_per_s"] for x in runs[s]]
        rss = [max(x["peak_rss_gb"]) for x in runs[s]]
        rows.append({
            "strategy": s, "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
            "peak_rss_gb": statistics.median(rss), "peak_rss_gb_runs": rss,
            "peak_rss_gb_ranks": runs[s][-1]["peak_rss_gb"], "state_gb": runs[s][0]["state_gb"],
            "max_loss_diff": max(abs(a - b) for x in runs[s] for a, b in zip(x["losses"], ref["losses"])),
            "grad_norm_rel_diff": max(abs(x["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"] for x in runs[s]),
        })
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[TWO_D[0]], runs[TWO_D[1]])]
    cores = os.cpu_count() or 1
    machine = provenance()
    lines = [
        "## 2D: tensor parallel x FSDP, 4 processes on a (2, 2) mesh", "", machine, "",
        f"`python bench/suite.py --2d --repeats {repeats} --steps {steps} --warmup {warmup}` on this machine: "
        f"{platform.machine()}, {cores} cores, torch {torch.__version__}, gloo. Seed decoder {SMALL}, "
        f"global batch {BATCH} x {SEQ} tokens (2 rows per data-parallel group), Adam; MLP (`up` column-, "
        f"`down` row-parallel) and LM head (column-parallel, output gathered) split over the tensor-parallel "
        f"axis, one FSDP unit per decoder layer over the data axis. Each run's tokens/s is the median of its "
        f"{steps - warmup} timed steps (the batch's sharding included); {repeats} runs of each, interleaved. "
        f"OMP threads = 1 per process.", "",
        "| strategy | processes | tokens/s, median of runs | tokens/s, min-max of runs | "
        "peak RSS per process (GB), median of runs | min-max of runs | model state per process (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps, rss = r["tokens_per_s_runs"], r["peak_rss_gb_runs"]
        lines.append(f"| {NAMES_2D[r['strategy']]} | 4 (2 x 2) | {r['tokens_per_s']:.0f} | "
                     f"{min(tps):.0f}-{max(tps):.0f} | {r['peak_rss_gb']:.2f} | {min(rss):.2f}-{max(rss):.2f} | "
                     f"{r['state_gb']:.4f} |")
    lines.append(f"| {NAMES_2D['2d-single']} (reference for losses and gradients, one run, not timed against "
                 f"the others) | 1 | | | {ref['peak_rss_gb'][0]:.2f} | | {ref['state_gb']:.4f} |")
    lines += [
        "",
        f"torchspmd FSDPv2 / torchtitan-style tokens/s, per pair of adjacent runs: median "
        f"{statistics.median(ratios):.2f}x, min-max {min(ratios):.2f}-{max(ratios):.2f}x. "
        "Peak RSS per process is the largest of the 4 processes in each run; model state is the bytes of "
        "parameters and Adam moments one process holds.", "",
        f"Same training as one process: over the {steps} steps, the largest |loss - one process's loss| is "
        + ", ".join(f"{r['max_loss_diff']:.1e} ({r['strategy']})" for r in rows)
        + "; the relative difference of the first step's gradient norm is "
        + ", ".join(f"{r['grad_norm_rel_diff']:.1e} ({r['strategy']})" for r in rows) + ".", "",
    ]
    text = "\n".join(lines)
    (HERE / "results" / "suite_2d.md").write_text(text)
    (HERE / "results" / "suite_2d.json").write_text(json.dumps(
        {"machine": machine, "rows": rows, "reference": ref, "ratios": ratios, "runs": runs}, indent=1))
    print(text)


def xla_worker(model_name: str, size: str, steps: int, warmup: int, result: str, api: str,
               dtype: str = "fp32") -> None:
    """FSDPv2 on PJRT_DEVICE=CPU devices, one process (torch_xla's venv): written with
    torch_xla's API (``api="xla"``) or with torchspmd's on its XLA backend."""
    if api == "xla-torchspmd":
        return _torchspmd_xla_worker(model_name, size, steps, warmup, result, dtype)
    import functools

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2,
    )

    xr.use_spmd()
    model, layer_cls, vocab = _build(model_name, size, _xla_attn(dtype))
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    device = xm.xla_device()
    model = model.to(device)

    def shard_output(output, mesh):
        logits = output if isinstance(output, torch.Tensor) else output.logits
        xs.mark_sharding(logits, mesh, ("fsdp", None, None))

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    model = FSDPv2(model, mesh=mesh, shard_output=shard_output, auto_wrap_policy=policy)
    loader = pl.MpDeviceLoader(torch.utils.data.DataLoader(_data(vocab, steps), batch_size=BATCH), device,
                               input_sharding=xs.ShardingSpec(mesh, ("fsdp", None)))
    _xla_timed(model, loader, vocab, warmup, n, result, "xla", torch_xla.step, dtype)


def _xla_timed(model, loader, vocab: int, warmup: int, n: int, result: str, strategy: str, in_step,
               dtype: str = "fp32") -> None:
    """Adam steps over ``loader``, each inside ``in_step()`` (which runs its graph on leaving);
    the result is written as ``strategy``'s."""
    import contextlib
    import time

    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    autocast = _autocast("xla", dtype) or contextlib.nullcontext
    times, cpu = [], CpuUse()
    for step, (x, y) in enumerate(loader):
        t0, c0 = time.perf_counter(), CpuUse.now()
        with in_step():
            with autocast():
                out = model(x)
                logits = out if isinstance(out, torch.Tensor) else out.logits
                loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        loss.item()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.add(c0, CpuUse.now())
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4 / n  # params, grads, 2 Adam moments
    write_result(result, strategy, BATCH * SEQ, times, state_gb=state / 2**30, **cpu.per_step())


def _torchspmd_xla_worker(model_name: str, size: str, steps: int, warmup: int, result: str,
                          dtype: str = "fp32") -> None:
    """The same program written with torchspmd's API."""
    import functools

    import numpy as np
    import torch

    import torchspmd as ts

    ts.use_spmd()
    assert ts.backend() == "xla"
    model, layer_cls, vocab = _build(model_name, size, _xla_attn(dtype))
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    model = ts.FSDPv2(model, mesh, auto_wrap_policy=policy)
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(_data(vocab, steps), batch_size=BATCH), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    _xla_timed(model, loader, vocab, warmup, n, result, "xla-torchspmd", ts.step, dtype)


def _run_xla(python: str, model: str, size: str, nproc: int, steps: int, warmup: int, result: Path,
             api: str = "xla", dtype: str = "fp32") -> dict | None:
    from torchspmd.launch.host import allocator_env as _allocator_env

    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(nproc), PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS=str(os.cpu_count() or 1))
    env.update(_allocator_env(env))  # the malloc settings the PyTorch runs get (XLA's buffers have their own allocator)
    r, pss = run_measured([python, __file__, "--xla-worker", api, "--models", model, "--size", size, "--steps",
                           str(steps), "--warmup", str(warmup), "--result", str(result), "--dtype", dtype], env,
                          timeout=1200,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        print(f"torch_xla run failed ({model}, x{nproc}):\n{r.stderr[-2000:]}")
        return None
    row = json.loads(result.read_text())
    result.unlink()
    return {**row, "peak_pss_gb": pss}


def _spread(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if len(values) > 1 else ""


def _table(rows: list[dict], title: str) -> list[str]:
    lines = [f"### {title}", "",
             "| strategy | processes | tokens/s, median of runs | min-max | vs FSDP2, median of rounds | min-max | "
             "peak memory per device (GB) | peak RSS per process (GB) | model state per process (GB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = r.get("vs_fsdp2_runs") or []
        procs = f"1 ({r['nproc']} devices)" if r["strategy"] in XLA else str(r["nproc"])
        rss = f"{r['peak_rss_gb']:.2f}" + (f" (all devices; / {r['nproc']} = {r['peak_rss_gb'] / r['nproc']:.2f})"
                                            if r["strategy"] in XLA else "")
        vs = f"{r['vs_fsdp2']:.2f}x" if ratios else ""
        pss = r.get("peak_pss_gb_runs") or []
        mem = (f"{statistics.median(pss) / r['nproc']:.2f} ({min(pss) / r['nproc']:.2f}-{max(pss) / r['nproc']:.2f})"
               if pss else "not measured")
        star = "*" if r.get("run", 1) > 1 else ""
        lines.append(f"| {NAMES[r['strategy']]}{star} | {procs} | {r['tokens_per_s']:.0f} | "
                     f"{_spread(r.get('tokens_per_s_runs', []), '.0f')} | {vs} | {_spread(ratios, '.2f')} | {mem} | "
                     f"{rss} | {r['state_gb']:.3f} |")
    lines += ["", "Peak memory per device: the largest physical memory all the run's processes held together "
              "(the sum of their PSS, sampled every 0.5 s; pages they share, such as torch's libraries and the "
              "shared-memory collective buffers, count once; `torchspmd run`'s launcher included), divided by the "
              "devices; median of runs (min-max). torch_xla's one process is measured the same way.", ""]
    for r in rows:
        if r.get("vs_unbound_runs"):
            x = r["vs_unbound_runs"]
            lines.append(f"- {NAMES[r['strategy']]} (workers bound to cores, the default) / not bound at "
                         f"{r['nproc']} processes: median {statistics.median(x):.2f}x, min-max "
                         f"{_spread(x, '.2f') or f'{x[0]:.2f}'} over the rounds.")
        if r.get("vs_accelerator_runs"):
            x = r["vs_accelerator_runs"]
            lines.append(f"- {NAMES[r['strategy']]} (the CPU shortcuts, the default) / the accelerator path at "
                         f"{r['nproc']} processes: median {statistics.median(x):.2f}x, min-max "
                         f"{_spread(x, '.2f') or f'{x[0]:.2f}'} over the rounds.")
        if r.get("vs_xla_runs"):
            x = r["vs_xla_runs"]
            lines.append(f"- {NAMES[r['strategy']]} / torch_xla FSDPv2 at {r['nproc']} devices: median "
                         f"{statistics.median(x):.2f}x, min-max {_spread(x, '.2f') or f'{x[0]:.2f}'} over the rounds.")
            ref = next((o for o in rows if o["strategy"] == "xla" and o["nproc"] == r["nproc"]), None)
            if ref and r.get("peak_pss_gb_runs") and ref.get("peak_pss_gb_runs"):
                mem = statistics.median(r["peak_pss_gb_runs"]) / statistics.median(ref["peak_pss_gb_runs"])
                lines[-1] = lines[-1][:-1] + f"; peak memory per device {mem:.2f}x torch_xla's."
    cpu = [r for r in rows if r.get("cpu_s_runs")]
    if cpu:
        lines += ["", "CPU use per timed step (`getrusage` over the timed steps, mean per step: rank 0's times the "
                  "processes, which do the same work (rank 0 also serves the process group's store); torch_xla's one "
                  "process as it is). Utilisation: those CPU seconds / (the same steps' wall seconds x cores). CPU "
                  "time counts busy-waiting as work: a process spinning in a wait would show as work here.", "",
                  "| strategy | processes | CPU s per step, all processes (min-max) | system share | utilisation "
                  "(min-max) | context switches per process per step, voluntary / involuntary |",
                  "|---|---|---|---|---|---|"]
        for r in cpu:
            procs = f"1 ({r['nproc']} devices)" if r["strategy"] in XLA else str(r["nproc"])
            c, u = r["cpu_s_runs"], r["utilisation_runs"]
            share = r["cpu_sys_s"] / max(1e-9, r["cpu_user_s"] + r["cpu_sys_s"])
            lines.append(f"| {NAMES[r['strategy']]} | {procs} | {statistics.median(c):.2f} ({_spread(c, '.2f')}) | "
                         f"{share:.0%} | {statistics.median(u):.2f} ({_spread(u, '.2f')}) | "
                         f"{r['csw_voluntary']:.0f} / {r['csw_involuntary']:.0f} |")
        lines.append("")
        for r in cpu:  # the growth with the device count, taken within each round
            more = next((o for o in cpu if o["strategy"] == r["strategy"] and o["nproc"] > r["nproc"]), None)
            if more and r.get("cpu_s_rounds") and more.get("cpu_s_rounds"):
                g = [b / a for a, b in zip(r["cpu_s_rounds"], more["cpu_s_rounds"]) if a and b]
                if g:
                    lines.append(f"- {NAMES[r['strategy']]}: CPU seconds per step at {more['nproc']} devices / at "
                                 f"{r['nproc']}, per round: median {statistics.median(g):.2f}x, min-max "
                                 f"{_spread(g, '.2f') or f'{g[0]:.2f}'}.")
    return lines + [""]


def _plot(results: dict, scaling: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(results) + bool(scaling)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    axes = list(axes[0])
    for ax, (model, rows) in zip(axes, results.items()):
        labels = [f"{r['strategy']}\nx{r['nproc']}" for r in rows]
        ax.bar(labels, [r["tokens_per_s"] for r in rows])
        ax.set_title(f"{model}: tokens/s")
        ax.tick_params(axis="x", labelsize=7, rotation=60)
    if not scaling:
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        return
    ax = axes[-1]
    for size in sorted({r["size"] for r in scaling}):
        pts = sorted((r["nproc"], r["state_gb"]) for r in scaling if r["size"] == size)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{size}: model state GB/process")
        pts = sorted((r["nproc"], r["peak_rss_gb"]) for r in scaling if r["size"] == size)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", linestyle="--", label=f"{size}: peak RSS GB")
    ax.set_xlabel("processes")
    ax.set_title("FSDPv2 scaling: memory per process")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["seed", "llama"])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=STRATEGIES)
    p.add_argument("--size", default="seed", choices=["seed", "small"])
    p.add_argument("--steps", type=int, default=None, help="default 8 (12 with --2d)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-scaling", action="store_true")
    p.add_argument("--update", action="store_true",
                   help="merge this run's rows into bench/results/suite.json (same model, strategy and processes "
                        "replaced) and write the tables again")
    p.add_argument("--2d", dest="two_d", action="store_true",
                   help="run only the 2D (tensor parallel x FSDP) comparison; writes bench/results/suite_2d.*")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: every strategy's forward and loss under bf16 autocast (torch.autocast on 'cpu', on "
                        "'xla' for torch_xla), fp32 parameters, gradients and Adam state; results go to suite_bf16.*")
    p.add_argument("--out", default=str(HERE / "results"), help="where the results files go")
    p.add_argument("--tables-from", metavar="JSON",
                   help="run nothing: write the tables, suite.json and the chart of a suite.json again, under --out")
    p.add_argument("--worker")
    p.add_argument("--xla-worker", choices=XLA)
    p.add_argument("--result")
    a = p.parse_args()
    if a.steps is None:
        a.steps = 12 if a.two_d else 8
    if "fsdpv2-mp" in a.strategies and a.dtype != "bf16":
        p.error("--strategies fsdpv2-mp is FSDPv2's mixed_precision='bf16': give it with --dtype bf16")
    if a.worker in (*TWO_D, "2d-single"):
        return worker_2d(a.worker, a.steps, a.warmup, a.result)
    if a.worker:
        return worker(a.worker, a.models[0], a.size, a.steps, a.warmup, a.result, a.dtype)
    if a.xla_worker:
        return xla_worker(a.models[0], a.size, a.steps, a.warmup, a.result, a.xla_worker, a.dtype)
    (HERE / "results").mkdir(exist_ok=True)
    if a.tables_from:
        saved = json.loads(Path(a.tables_from).read_text())
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        return _write(out, saved["results"], saved.get("scaling", []), saved.get("failed", []),
                      saved.get("steps", a.steps), saved.get("warmup", a.warmup), saved["repeats"],
                      saved.get("command", "python bench/suite.py"), saved.get("dtype", "fp32"),
                      saved.get("machine") or f"Machine: not recorded in {a.tables_from}.")
    if a.two_d:
        return run_2d(a.repeats, a.steps, a.warmup)
    xla = _xla_python()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--dtype", a.dtype]
    configs = [(model, s, n) for model in a.models for s, n in
               ([("single", 1)] if "single" in a.strategies else [])
               + [(s, n) for n in a.nproc for s in a.strategies if s != "single"]
               if not (s in XLA and not xla)]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    failed: list[str] = []
    for r in range(a.repeats):
        k = r % len(configs)
        for model, strategy, nproc in configs[k:] + configs[:k]:  # rotated: each round starts elsewhere
            tmp = out / f".{model}{strategy}{nproc}.json"
            if strategy in XLA:
                row = _run_xla(xla, model, "seed", nproc, a.steps, a.warmup, tmp, strategy, a.dtype)
            else:
                try:
                    env = {"fsdpv2-unbound": {"TORCHSPMD_BIND_CORES": "0"},
                           "fsdpv2-accelerator": {"TORCHSPMD_ACCELERATOR_PATH": "1"}}.get(strategy, {})
                    row = run_worker(__file__, ["--worker", strategy, "--models", model, "--size", "seed", *common],
                                     nproc, tmp, env=env)
                except subprocess.CalledProcessError as e:  # said in the results, not hidden, not fatal
                    print(f"round {r + 1}/{a.repeats}: {model} {strategy} x{nproc} failed (exit {e.returncode})",
                          flush=True)
                    failed.append(f"{model} {strategy} x{nproc}, round {r + 1} (exit {e.returncode})")
                    row = None
            runs[(model, strategy, nproc)].append(row)
            if row is not None:
                print(f"round {r + 1}/{a.repeats}: {model} {strategy} x{nproc} {row['tokens_per_s']:.0f} tok/s",
                      flush=True)
    results: dict[str, list[dict]] = {}
    for (model, strategy, nproc), rs in runs.items():
        done = [x for x in rs if x is not None]
        if not done:
            continue

        def per_round(base: str) -> list[float]:
            other = runs.get((model, base, nproc), [])
            return [x["tokens_per_s"] / o["tokens_per_s"] for x, o in zip(rs, other) if x is not None and o is not None]

        tps = [x["tokens_per_s"] for x in done]
        row = {"strategy": strategy, "nproc": nproc, "model": model, "tokens_per_s": statistics.median(tps),
               "tokens_per_s_runs": tps, "peak_rss_gb": statistics.median(x["peak_rss_gb"] for x in done),
               "peak_pss_gb_runs": [x["peak_pss_gb"] for x in done if "peak_pss_gb" in x],
               "state_gb": done[0]["state_gb"], "vs_fsdp2_runs": per_round("fsdp2") if nproc > 1 else [],
               "vs_xla_runs": per_round("xla") if strategy.startswith("fsdpv2") and nproc > 1 else [],
               "vs_unbound_runs": per_round("fsdpv2-unbound") if strategy == "fsdpv2" else [],
               "vs_accelerator_runs": per_round("fsdpv2-accelerator") if strategy == "fsdpv2" else []}
        row["vs_fsdp2"] = statistics.median(row["vs_fsdp2_runs"]) if row["vs_fsdp2_runs"] else None
        if row["peak_pss_gb_runs"]:
            row["peak_pss_gb"] = statistics.median(row["peak_pss_gb_runs"])
        for key in CPU_KEYS:  # rank 0's CPU use per timed step (all of torch_xla's one process)
            if all(key in x for x in done):
                row[key] = statistics.median(x[key] for x in done)
        if all("cpu_user_s" in x for x in done):  # all the run's processes (they are alike): rank 0's x processes
            per = 1 if strategy in XLA else nproc
            row["cpu_s_runs"] = [(x["cpu_user_s"] + x["cpu_sys_s"]) * per for x in done]
            row["cpu_s_rounds"] = [None if x is None else (x["cpu_user_s"] + x["cpu_sys_s"]) * per for x in rs]
            # the CPU time over the wall time of the same steps (older results: the median step's)
            row["utilisation_runs"] = [(x["cpu_user_s"] + x["cpu_sys_s"]) * per
                                       / x.get("cpu_wall_s", BATCH * SEQ / x["tokens_per_s"])
                                       / (os.cpu_count() or 1) for x in done]
        results.setdefault(model, []).append(row)
    scaling = []
    if not a.no_scaling:
        for size in ("small", "seed"):
            for nproc in (1, 2, 4):
                reuse = next((r for r in results.get("seed", []) if size == "seed" and r["strategy"] == "fsdpv2"
                              and r["nproc"] == nproc), None)
                try:
                    row = reuse or run_worker(__file__, ["--worker", "fsdpv2", "--models", "seed", "--size", size,
                                                         *common], nproc, out / f".scale{size}{nproc}.json")
                except subprocess.CalledProcessError as e:
                    failed.append(f"scaling {size} x{nproc} (exit {e.returncode})")
                    continue
                scaling.append({**row, "size": size, "nproc": nproc})
    stem = _stem(a.dtype)
    machine = provenance()
    if a.update and (out / f"{stem}.json").exists():
        old = json.loads((out / f"{stem}.json").read_text())
        first = (old.get("machine") or "machine not recorded").split(" Rows not marked *: ")[-1]
        machine += f" Rows not marked *: {first}"  # those of the first run
        for model, rows in results.items():
            new = {(r["strategy"], r["nproc"]) for r in rows}
            kept = [r for r in old["results"].get(model, []) if (r["strategy"], r["nproc"]) not in new]
            order = {(s, n): i for i, (s, n) in enumerate([("single", 1)] + [(s, n) for n in (2, 4) for s in STRATEGIES])}
            old["results"][model] = sorted(kept + rows, key=lambda r: order.get((r["strategy"], r["nproc"]), 99))
        results = old["results"]
        scaling = scaling or old.get("scaling", [])
        for model, rows in results.items():
            for r in rows:
                r.setdefault("run", old.get("run", 1))
                if (model, r["strategy"], r["nproc"]) in runs:
                    r["run"] = old.get("run", 1) + 1
    _write(out, results, scaling, failed, a.steps, a.warmup, a.repeats, " ".join(["python bench/suite.py", *sys.argv[1:]]),
           a.dtype, machine)


def _stem(dtype: str) -> str:
    return "suite" if dtype == "fp32" else f"suite_{dtype}"


def _write(out: Path, results: dict, scaling: list, failed: list, steps: int, warmup: int, repeats: int,
           command: str, dtype: str = "fp32", machine: str | None = None) -> None:
    """The tables (suite.md), suite.json and suite.png of these results under ``out``
    (suite_bf16.* for ``dtype="bf16"``); no other file is written. ``machine``: the
    ``Machine:`` line of the run (default: :func:`provenance`, this run's)."""
    import torch

    stem = _stem(dtype)
    machine = machine or provenance()
    lines = ["## Benchmarks" + (" in bf16" if dtype == "bf16" else ""), "", machine, "",
             f"`{command}` on this machine: {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, gloo; global batch {BATCH} x {SEQ} tokens, Adam (PyTorch's fused CPU kernel; torch_xla's runs "
             f"compile theirs into the step), one FSDP unit per decoder layer; every process with the malloc settings "
             f"`torchspmd run` gives its workers (docs/performance.md); each run's tokens/s is the median of its {steps - warmup} timed steps; {repeats} runs of each "
             f"configuration, interleaved (rotated order each round). The processes share the cores (OMP threads = "
             f"cores / processes); single runs on this shared machine swing by up to 2x: read the ranges."
             + (" bf16: every strategy runs its forward and loss under bf16 autocast (`torch.autocast('cpu')`, "
                "`torch.autocast('xla')` for torch_xla's runs, whose Llama then uses transformers' eager attention: "
                "its SDPA fails under XLA's autocast) over fp32 parameters, gradients and Adam state"
                + ("; but FSDPv2 with `mixed_precision='bf16'`, which gathers each unit's parameters in bf16 and "
                   "computes its forward and backward in bf16 without autocast (fp32 shards, gradient reduction and "
                   "Adam state, its outputs returned in fp32)"
                   if any(r["strategy"] == "fsdpv2-mp" for rows in results.values() for r in rows) else "") + "."
                if dtype == "bf16" else ""), ""]
    later = sorted({r["run"] for rows in results.values() for r in rows if r.get("run", 1) > 1})
    if later:
        lines += ["Rows marked * come from a later run of the same command with `--update` (those strategies "
                  "again, interleaved with each other the same way); ratios are always taken within one run.", ""]
    for model, rows in results.items():
        title = {"seed": "Seed decoder, 107M parameters", "llama": "transformers Llama, same shape"}[model]
        lines += _table(rows, title)
    if failed:
        lines += ["Runs that failed (left out of the medians and ranges above): " + "; ".join(failed) + ".", ""]
    if scaling:
        lines += ["### Scaling: torchspmd FSDPv2 against the device count", "",
                  "| model | processes | tokens/s | peak RSS per process (GB) | model state per process (GB) |",
                  "|---|---|---|---|---|"]
        for r in scaling:
            lines.append(f"| {r['size']} | {r['nproc']} | {r['tokens_per_s']:.0f} | {r['peak_rss_gb']:.2f} | "
                         f"{r['state_gb']:.3f} |")
        lines.append("")
    text = "\n".join(lines)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine, "results": results, "scaling": scaling,
                                                  "repeats": repeats,
                                                  "steps": steps, "warmup": warmup, "failed": failed,
                                                  "command": command, "run": max([1, *later]), "dtype": dtype},
                                                 indent=1))
    _plot(results, scaling, out / f"{stem}.png")
    print(text)


if __name__ == "__main__":
    main()
