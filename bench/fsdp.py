"""FSDP on this machine: one process, DDP, PyTorch FSDP2, and torchspmd FSDPv2.

    python bench/fsdp.py [--nproc 2 4] [--size small|seed]

Same model, global batch and optimizer (Adam) everywhere; one FSDP unit per decoder
layer. Tokens/s is the median over timed steps after warm-up; peak RSS and the bytes of
parameters + gradients + optimizer state each process holds are measured. Writes
bench/results/fsdp.md, fsdp.json and fsdp.png. `--size seed` is the 107M-parameter seed
decoder of the performance issue (slow on a CPU); `small` (default) a 14M one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from _common import run_worker, timed_steps, write_result

HERE = Path(__file__).resolve().parent
SIZES = {
    "small": dict(vocab_size=3200, dim=384, num_layers=4, num_heads=6, intermediate_size=1536, max_seq_len=64),
    "seed": dict(vocab_size=3200, dim=1024, num_layers=8, num_heads=8, intermediate_size=4096, max_seq_len=64),
}
BATCH, SEQ = 4, 64


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


def worker(strategy: str, size: str, steps: int, warmup: int, result: str) -> None:
    import numpy as np
    import torch

    from torchspmd.models import DecoderLayer, DecoderModel

    cfg = SIZES[size]
    torch.manual_seed(0)
    model = DecoderModel(**cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab_size"], (steps * BATCH, SEQ + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    rank = 0
    if strategy == "single":
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    elif strategy in ("ddp", "fsdp2"):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH // world, sampler=sampler)
    else:
        import functools

        import torchspmd as ts

        ts.use_spmd()
        rank = ts.global_ordinal()
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
        policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
        loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=BATCH), ts.device(),
                                   input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = timed_steps(model, opt, loader, cfg["vocab_size"], warmup)
    if rank == 0:
        write_result(result, strategy, BATCH * SEQ, times, state_gb=_state_bytes(model, opt) / 2**30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--worker")
    p.add_argument("--result")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.size, args.steps, args.warmup, args.result)
    cores = os.cpu_count() or 1
    runs = [("single", 1)] + [(s, n) for n in args.nproc for s in ("ddp", "fsdp2", "fsdpv2")]
    rows = []
    for strategy, nproc in runs:
        row = run_worker(__file__, ["--worker", strategy, "--size", args.size, "--steps", str(args.steps),
                                    "--warmup", str(args.warmup)], nproc, HERE / "results" / f".{strategy}{nproc}.json")
        row["nproc"] = nproc
        rows.append(row)
    names = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2 fully_shard", "fsdpv2": "torchspmd FSDPv2"}
    lines = [
        "# FSDP: tokens/s and memory per process",
        "",
        f"Seed decoder {SIZES[args.size]}, global batch {BATCH} x {SEQ} tokens, Adam, one FSDP unit per decoder "
        f"layer, gloo. Median of {args.steps - args.warmup} timed steps. Machine: {platform.machine()}, {cores} "
        f"cores, torch {__import__('torch').__version__}. `python bench/fsdp.py --size {args.size}` wrote this.",
        "",
        "| strategy | processes | tokens/s | vs FSDP2 | peak RSS per process (GB) | model state per process (GB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next((x["tokens_per_s"] for x in rows if x["strategy"] == "fsdp2" and x["nproc"] == r["nproc"]), None)
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else ""
        lines.append(f"| {names[r['strategy']]} | {r['nproc']} | {r['tokens_per_s']:.0f} | {ratio} | "
                     f"{r['peak_rss_gb']:.2f} | {r['state_gb']:.3f} |")
    (HERE / "results" / "fsdp.md").write_text("\n".join(lines) + "\n")
    (HERE / "results" / "fsdp.json").write_text(json.dumps(rows, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{names[r['strategy']]}\nx{r['nproc']}" for r in rows]
    axes[0].bar(labels, [r["tokens_per_s"] for r in rows])
    axes[0].set_ylabel("tokens/s")
    axes[1].bar(labels, [r["state_gb"] for r in rows], color="tab:orange")
    axes[1].set_ylabel("model state per process (GB)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=45)
    fig.tight_layout()
    fig.savefig(HERE / "results" / "fsdp.png", dpi=100)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
