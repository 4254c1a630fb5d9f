"""Where the data-parallel forms' steps differ: each phase of a step, DDP against torchspmd.

    python bench/dp_phases.py [--family seed] [--repeats 3] [--nproc 2 4] [--out bench/results]

A model family of ``bench/data_parallel.py`` (``--family``, default the seed decoder) with its
global batch and Adam, on ``--nproc`` processes: DDP (each process reads its own
rows), ``ts.replicate`` and Pattern 1 as written (global batches from ``MpDeviceLoader``,
the global loss). Rank 0 times each phase of each step with ``time.perf_counter``: the next
batch, forward, loss, backward, optimizer step + ``zero_grad``, ``loss.item()``; the median
over the steps after 5 warm-up steps. The strategies run interleaved, ``--repeats`` rounds;
writes ``dp_phases.md`` / ``dp_phases.json`` (median and min-max of the rounds, in ms; with
another family, ``dp_phases_<family>.md`` / ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PHASES = ("batch", "forward", "loss", "backward", "optimizer", "item")
STRATEGIES = ("ddp", "replicate", "pattern1")


def worker(family: str, strategy: str, result: str, steps: int = 40, warmup: int = 5) -> None:
    import data_parallel as dp
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    model, vocab = dp.build_model(family)
    data = dp.family_batches(family, vocab, steps)
    batch = dp.FAMILIES[family][1]
    if strategy == "ddp":
        from _common import per_process_loader

        _, _, loader = per_process_loader(data, batch)
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        import torchspmd as ts

        ts.use_spmd()
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        if strategy == "replicate":
            model = ts.replicate(model, mesh)
        loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=batch), ts.device(),
                                   input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    batches = iter(loader)
    for step in range(steps):
        t = [time.perf_counter()]
        x, y = next(batches)
        t.append(time.perf_counter())
        out = model(x)
        out = out if hasattr(out, "reshape") else out["logits"]  # a transformers model returns an output object
        t.append(time.perf_counter())
        loss = F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        t.append(time.perf_counter())
        loss.item()
        t.append(time.perf_counter())
        if step >= warmup:
            for i, p in enumerate(PHASES):
                times[p].append((t[i + 1] - t[i]) * 1e3)
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps({p: statistics.median(v) for p, v in times.items()}))


def _run(family: str, strategy: str, nproc: int) -> dict:
    result = HERE / f".dp_phases_{os.getpid()}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(nproc), __file__, "--worker",
                    strategy, "--family", family, "--result", str(result)], env=env, check=True, capture_output=True, text=True)
    row = json.loads(result.read_text())
    result.unlink()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--family", default="seed")
    p.add_argument("--worker", choices=STRATEGIES)
    p.add_argument("--result")
    args = p.parse_args()
    if args.worker:
        return worker(args.family, args.worker, args.result)
    import torch

    configs = [(s, n) for n in args.nproc for s in STRATEGIES]
    runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):
        k = r % len(configs)
        for s, n in configs[k:] + configs[:k]:  # a rotating order: each round starts elsewhere
            runs[(s, n)].append(_run(args.family, s, n))
            print(f"round {r + 1}/{args.repeats}: {s} x{n} "
                  f"{json.dumps({k: round(v, 1) for k, v in runs[(s, n)][-1].items()})}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "dp_phases" if args.family == "seed" else f"dp_phases_{args.family}"
    from _common import provenance, with_machine

    machine = provenance()
    (out / f"{stem}.json").write_text(json.dumps(with_machine(
        [{"strategy": s, "nproc": n, "runs": rs} for (s, n), rs in runs.items()], machine), indent=1))

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    nprocs = " ".join(str(n) for n in args.nproc)
    lines = ["# The phases of a data-parallel step", "", machine, "",
             f"`python bench/dp_phases.py --family {args.family} --repeats {args.repeats} --nproc {nprocs}` on this machine "
             f"({os.cpu_count()} cores, torch {torch.__version__}): rank 0's milliseconds per phase, median over "
             f"35 steps; median (min-max) of {args.repeats} interleaved runs.", "",
             "| strategy | processes | " + " | ".join(PHASES) + " | sum |", "|---|---|" + "---|" * (len(PHASES) + 1)]
    for (s, n), rs in runs.items():
        sums = [sum(run.values()) for run in rs]
        lines.append(f"| {s} | {n} | " + " | ".join(cell([run[p] for run in rs]) for p in PHASES) + f" | {cell(sums)} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
