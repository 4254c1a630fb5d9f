"""Data parallelism on this machine: one process, DDP, ts.replicate, and Pattern 1.

    python bench/data_parallel.py [--nproc 2 4] [--repeats 3] [--steps 12] [--warmup 3]
                                  [--strategies ...] [--out bench/results]

Same model (the seed decoder), same global batch, same optimizer in every strategy:

- ``single``: one process, all cores;
- ``ddp``: PyTorch DDP, each process loading its own rows;
- ``replicate``: ``ts.replicate`` around the model;
- ``pattern1``: the seed's Pattern 1 as written (no wrapper, batches split by
  ``MpDeviceLoader``): torchspmd's automatic data-parallel path;
- ``pattern1-dtensor``: the same program with that path switched off
  (``TORCHSPMD_AUTO_REPLICATE=0``): every operation through DTensor.

A run's tokens/s is the median over its timed steps after warm-up; memory is rank 0's
peak RSS. Each configuration runs ``--repeats`` times, the strategies interleaved in a
rotating order within each round, so that a slow stretch of this shared machine falls
on all of them; the table gives the median and the min-max over the runs, and each
strategy's ratio to DDP per round (median, min-max, and in how many rounds it was at
least 0.95 and at least 1). Writes ``<out>/data_parallel.md`` and ``.json`` (``--out``,
default bench/results).
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

from _common import per_process_loader, run_worker, timed_steps, write_report, write_result

HERE = Path(__file__).resolve().parent
MODEL = dict(vocab_size=3200, dim=256, num_layers=4, num_heads=4, intermediate_size=1024, max_seq_len=64)
BATCH, SEQ = 8, 64


def _batches(steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (steps * BATCH, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def worker(strategy: str, steps: int, warmup: int, result: str) -> None:
    if strategy == "pattern1-dtensor":
        os.environ["TORCHSPMD_AUTO_REPLICATE"] = "0"
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


STRATEGIES = ["single", "ddp", "replicate", "pattern1", "pattern1-dtensor"]


def main() -> None:
    import statistics

    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker")
    p.add_argument("--result")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.result)
    cores = os.cpu_count() or 1
    configs = [("single", 1)] if "single" in args.strategies else []
    configs += [(s, n) for n in args.nproc for s in args.strategies if s != "single"]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):
        k = r % len(configs)
        for strategy, nproc in configs[k:] + configs[:k]:  # a rotating order: each round starts elsewhere
            row = run_worker(__file__, ["--worker", strategy, "--steps", str(args.steps), "--warmup",
                                        str(args.warmup)], nproc, args.out / f".{strategy}{nproc}.json")
            runs[(strategy, nproc)].append(row)
            print(f"round {r + 1}/{args.repeats}: {strategy} x{nproc} {row['tokens_per_s']:.0f} tok/s", flush=True)
    names = {"single": "one process", "ddp": "DDP", "replicate": "ts.replicate",
             "pattern1": "Pattern 1 as written (automatic path)",
             "pattern1-dtensor": "Pattern 1, automatic path off (DTensor)"}
    lines = [
        "# Data parallelism: tokens/s and memory",
        "",
        f"`python bench/data_parallel.py --repeats {args.repeats} --steps {args.steps} --warmup {args.warmup} "
        f"--nproc {' '.join(map(str, args.nproc))} --strategies {' '.join(args.strategies)}"
        f"{'' if args.out == HERE / 'results' else f' --out {args.out}'}`: seed decoder {MODEL}, global batch {BATCH} x "
        f"{SEQ} tokens, Adam; gloo processes (OMP threads = cores / processes) except `one process` (1 process, "
        f"{cores} threads). Each run: median of {args.steps - args.warmup} timed steps; {args.repeats} runs of each "
        f"configuration, interleaved. Machine: {platform.machine()}, {cores} cores, torch "
        f"{__import__('torch').__version__}.",
        "",
        "| strategy | processes | tokens/s, median of runs | min-max of runs | vs DDP, median of rounds | "
        "min-max of rounds | rounds >= 0.95 / >= 1 | peak RSS per process (GB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for (strategy, nproc), rs in runs.items():
        tps = [x["tokens_per_s"] for x in rs]
        ddp = runs.get(("ddp", nproc)) if nproc > 1 else None
        ratios = [x["tokens_per_s"] / d["tokens_per_s"] for x, d in zip(rs, ddp)] if ddp else []
        row = {"strategy": strategy, "nproc": nproc, "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
               "vs_ddp": statistics.median(ratios) if ratios else None, "vs_ddp_runs": ratios,
               "peak_rss_gb": statistics.median(x["peak_rss_gb"] for x in rs)}
        rows.append(row)
        vs = f"{row['vs_ddp']:.2f}" if ratios else ""
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
        count = (f"{sum(x >= 0.95 for x in ratios)} / {sum(x >= 1 for x in ratios)} of {len(ratios)}"
                 if ratios and strategy != "ddp" else "")
        lines.append(f"| {names[strategy]} | {nproc} | {row['tokens_per_s']:.0f} | {min(tps):.0f}-{max(tps):.0f} | "
                     f"{vs} | {spread} | {count} | {row['peak_rss_gb']:.2f} |")
    write_report(args.out, "data_parallel", lines, rows)


if __name__ == "__main__":
    main()
