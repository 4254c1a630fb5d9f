"""Data parallelism on this machine: one process, DDP, ts.replicate, and Pattern 1.

    python bench/data_parallel.py [--nproc 2] [--steps 12] [--warmup 3]

Same model (the seed decoder), same global batch, same optimizer in every strategy.
Tokens/s is the median over timed steps after warm-up; memory is each process's peak
RSS. Writes bench/results/data_parallel.md and .json. Timings on a shared CPU are
noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from _common import per_process_loader, run_worker, timed_steps, write_result

HERE = Path(__file__).resolve().parent
MODEL = dict(vocab_size=3200, dim=256, num_layers=4, num_heads=4, intermediate_size=1024, max_seq_len=64)
BATCH, SEQ = 8, 64


def _batches(steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (steps * BATCH, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def worker(strategy: str, steps: int, warmup: int, result: str) -> None:
    import numpy as np
    import torch

    from torchspmd.models import DecoderModel

    torch.manual_seed(0)
    model = DecoderModel(**MODEL)
    data = _batches(steps)
    rank = 0
    if strategy == "single":
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    elif strategy == "ddp":
        rank, _, loader = per_process_loader(data, BATCH)
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        import torchspmd as ts

        ts.use_spmd()
        rank = ts.global_ordinal()
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        if strategy == "replicate":
            model = ts.replicate(model, mesh)
        loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=BATCH), ts.device(),
                                   input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = timed_steps(model, opt, loader, MODEL["vocab_size"], warmup)
    if rank == 0:
        write_result(result, strategy, BATCH * SEQ, times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--worker")
    p.add_argument("--result")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.result)
    rows = []
    cores = os.cpu_count() or 1
    for strategy in ["single", "ddp", "replicate", "pattern1"]:
        rows.append(run_worker(__file__, ["--worker", strategy, "--steps", str(args.steps), "--warmup",
                                          str(args.warmup)], 1 if strategy == "single" else args.nproc,
                               HERE / "results" / f".{strategy}.json"))
    base = next(r for r in rows if r["strategy"] == "ddp")["tokens_per_s"]
    lines = [
        "# Data parallelism: tokens/s and memory",
        "",
        f"Seed decoder {MODEL}, global batch {BATCH} x {SEQ} tokens, Adam; {args.nproc} processes "
        f"(gloo) except `single` (1 process, {cores} threads). Median of {args.steps - args.warmup} timed steps. "
        f"Machine: {platform.machine()}, {cores} cores, torch {__import__('torch').__version__}.",
        "",
        "| strategy | tokens/s | vs DDP | peak RSS per process (GB) |",
        "|---|---|---|---|",
    ]
    names = {"single": "one process", "ddp": f"DDP x{args.nproc}", "replicate": f"ts.replicate x{args.nproc}",
             "pattern1": f"Pattern 1 (no wrapper, DTensor) x{args.nproc}"}
    for r in rows:
        lines.append(f"| {names[r['strategy']]} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f} | "
                     f"{r['peak_rss_gb']:.2f} |")
    (HERE / "results" / "data_parallel.md").write_text("\n".join(lines) + "\n")
    (HERE / "results" / "data_parallel.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
