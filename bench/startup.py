"""What a job pays before its first step, and whether bf16 computes faster on this CPU.

    python bench/startup.py [--repeats 3] [--out bench/results]

Writes ``startup.md`` and ``startup.json``:

- ``FSDPv2(...)`` wrapping the 107M-parameter seed decoder (one unit per layer) under
  ``torchspmd run`` at 2 and 4 processes: rank 0's seconds from the call to its return (the
  replica check of every plain parameter and buffer, FSDP2's sharding, the first import of
  whatever the launcher did not import), and the whole run's wall time;
- the replica digest (``torchspmd.engines.native.communication.replicas.digest``) of the model's 0.43 GB of parameters in
  one process, in GB/s: SHA-256 (CPU tensors) and the weighted byte sum in torch kernels
  (other devices; what CPU tensors used before);
- a [256, 1024] x [1024, 4096] matmul in float32 and bfloat16 with the cores' threads (is
  bf16 compute a way to a faster step on this CPU?).

Each measurement is repeated ``--repeats`` times; the tables give the median and min-max.
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
SEED = dict(vocab_size=3200, dim=1024, num_layers=8, num_heads=8, intermediate_size=4096, max_seq_len=64)


def _wrap_worker(result: str) -> None:
    import functools

    import numpy as np
    import torch
    import torch.distributed as dist

    import torchspmd as ts
    from torchspmd.models import DecoderLayer, DecoderModel

    ts.use_spmd()
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("fsdp",))
    torch.manual_seed(0)
    model = DecoderModel(**SEED)
    dist.barrier()
    t0 = time.perf_counter()
    ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=functools.partial(ts.transformer_auto_wrap_policy,
                                                                  transformer_layer_cls={DecoderLayer}))
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps({"wrap_s": seconds}))


def _wrap(nproc: int) -> dict:
    result = HERE / f".startup_{os.getpid()}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(nproc), __file__,
                    "--wrap-worker", str(result)], env=env, check=True, capture_output=True, text=True)
    total = time.perf_counter() - t0
    row = json.loads(result.read_text())
    result.unlink()
    return {**row, "run_s": total}


def _digest() -> dict:
    """GB/s of the CPU digest (SHA-256) and of the kernel form other devices use (the CPU's
    form until this change), on the same parameters."""
    import torch

    from torchspmd.engines.native.communication.replicas import _weighted_byte_sum, digest
    from torchspmd.models import DecoderModel

    torch.manual_seed(0)
    params = [p.detach().reshape(-1) for p in DecoderModel(**SEED).parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    out = {}
    for name, fn in (("sha256", digest), ("kernel", lambda p: _weighted_byte_sum(p.view(torch.uint8)))):
        t0 = time.perf_counter()
        for p in params:
            fn(p)
        out[name] = nbytes / (time.perf_counter() - t0) / 1e9
    return out


def _matmul() -> dict:
    import torch

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 1024, dtype=dtype), torch.randn(1024, 4096, dtype=dtype)
        for _ in range(3):
            a @ b
        t0 = time.perf_counter()
        for _ in range(30):
            a @ b
        out[str(dtype).replace("torch.", "")] = (time.perf_counter() - t0) / 30 * 1e3
    return out


def _span(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--wrap-worker", metavar="RESULT")
    args = p.parse_args()
    if args.wrap_worker:
        return _wrap_worker(args.wrap_worker)
    import torch

    runs: dict[str, list] = {"wrap_2": [], "wrap_4": [], "digest": [], "matmul": []}
    for r in range(args.repeats):  # interleaved: each round measures everything once
        for n in (2, 4):
            runs[f"wrap_{n}"].append(_wrap(n))
        runs["digest"].append(_digest())
        runs["matmul"].append(_matmul())
        print(f"round {r + 1}/{args.repeats}: {runs['wrap_2'][-1]} {runs['wrap_4'][-1]} "
              f"digest {runs['digest'][-1]} GB/s matmul {runs['matmul'][-1]}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from _common import provenance, with_machine

    machine = provenance()
    (out / "startup.json").write_text(json.dumps(with_machine(runs, machine), indent=1))
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = [f for f in ("avx512_bf16", "amx_bf16") if f" {f}" in flags]
    lines = [
        "# Before the first step; bf16 on this CPU",
        "",
        machine,
        "",
        f"`python bench/startup.py --repeats {args.repeats}` on this machine: {platform.machine()}, "
        f"{os.cpu_count()} cores ({', '.join(isa) or 'no bf16 instructions'}), torch {torch.__version__}. "
        "Median (min-max) of the runs.",
        "",
        "| measurement | median (min-max) |",
        "|---|---|",
        *[f"| `FSDPv2(...)` wrapping the seed decoder (107M), {n} processes: rank 0's seconds | "
          f"{_span([w['wrap_s'] for w in runs[f'wrap_{n}']], '.2f')} |" for n in (2, 4)],
        *[f"| the same `torchspmd run`, whole run (start, build, wrap, exit), {n} processes: seconds | "
          f"{_span([w['run_s'] for w in runs[f'wrap_{n}']], '.1f')} |" for n in (2, 4)],
        f"| replica digest of the model's parameters (0.43 GB), one process, SHA-256 (CPU tensors now): GB/s | "
        f"{_span([d['sha256'] for d in runs['digest']], '.2f')} |",
        f"| the same, the weighted byte sum in torch kernels (other devices; CPU tensors before): GB/s | "
        f"{_span([d['kernel'] for d in runs['digest']], '.3f')} |",
        *[f"| [256, 1024] x [1024, 4096] matmul, {d}, {torch.get_num_threads()} threads: ms | "
          f"{_span([m[d] for m in runs['matmul']], '.1f')} |" for d in ("float32", "bfloat16")],
        "",
    ]
    (out / "startup.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
