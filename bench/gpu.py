"""One GPU, under 8 minutes: the CUDA path checked, then measured.

    python bench/gpu.py                                   # on a machine with a CUDA GPU
    python bench/gpu.py --device cpu --tiny --out /tmp/g  # the same program, tiny, on CPU

1. **Check** (a small transformers Llama, 4 steps of AdamW on the same batches, world
   size 1, each run in a process of its own): plain PyTorch, the seed's Pattern 1
   (``use_spmd`` + ``MpDeviceLoader``, no wrapper) and torchspmd FSDPv2 (one unit per
   decoder layer), in ``--check-dtype`` (bf16 by default; float32 for a tight check).
   The torchspmd runs' losses must equal plain PyTorch's within the stated tolerance.
2. **Measure** (a ~1.1B Llama, TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4
   key-value heads, MLP 5632, vocabulary 32000; bf16 parameters, AdamW, ``--batch``
   sequences of ``--seq`` tokens): tokens/s (median of the timed steps after warm-up),
   model FLOPs utilisation and peak memory (``torch.cuda.max_memory_allocated``) of
   plain PyTorch, plain PyTorch + ``torch.compile``, torchspmd FSDPv2 and FSDPv2 with
   ``compile=True``. MFU counts 6 x parameters + 12 x layers x hidden x sequence FLOPs per
   token (PaLM's formula, attention included) against the device's dense bf16 peak
   (a table of known devices, or ``--peak-tflops``).

3. **Stages** (on a machine with 2 or more GPUs, ``--stages-procs`` of them, default all;
   on CPU only when ``--stages-procs`` is given): the check's Llama in float32, ``--steps``
   AdamW steps on the same global batches, in ``torchspmd run --nproc N`` processes: FSDPv2
   over the N devices against ``ts.pipeline`` with N stages (1F1B, 2N micro-batches of a
   global batch of ``max(--batch, 2N)`` rows). The pipeline's losses must equal FSDPv2's
   (float32 rtol); tokens/s (median of the timed steps after warm-up) and the largest
   peak memory of any process are reported.

Writes ``<out>/gpu.md`` and ``gpu.json`` (default ``bench/results``). A configuration
that would run past ``--budget-s`` is skipped and listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

MEASURE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4)
CHECK = dict(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4)
TINY = dict(vocab_size=257, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
STRATEGIES = ["plain", "plain-compile", "fsdpv2", "fsdpv2-compile"]
STAGES = ["stages-fsdpv2", "stages-pipeline"]
CHECKED = ["plain", "pattern1", "fsdpv2"]
NAMES = {"plain": "plain PyTorch", "plain-compile": "plain PyTorch + torch.compile", "fsdpv2": "torchspmd FSDPv2",
         "fsdpv2-compile": "torchspmd FSDPv2, compile=True", "pattern1": "Pattern 1 (no wrapper)",
         "stages-fsdpv2": "FSDPv2 over the N devices", "stages-pipeline": "ts.pipeline, N stages (1f1b)"}
# Dense bf16 peak FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
             "A10G": 70e12, "RTX 4090": 165e12, "B200": 2250e12}
CHECK_RTOL = {"bfloat16": 2e-2, "float32": 1e-5}


def _model(shape: dict, seq: int, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(dtype), LlamaDecoderLayer


def _batches(vocab: int, steps: int, batch: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (steps * batch, seq + 1), generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batch_size=batch)


def stages_worker(a) -> None:
    """One of ``torchspmd run --nproc N``'s processes: FSDPv2 over the N devices, or N
    pipeline stages; rank 0 writes the result."""
    import functools

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import torchspmd as ts

    ts.use_spmd(backend=a.device)
    n = ts.global_runtime_device_count()
    model, layer_cls = _model(TINY if a.tiny else CHECK, a.seq, torch.float32)
    model = model.to(ts.device())
    vocab = model.config.vocab_size
    batches = [(x.to(ts.device()), y.to(ts.device())) for x, y in _batches(vocab, a.steps, a.batch, a.seq)]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))

    if a.strategy == "stages-pipeline":
        runner = ts.pipeline(model, ts.Mesh(np.arange(n), (n,), ("pipeline",)), split=layer_cls,
                             microbatches=2 * n, example_inputs=batches[0][0])
        params = list(runner.parameters())

        def step(x, y):
            return runner.step(x, y, loss_fn)
    else:
        mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
        policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
        spec = ts.ShardingSpec(mesh, ("fsdp", None))
        params = list(model.parameters())

        def step(x, y):
            loss = loss_fn(model(input_ids=ts.shard_batch(x, spec)).logits, ts.shard_batch(y, spec))
            loss.backward()
            return loss
    opt = torch.optim.AdamW(params, lr=1e-3)
    cuda = ts.device().type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        loss = step(x, y)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else -1.0], device=ts.device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if ts.global_ordinal() == 0:
        Path(a.result).write_text(json.dumps({
            "strategy": a.strategy, "losses": losses, "processes": n,
            "tokens_per_s": a.batch * a.seq / statistics.median(times) if times else None,
            "peak_mem_gb": float(peak) if cuda else None,
            "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()}))


def worker(a) -> None:
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, a.dtype)
    shape = TINY if a.tiny else (CHECK if a.phase == "check" else MEASURE)
    model, layer_cls = _model(shape, a.seq, dtype)
    loader = _batches(shape["vocab_size"], a.steps, a.batch, a.seq)
    device = torch.device(a.device)
    if a.strategy.startswith("plain"):
        model = model.to(device)
        if a.strategy == "plain-compile":
            model = torch.compile(model)
        batches = ((x.to(device), y.to(device)) for x, y in loader)
    else:
        import functools

        import numpy as np

        import torchspmd as ts

        ts.use_spmd(backend=a.device)
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
        model = model.to(ts.device())
        if a.strategy.startswith("fsdpv2"):
            policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
            model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, compile=a.strategy == "fsdpv2-compile")
        batches = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4 if a.phase == "measure" else 1e-3)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # waits for the step
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    if hasattr(next(model.parameters()), "full_tensor"):  # FSDPv2 at world size 1 holds everything anyway
        params = sum(p.full_tensor().numel() if hasattr(p, "full_tensor") else p.numel() for p in model.parameters())
    Path(a.result).write_text(json.dumps({
        "strategy": a.strategy, "losses": losses, "params": params,
        "tokens_per_s": a.batch * a.seq / statistics.median(times) if times else None,
        "step_s_runs": times,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
    }))


def _launch(a, strategy: str, phase: str, dtype: str, steps: int, batch: int, seq: int, timeout: float,
            procs: int = 0):
    out = Path(a.out) / f".{phase}-{strategy}.json"
    run = [sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(procs)] if procs else [sys.executable]
    cmd = [*run, __file__, "--worker", strategy, "--phase", phase, "--dtype", dtype, "--device", a.device,
           "--steps", str(steps), "--warmup", str(a.warmup if phase == "measure" else 0), "--batch", str(batch),
           "--seq", str(seq), "--result", str(out)] + (["--tiny"] if a.tiny else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    if procs and a.device == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // procs))
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"strategy": strategy, "error": f"stopped after {timeout:.0f} s (the budget)"}
    if r.returncode != 0:
        return {"strategy": strategy, "error": ((r.stderr or r.stdout).strip().splitlines() or ["no output"])[-1][:300]}
    row = json.loads(out.read_text())
    out.unlink()
    return row


def _gb(r: dict) -> str:
    return f"{r['peak_mem_gb']:.2f}" if r["peak_mem_gb"] is not None else "n/a"


def _table_row(name: str, r: dict, cells, width: int) -> str:
    """A result's table row: its name, tokens/s and the ``width`` cells ``cells(r)``; or its
    error and ``width`` blank cells."""
    if r.get("error"):
        return f"| {name} | {r['error']} |" + " |" * width
    return f"| {name} | {r['tokens_per_s']:.0f} | " + " | ".join(cells(r)) + " |"


def _peak_flops(name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    return next((v for k, v in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny models for both phases (a smoke run of this script)")
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--check-dtype", default="bfloat16", choices=list(CHECK_RTOL))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=450)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, if not in the table")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--worker")
    p.add_argument("--phase", default="measure")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--stages-procs", type=int, default=None,
                   help="processes (devices) of the stages comparison; default: every GPU when there are 2 or more "
                        "(none on CPU)")
    p.add_argument("--result")
    a = p.parse_args()
    if a.worker:
        a.strategy = a.worker
        return stages_worker(a) if a.worker in STAGES else worker(a)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench/gpu.py: no CUDA device here; run it on a GPU machine (or --device cpu --tiny for a smoke run)")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    left = lambda: a.budget_s - (time.monotonic() - start)  # noqa: E731

    # 1. The check.
    check_seq = 32 if a.tiny else 256
    check = {s: _launch(a, s, "check", a.check_dtype, 4, 4, check_seq, left()) for s in CHECKED}
    ref = check["plain"].get("losses")
    rtol = CHECK_RTOL[a.check_dtype]
    verdicts = {}
    for s in CHECKED[1:]:
        losses = check[s].get("losses")
        if ref is None or losses is None:
            verdicts[s] = ("error", check[s].get("error") or check["plain"].get("error"))
            continue
        rel = max(abs(x - r) / abs(r) for x, r in zip(losses, ref))
        verdicts[s] = ("pass" if rel <= rtol and len(losses) == len(ref) else "FAIL", f"max relative loss difference {rel:.2e}")

    # 2. The measurements.
    rows = []
    if not a.check_only:
        for s in a.strategies:
            if left() < 30:
                rows.append({"strategy": s, "error": "skipped: the time budget was spent"})
                continue
            rows.append(_launch(a, s, "measure", "bfloat16", a.steps, a.batch, 64 if a.tiny else a.seq, left()))
    # 3. Stages: FSDPv2 over N devices against N pipeline stages.
    procs = a.stages_procs
    if procs is None:
        import torch

        procs = torch.cuda.device_count() if a.device == "cuda" and torch.cuda.device_count() >= 2 else 0
    stages, stage_verdict = [], None
    if procs >= 2:
        stage_batch, stage_seq = max(a.batch, 2 * procs), 32 if a.tiny else 256
        for s in STAGES:
            if left() < 30:
                stages.append({"strategy": s, "error": "skipped: the time budget was spent"})
                continue
            stages.append(_launch(a, s, "stages", "float32", max(a.steps, a.warmup + 2), stage_batch, stage_seq,
                                  left(), procs))
        got = [r.get("losses") for r in stages]
        if None in got:
            stage_verdict = ("error", next(r.get("error") for r in stages if r.get("error")))
        else:
            rel = max(abs(x - r) / abs(r) for x, r in zip(got[1], got[0]))
            stage_verdict = ("pass" if rel <= CHECK_RTOL["float32"] and len(got[0]) == len(got[1]) else "FAIL",
                             f"max relative loss difference {rel:.2e}")
        verdicts["stages-pipeline"] = stage_verdict
    device_name = next((r["device_name"] for r in [*check.values(), *rows] if r.get("device_name")), "?")
    peak = _peak_flops(device_name, a.peak_tflops)
    shape = TINY if a.tiny else MEASURE
    seq = 64 if a.tiny else a.seq
    from _common import provenance

    machine = provenance()
    lines = [
        "# One GPU: the CUDA path checked and measured", "", machine, "",
        f"`python bench/gpu.py{' --device cpu --tiny' if a.tiny else ''}` on {device_name} ({a.device}), "
        f"torch {__import__('torch').__version__}; {time.monotonic() - start:.0f} s in all.", "",
        f"## Check: world size 1, {a.check_dtype}, 4 steps, losses against plain PyTorch (rtol {rtol:g})", "",
        "| program | result | detail |", "|---|---|---|"]
    for s, (verdict, detail) in verdicts.items():
        lines.append(f"| {NAMES[s].replace('N', str(procs))} | {verdict} | {detail} |")
    if rows:
        lines += ["", f"## Measure: Llama {shape}, bf16, AdamW, {a.batch} x {seq} tokens per step, median of "
                      f"{a.steps - a.warmup} timed steps after {a.warmup} warm-up", "",
                  "| strategy | tokens/s | MFU | peak memory (GB) | parameters |", "|---|---|---|---|---|"]
        for r in rows:
            if not r.get("error"):
                layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
                flops_per_token = 6 * r["params"] + 12 * layers * hidden * seq
                r["mfu"] = flops_per_token * r["tokens_per_s"] / peak if peak else None
            lines.append(_table_row(NAMES[r["strategy"]], r, lambda r: [
                f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (peak unknown)", _gb(r),
                f"{r['params'] / 1e6:.1f}M"], 3))
    if stages:
        lines += ["", f"## Stages: {procs} processes, Llama {TINY if a.tiny else CHECK} in float32, global batch "
                      f"{max(a.batch, 2 * procs)} x {32 if a.tiny else 256} tokens, {2 * procs} micro-batches; losses "
                      f"against FSDPv2's (rtol {CHECK_RTOL['float32']:g}): {stage_verdict[0]}, {stage_verdict[1]}", "",
                  "| strategy | tokens/s | largest peak memory of a process (GB) |", "|---|---|---|"]
        for r in stages:
            lines.append(_table_row(NAMES[r["strategy"]].replace("N", str(procs)), r, lambda r: [_gb(r)], 1))
    elif a.device == "cuda":
        lines += ["", "## Stages: skipped (one GPU here; they need 2 or more)"]
    text = "\n".join(lines) + "\n"
    (Path(a.out) / "gpu.md").write_text(text)
    (Path(a.out) / "gpu.json").write_text(json.dumps({"machine": machine, "check": check, "verdicts": verdicts,
                                                       "measure": rows,
                                                       "stages": stages, "peak_flops": peak}, indent=1))
    print(text)
    if any(v[0] != "pass" for v in verdicts.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
