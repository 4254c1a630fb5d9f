"""What an operation costs on a tensor the program put on ``'xla'`` under ``--xla-compat``.

    python bench/xla_tensor_ops.py [--sizes 16 256 1024] [--ops 2000] [--repeats 15] [--out bench/results]

Under ``--xla-compat`` a tensor on ``'xla'`` is an ``OnXlaDevice`` (``torchspmd/compat/xla_tensors.py``),
and so is every plain tensor an operation on it returns, so that ``xs.mark_sharding`` can shard an
op's result in place. That takes a Python call per operation on such tensors. This program times,
on one core, a chain of small operations (an add, a multiply, a ``tanh``, a matrix product with a
square weight) on a ``(size, size)`` plain tensor and on the same values as an ``OnXlaDevice``,
the two interleaved (the order alternating every round), wall time. Writes ``xla_tensor_ops.md``
and ``xla_tensor_ops.json``: the median and min-max microseconds per operation, and the cost an
``OnXlaDevice`` adds per operation (median of the rounds' differences).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def measure(sizes: list[int], ops: int, repeats: int) -> dict:
    import torch

    from torchspmd.compat import xla_tensors

    torch.set_num_threads(1)
    torch.manual_seed(0)

    def chain(x, w, n) -> float:
        t0 = time.perf_counter()
        for _ in range(n // 4):
            x = torch.tanh((x + 1.0) * 0.5) @ w
        return (time.perf_counter() - t0) / (4 * (n // 4))

    out: dict = {}
    for size in sizes:
        base = torch.randn(size, size)
        w = torch.randn(size, size) / size ** 0.5
        kinds = {"plain tensor": base, "OnXlaDevice": xla_tensors.placed(None, base.clone())}
        assert type(kinds["OnXlaDevice"]).__name__ == "OnXlaDevice"
        for x in kinds.values():
            chain(x, w, 200)  # warm-up
        got = {k: [] for k in kinds}
        for r in range(repeats):
            for k in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                got[k].append(chain(kinds[k], w, ops))
        out[size] = got
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    import torch

    from _common import write_report

    got = measure(a.sizes, a.ops, a.repeats)
    lines = ["# An operation on a tensor on 'xla' under --xla-compat", "",
             f"`python bench/xla_tensor_ops.py --sizes {' '.join(map(str, a.sizes))} --ops {a.ops} --repeats "
             f"{a.repeats}` on this machine ({os.cpu_count()} cores, torch {torch.__version__}): a chain of add, "
             f"multiply, tanh and a matrix product on a (size, size) tensor, one core, wall microseconds per "
             f"operation over {a.repeats} interleaved rounds; added: the median over rounds of the OnXlaDevice's "
             f"time minus the plain tensor's.", "",
             "| size | plain tensor, us per op (median, min-max) | OnXlaDevice, us per op (median, min-max) | "
             "added per op, us |", "|---|---|---|---|"]
    rows = []
    for size, kinds in got.items():
        plain, xla = ([1e6 * t for t in kinds[k]] for k in ("plain tensor", "OnXlaDevice"))
        added = statistics.median(b - c for b, c in zip(xla, plain))
        rows.append({"size": size, "plain_us": plain, "on_xla_device_us": xla, "added_us_median": added})
        lines.append(f"| {size} | {statistics.median(plain):.1f} ({min(plain):.1f}-{max(plain):.1f}) | "
                     f"{statistics.median(xla):.1f} ({min(xla):.1f}-{max(xla):.1f}) | {added:.1f} |")
    write_report(Path(a.out), "xla_tensor_ops", lines, {"rows": rows, "ops": a.ops, "repeats": a.repeats})


if __name__ == "__main__":
    main()
