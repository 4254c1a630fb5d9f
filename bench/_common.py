"""What the benchmarks share: the timed training loop and starting a worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def timed_steps(model, opt, loader, vocab: int, warmup: int) -> list[float]:
    """Train on every batch of ``loader``; return the seconds of each step after ``warmup``."""
    import torch.nn.functional as F

    times = []
    for step, (x, y) in enumerate(loader):
        t0 = time.perf_counter()
        out = model(x)
        logits = out if hasattr(out, "reshape") else out["logits"]  # a transformers model returns an output object
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()  # wait for the step to finish
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def per_process_loader(data, global_batch: int):
    """Join the gloo group torchrun describes; return (rank, world, a DataLoader of this
    process's rows of each global batch), as DDP and FSDP2 programs read their data."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
    return rank, world, torch.utils.data.DataLoader(data, batch_size=global_batch // world, sampler=sampler)


def write_result(result: str, strategy: str, tokens_per_step: int, times: list[float], **extra) -> None:
    """Rank 0's measurements: median tokens/s, this process's peak RSS, and ``extra``."""
    import resource
    import statistics

    Path(result).write_text(json.dumps({
        "strategy": strategy,
        "tokens_per_s": tokens_per_step / statistics.median(times),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        **extra,
    }))


def run_worker(script: str, args: list[str], nproc: int, result: Path) -> dict:
    """Run ``script --worker ...`` in ``nproc`` processes (``torchspmd run``; one plain process
    for 1) with the cores split between them; return the JSON rank 0 wrote to ``result``.
    Every run gets the malloc settings ``torchspmd run`` gives its workers (one process
    too, so that every strategy runs on the same allocator)."""
    from torchspmd._launch import _allocator_env

    cores = os.cpu_count() or 1
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // nproc)))
    env.update(_allocator_env(env))
    cmd = [script, *args, "--result", str(result)]
    if nproc == 1:
        cmd = [sys.executable, *cmd]
    else:
        cmd = [sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(nproc), *cmd]
    subprocess.run(cmd, check=True, env=env)
    row = json.loads(result.read_text())
    result.unlink()
    return row
