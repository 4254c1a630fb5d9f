"""Where an FSDPv2 step's CPU goes as processes are added: work or waiting.

    python bench/cpu_step.py [--repeats 3] [--nproc 2 4] [--out bench/results]

Trains the seed decoder of ``bench/suite.py`` (107M parameters, one FSDPv2 unit per layer,
fused Adam, global batch 4 x 64 tokens) on ``--nproc`` processes of this machine. Every
process measures, over its steps after 3 warm-up steps: the wall time per step, its CPU time
per step (user + system, ``getrusage``: all its threads), the barriers it passed per step
and the time it waited in them, its voluntary and involuntary context switches. The launcher
reads the machine's steal time (``/proc/stat``: time the hypervisor gave this VM's CPUs to
someone else) over the run. Per run: tokens/s, the CPU seconds of all processes per step,
the utilisation (that CPU time over wall time x cores: below 1 the cores idled, or were
stolen), barriers per step, and the steal share of the run. The process counts run
interleaved, ``--repeats`` rounds; writes ``cpu_step.md`` / ``cpu_step.json`` (median and
min-max of the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

COLUMNS = ("tokens_per_s", "cpu_s_per_step", "utilisation", "barriers_per_step", "barrier_wait_s", "steal_share")


def worker(result: str, steps: int = 10, warmup: int = 3) -> None:
    import resource

    import torch.distributed as dist
    import torch.nn.functional as F
    from _common import seed_fsdpv2
    from suite import BATCH, SEED, SEQ

    barriers = {"n": 0, "s": 0.0}
    barrier = dist.barrier

    def timed_barrier(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return barrier(*args, **kwargs)
        finally:
            barriers["s"] += time.perf_counter() - t0
            barriers["n"] += 1

    dist.barrier = timed_barrier  # the shared-memory collectives' barriers go through it
    model, loader, opt = seed_fsdpv2(steps)
    for step, (x, y) in enumerate(loader):
        if step == warmup:
            r0, w0, b0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), dict(barriers)
        loss = F.cross_entropy(model(x).reshape(-1, SEED["vocab_size"]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    r1, w1, k = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), steps - warmup
    mine = {"wall": (w1 - w0) / k, "cpu": (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / k,
            "barriers": (barriers["n"] - b0["n"]) / k, "barrier_wait": (barriers["s"] - b0["s"]) / k,
            "voluntary": (r1.ru_nvcsw - r0.ru_nvcsw) / k, "involuntary": (r1.ru_nivcsw - r0.ru_nivcsw) / k}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps({
            "tokens_per_s": BATCH * SEQ / mine["wall"],
            "cpu_s_per_step": sum(p["cpu"] for p in everyone),
            "utilisation": sum(p["cpu"] for p in everyone) / (mine["wall"] * (os.cpu_count() or 1)),
            "barriers_per_step": mine["barriers"],
            "barrier_wait_s": statistics.median(p["barrier_wait"] for p in everyone),
            "context_switches": [statistics.median(p["voluntary"] for p in everyone),
                                 statistics.median(p["involuntary"] for p in everyone)],
        }))


def _steal() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def _total() -> int:
    with open("/proc/stat") as f:
        return sum(int(v) for v in f.readline().split()[1:9])


def main() -> None:
    from _common import provenance, run_worker, with_machine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result")
    a = p.parse_args()
    if a.worker:
        return worker(a.result)
    runs: dict[int, list[dict]] = {n: [] for n in a.nproc}
    for r in range(a.repeats):
        order = a.nproc[r % len(a.nproc):] + a.nproc[:r % len(a.nproc)]
        for n in order:
            steal0, total0 = _steal(), _total()
            row = run_worker(__file__, ["--worker"], n, a.out / f".cpu_step_{n}.json")
            row["steal_share"] = (_steal() - steal0) / max(1, _total() - total0)
            runs[n].append(row)
            print(f"round {r + 1}/{a.repeats}: {n} processes {row['tokens_per_s']:.0f} tok/s, "
                  f"{row['cpu_s_per_step']:.2f} CPU-s per step, utilisation {row['utilisation']:.2f}, "
                  f"steal {row['steal_share']:.2f}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    machine = provenance()
    (a.out / "cpu_step.json").write_text(json.dumps(with_machine({str(n): v for n, v in runs.items()}, machine),
                                                    indent=1))
    lines = ["# Where an FSDPv2 step's CPU goes as processes are added", "", machine, "",
             f"`python bench/cpu_step.py --repeats {a.repeats} --nproc {' '.join(map(str, a.nproc))}` on this machine "
             f"({os.cpu_count()} cores): the seed decoder (107M), FSDPv2, 4 x 64 tokens per step, fused Adam; "
             "per run the steps after 3 warm-up steps; median (min-max) of the interleaved runs. CPU s per step: "
             "user + system time of all the processes; utilisation: that over wall time x cores; barrier wait: "
             "the median process's seconds per step inside barriers; steal: the share of the machine's CPU time "
             "the hypervisor gave elsewhere during the run.", "",
             "| processes | tokens/s | CPU s per step | utilisation | barriers per step | barrier wait (s) | steal |",
             "|---|---|---|---|---|---|---|"]
    for n, rows in runs.items():
        cells = []
        for c in COLUMNS:
            values = [r[c] for r in rows]
            digits = 0 if c == "tokens_per_s" else 2
            cells.append(f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    (a.out / "cpu_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
