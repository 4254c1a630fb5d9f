"""The benchmark suite: every data-parallel strategy, on two models, at 2 and 4 processes.

    python bench/suite.py                       # everything (about 20 minutes on 2 cores)
    python bench/suite.py --models seed --nproc 2 --steps 6

Strategies, each training the same model on the same global batches (4 x 64 tokens,
Adam, one FSDP unit per decoder layer):

- ``single``: one process (all cores);
- ``ddp``: PyTorch DDP;
- ``fsdp2``: PyTorch FSDP2 (``fully_shard`` per layer and the root), its own collectives;
- ``fsdpv2``: torchspmd FSDPv2 (default ``collectives="auto"``);
- ``fsdpv2-native``: torchspmd FSDPv2 with FSDP2's own collectives (what torchspmd's
  layer costs over the engine underneath);
- ``fsdpv2-compile``: torchspmd FSDPv2 with ``compile=True``;
- ``xla``: torch_xla's FSDPv2 in one process driving n CPU devices, when a virtual
  environment with torch_xla is found (``$TORCHSPMD_XLA_PYTHON`` or
  ``~/.cache/torchspmd/xla-venv``);
- ``xla-torchspmd``: the same program written with torchspmd's API on its XLA backend
  (what torchspmd's delegation costs over torch_xla itself).

Models: ``seed``, the 107M-parameter seed decoder (vocab 3200, dim 1024, 8 layers, MLP
4096), and ``llama``, a transformers Llama of the same shape built from a config. The
scaling run trains torchspmd FSDPv2 on 1, 2 and 4 processes at two model sizes.

Tokens/s is the median of the timed steps after warm-up; peak RSS is rank 0's (the
processes are alike); model state is the bytes of parameters, gradients and optimizer
state one process holds. Writes ``bench/results/suite.md``, ``suite.json`` and
``suite.png``, and the table into README.md between its bench markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import per_process_loader, run_worker, timed_steps, write_result  # noqa: E402

SEED = dict(vocab_size=3200, dim=1024, num_layers=8, num_heads=8, intermediate_size=4096, max_seq_len=64)
SMALL = dict(vocab_size=3200, dim=384, num_layers=4, num_heads=6, intermediate_size=1536, max_seq_len=64)
BATCH, SEQ = 4, 64
STRATEGIES = ["single", "ddp", "fsdp2", "fsdpv2", "fsdpv2-native", "fsdpv2-compile", "xla", "xla-torchspmd"]
XLA = ("xla", "xla-torchspmd")
NAMES = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2 fully_shard", "fsdpv2": "torchspmd FSDPv2",
         "fsdpv2-native": "torchspmd FSDPv2, FSDP2's collectives", "fsdpv2-compile": "torchspmd FSDPv2, compile",
         "xla": "torch_xla FSDPv2 (one process)", "xla-torchspmd": "torchspmd FSDPv2 on the XLA backend (one process)"}


def _xla_python() -> str | None:
    cand = os.environ.get("TORCHSPMD_XLA_PYTHON") or str(Path.home() / ".cache/torchspmd/xla-venv/bin/python")
    return cand if Path(cand).exists() else None


def _build(model: str, size: str):
    import torch

    torch.manual_seed(0)
    cfg = SEED if size == "seed" else SMALL
    if model == "seed":
        from torchspmd.models import DecoderLayer, DecoderModel

        return DecoderModel(**cfg), DecoderLayer, cfg["vocab_size"]
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["dim"], intermediate_size=cfg["intermediate_size"],
                         num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_heads"],
                         num_key_value_heads=cfg["num_heads"], max_position_embeddings=SEQ, use_cache=False)
    return LlamaForCausalLM(config), LlamaDecoderLayer, cfg["vocab_size"]


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


def worker(strategy: str, model_name: str, size: str, steps: int, warmup: int, result: str) -> None:
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
        options = {"fsdpv2": {}, "fsdpv2-native": {"collectives": "native"}, "fsdpv2-compile": {"compile": True}}
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, **options[strategy])
        loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=BATCH), ts.device(),
                                   input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = timed_steps(model, opt, loader, vocab, warmup)
    if rank == 0:
        write_result(result, strategy, BATCH * SEQ, times, state_gb=_state_bytes(model, opt) / 2**30)


def xla_worker(model_name: str, size: str, steps: int, warmup: int, result: str, api: str) -> None:
    """FSDPv2 on PJRT_DEVICE=CPU devices, one process (torch_xla's venv): written with
    torch_xla's API (``api="xla"``) or with torchspmd's on its XLA backend."""
    if api == "xla-torchspmd":
        return _torchspmd_xla_worker(model_name, size, steps, warmup, result)
    import functools

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    xr.use_spmd()
    model, layer_cls, vocab = _build(model_name, size)
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
    _xla_timed(model, loader, vocab, warmup, n, result, "xla", torch_xla.step)


def _xla_timed(model, loader, vocab: int, warmup: int, n: int, result: str, strategy: str, in_step) -> None:
    """Adam steps over ``loader``, each inside ``in_step()`` (which runs its graph on leaving);
    the result is written as ``strategy``'s."""
    import time

    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    for step, (x, y) in enumerate(loader):
        t0 = time.perf_counter()
        with in_step():
            out = model(x)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        loss.item()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4 / n  # params, grads, 2 Adam moments
    write_result(result, strategy, BATCH * SEQ, times, state_gb=state / 2**30)


def _torchspmd_xla_worker(model_name: str, size: str, steps: int, warmup: int, result: str) -> None:
    """The same program written with torchspmd's API."""
    import functools

    import numpy as np
    import torch

    import torchspmd as ts

    ts.use_spmd()
    assert ts.backend() == "xla"
    model, layer_cls, vocab = _build(model_name, size)
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    model = ts.FSDPv2(model, mesh, auto_wrap_policy=policy)
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(_data(vocab, steps), batch_size=BATCH), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    _xla_timed(model, loader, vocab, warmup, n, result, "xla-torchspmd", ts.step)


def _run_xla(python: str, model: str, size: str, nproc: int, steps: int, warmup: int, result: Path,
             api: str = "xla") -> dict | None:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(nproc), PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS=str(os.cpu_count() or 1))
    r = subprocess.run([python, __file__, "--xla-worker", api, "--models", model, "--size", size, "--steps", str(steps),
                        "--warmup", str(warmup), "--result", str(result)], env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        print(f"torch_xla run failed ({model}, x{nproc}):\n{r.stderr[-2000:]}")
        return None
    row = json.loads(result.read_text())
    result.unlink()
    return row


def _table(rows: list[dict], title: str) -> list[str]:
    lines = [f"### {title}", "",
             "| strategy | processes | tokens/s | vs FSDP2 | peak RSS per process (GB) | model state per process (GB) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base = next((x["tokens_per_s"] for x in rows if x["strategy"] == "fsdp2" and x["nproc"] == r["nproc"]), None)
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        procs = f"1 ({r['nproc']} devices)" if r["strategy"] in XLA else str(r["nproc"])
        rss = f"{r['peak_rss_gb']:.2f}" + (" (all devices)" if r["strategy"] in XLA else "")
        lines.append(f"| {NAMES[r['strategy']]} | {procs} | {r['tokens_per_s']:.0f} | {ratio} | {rss} | "
                     f"{r['state_gb']:.3f} |")
    return lines + [""]


def _plot(results: dict, scaling: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results) + 1, figsize=(6 * (len(results) + 1), 4.5))
    for ax, (model, rows) in zip(axes, results.items()):
        labels = [f"{r['strategy']}\nx{r['nproc']}" for r in rows]
        ax.bar(labels, [r["tokens_per_s"] for r in rows])
        ax.set_title(f"{model}: tokens/s")
        ax.tick_params(axis="x", labelsize=7, rotation=60)
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
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-scaling", action="store_true")
    p.add_argument("--update", action="store_true",
                   help="merge this run's rows into bench/results/suite.json (same model, strategy and processes "
                        "replaced) and write the tables again")
    p.add_argument("--worker")
    p.add_argument("--xla-worker", choices=XLA)
    p.add_argument("--result")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.models[0], a.size, a.steps, a.warmup, a.result)
    if a.xla_worker:
        return xla_worker(a.models[0], a.size, a.steps, a.warmup, a.result, a.xla_worker)
    (HERE / "results").mkdir(exist_ok=True)
    xla = _xla_python()
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
    results: dict[str, list[dict]] = {}
    for model in a.models:
        rows = []
        runs = ([("single", 1)] if "single" in a.strategies else []) + [
            (s, n) for n in a.nproc for s in a.strategies if s != "single"]
        for strategy, nproc in runs:
            tmp = HERE / "results" / f".{strategy}{nproc}.json"
            if strategy in XLA:
                row = _run_xla(xla, model, "seed", nproc, a.steps, a.warmup, tmp, strategy) if xla else None
            else:
                row = run_worker(__file__, ["--worker", strategy, "--models", model, "--size", "seed", *common],
                                 nproc, tmp)
            if row is not None:
                row.update(nproc=nproc, model=model)
                rows.append(row)
                print(model, strategy, nproc, f"{row['tokens_per_s']:.0f} tok/s", flush=True)
        results[model] = rows
    scaling = []
    if not a.no_scaling:
        for size in ("small", "seed"):
            for nproc in (1, 2, 4):
                reuse = next((r for r in results.get("seed", []) if size == "seed" and r["strategy"] == "fsdpv2"
                              and r["nproc"] == nproc), None)
                row = reuse or run_worker(__file__, ["--worker", "fsdpv2", "--models", "seed", "--size", size,
                                                     *common], nproc, HERE / "results" / f".scale{size}{nproc}.json")
                scaling.append({**row, "size": size, "nproc": nproc})
    if a.update and (HERE / "results" / "suite.json").exists():
        old = json.loads((HERE / "results" / "suite.json").read_text())
        for model, rows in results.items():
            new = {(r["strategy"], r["nproc"]) for r in rows}
            kept = [r for r in old["results"].get(model, []) if (r["strategy"], r["nproc"]) not in new]
            order = {(s, n): i for i, (s, n) in enumerate([("single", 1)] + [(s, n) for n in (2, 4) for s in STRATEGIES])}
            old["results"][model] = sorted(kept + rows, key=lambda r: order.get((r["strategy"], r["nproc"]), 99))
        results = old["results"]
        scaling = scaling or old.get("scaling", [])
    import torch

    lines = ["## Benchmarks", "",
             f"`python bench/suite.py` on this machine: {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, gloo; global batch {BATCH} x {SEQ} tokens, Adam, one FSDP unit per decoder layer; "
             f"median of {a.steps - a.warmup} timed steps. The processes share the cores (OMP threads = cores / "
             f"processes); timings on a shared 2-core machine are noisy: compare ratios within one run.", ""]
    for model, rows in results.items():
        title = {"seed": "Seed decoder, 107M parameters", "llama": "transformers Llama, same shape"}[model]
        lines += _table(rows, title)
    if scaling:
        lines += ["### Scaling: torchspmd FSDPv2 against the device count", "",
                  "| model | processes | tokens/s | peak RSS per process (GB) | model state per process (GB) |",
                  "|---|---|---|---|---|"]
        for r in scaling:
            lines.append(f"| {r['size']} | {r['nproc']} | {r['tokens_per_s']:.0f} | {r['peak_rss_gb']:.2f} | "
                         f"{r['state_gb']:.3f} |")
        lines.append("")
    text = "\n".join(lines)
    (HERE / "results" / "suite.md").write_text(text)
    (HERE / "results" / "suite.json").write_text(json.dumps({"results": results, "scaling": scaling}, indent=1))
    _plot(results, scaling, HERE / "results" / "suite.png")
    readme = ROOT / "README.md"
    body = readme.read_text()
    block = "<!-- bench:start -->\n" + text.replace("## Benchmarks\n\n", "") + "\n![](bench/results/suite.png)\n<!-- bench:end -->"
    if "<!-- bench:start -->" in body:
        body = re.sub(r"<!-- bench:start -->.*?<!-- bench:end -->", lambda m: block, body, flags=re.S)
        readme.write_text(body)
    print(text)


if __name__ == "__main__":
    main()
