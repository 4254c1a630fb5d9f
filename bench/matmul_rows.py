"""What a row of a matrix product costs as the rows per process shrink.

    python bench/matmul_rows.py [--rows 32 64 128 256] [--repeats 30] [--out bench/results]

A data-parallel step splits the global batch's rows between the devices: the seed decoder
of ``bench/suite.py`` (global batch 4 x 64 = 256 tokens) runs its matrix products on 128
rows per process at 2 processes and 64 at 4. This program times, on one core (one thread,
this process bound to the last core), one decoder layer's products as training runs them
(forward ``x @ w.T``, input gradient ``dy @ w``, weight gradient ``dy.T @ x`` for the
fused QKV, output, MLP up and down weights: dim 1024, MLP 4096) at each row count, the row
counts interleaved (the order alternating every round), CPU time (``time.process_time``).
Writes ``matmul_rows.md`` and ``matmul_rows.json``: the median and min-max CPU ms per
layer, and per row relative to the largest row count (1.00 = as cheap per row as there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIM, MLP = 1024, 4096


def measure(rows: list[int], repeats: int) -> dict[int, list[float]]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = [torch.randn(3 * DIM, DIM), torch.randn(DIM, DIM), torch.randn(MLP, DIM), torch.randn(DIM, MLP)]

    def layer(n: int) -> float:
        xs = [torch.randn(n, w.shape[1]) for w in weights]
        dys = [torch.randn(n, w.shape[0]) for w in weights]
        t0 = time.process_time()
        for w, x, dy in zip(weights, xs, dys):
            x @ w.t()
            dy @ w
            dy.t() @ x
        return time.process_time() - t0

    for n in rows:  # warm-up
        layer(n)
    out: dict[int, list[float]] = {n: [] for n in rows}
    for r in range(repeats):
        for n in (rows if r % 2 == 0 else rows[::-1]):
            out[n].append(layer(n))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    import torch

    rows = sorted(a.rows)
    got = measure(rows, a.repeats)
    top = rows[-1]
    per_row_top = statistics.median(got[top]) / top
    from _common import provenance

    machine = provenance()
    lines = ["# A matrix product's cost per row as the rows shrink", "", machine, "",
             f"`python bench/matmul_rows.py {' '.join(['--rows', *map(str, rows), '--repeats', str(a.repeats)])}` "
             f"on this machine ({os.cpu_count()} cores, torch {torch.__version__}): one decoder layer's forward, "
             f"input-gradient and weight-gradient products (dim {DIM}, MLP {MLP}) on one core, CPU ms per layer over "
             f"{a.repeats} interleaved rounds. Per row: the median's cost per row over the cost per row at {top} rows.",
             "", "| rows | CPU ms per layer, median | min-max | cost per row vs " + f"{top} rows |", "|---|---|---|---|"]
    rows_out = []
    for n in rows:
        ms = [1e3 * t for t in got[n]]
        rel = statistics.median(got[n]) / n / per_row_top
        rows_out.append({"rows": n, "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                         "per_row_vs_top": rel, "ms_runs": ms})
        lines.append(f"| {n} | {statistics.median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} | {rel:.2f}x |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matmul_rows.md").write_text("\n".join(lines) + "\n")
    (out / "matmul_rows.json").write_text(json.dumps({"machine": machine, "rows": rows_out, "repeats": a.repeats},
                                                     indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
