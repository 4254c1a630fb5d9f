"""How long gloo takes for FSDP2's collectives and their all-reduce forms.

    python bench/collectives.py                 # 2 and 4 processes, 8..64 MB buffers

For each buffer size (the full, unsharded bytes of one FSDP unit) it times, over the
processes: the native all-gather of one shard per process into the whole buffer, the
native reduce-scatter of the whole buffer, and torchspmd's all-reduce forms of both
and the shared-memory forms (``torchspmd/engines/native/communication/collectives.py``). Writes
``bench/results/collectives.md`` and ``.json``.
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

from _common import provenance, run_worker, with_machine  # noqa: E402

RESULTS = HERE / "results"


def worker(sizes_mb: list[int], repeat: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    from torchspmd.engines.native.communication.collectives import (
        AllReduceAllGather,
        AllReduceReduceScatter,
        SharedMemoryAllGather,
        SharedMemoryReduceScatter,
    )

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    rows = []
    for mb in sizes_mb:
        n = (mb * 2**20 // 4) // world * world
        full = torch.randn(n)
        shard = full.view(world, -1)[rank].clone()
        out = torch.empty(n)
        small = torch.empty(n // world)

        def ag_native():
            dist.all_gather_into_tensor(out, shard)

        def ag_allreduce():
            AllReduceAllGather()(out, shard, group)

        def rs_native():
            dist.reduce_scatter_tensor(small, full.clone())

        def rs_allreduce():
            AllReduceReduceScatter()(small, full.clone(), group, dist.ReduceOp.SUM)

        shm_ag, shm_rs = SharedMemoryAllGather(group), SharedMemoryReduceScatter(group)

        def ag_shm():
            buf = shm_ag.allocate((n,), dtype=torch.float32, device=torch.device("cpu"))
            buf.view(world, -1)[rank].copy_(shard)  # FSDP2's copy-in
            shm_ag(buf, buf.view(world, -1)[rank], group)
            out.copy_(buf)  # FSDP2's copy-out (into the parameters)

        def rs_shm():
            shm_rs(small, full.clone(), group, dist.ReduceOp.SUM)

        def copy_only():
            full.clone()

        row = {"mb": mb}
        for name, fn in [("all_gather", ag_native), ("all_gather_via_all_reduce", ag_allreduce),
                         ("all_gather_shm", ag_shm), ("reduce_scatter", rs_native),
                         ("reduce_scatter_via_all_reduce", rs_allreduce), ("reduce_scatter_shm", rs_shm),
                         ("clone", copy_only)]:
            times = []
            for i in range(repeat + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if i:
                    times.append(time.perf_counter() - t0)
            row[name] = statistics.median(times)
        # The clone is part of the reduce-scatter timings (the input is consumed): take it out.
        for key in ("reduce_scatter", "reduce_scatter_via_all_reduce", "reduce_scatter_shm"):
            row[key] -= row["clone"]
        rows.append(row)
    if rank == 0:
        Path(result).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mb", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result")
    a = p.parse_args()
    if a.worker:
        worker(a.mb, a.repeat, a.result)
        return
    RESULTS.mkdir(exist_ok=True)
    table = {}
    for nproc in a.nproc:
        table[nproc] = run_worker(str(Path(__file__).resolve()), ["--worker", "--mb", *map(str, a.mb), "--repeat",
                                                                 str(a.repeat)], nproc, RESULTS / ".coll.json")
    machine = provenance()
    lines = ["# gloo collectives: native vs all-reduce forms", "", machine, "",
             f"`python bench/collectives.py` on this machine ({os.cpu_count()} cores); median seconds of "
             f"{a.repeat} calls (speed-up over the native collective); buffer = the whole (unsharded) size. "
             f"The shared-memory all-gather includes FSDP2's copy-in and copy-out.", "",
             "| processes | MB | all-gather | via all-reduce | shared memory | reduce-scatter | via all-reduce | "
             "shared memory |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(r, key, base):
        return f"{r[key]:.4f} ({r[base] / r[key]:.1f}x)"

    for nproc, rows in table.items():
        for r in rows:
            lines.append(
                f"| {nproc} | {r['mb']} | {r['all_gather']:.4f} | {cell(r, 'all_gather_via_all_reduce', 'all_gather')} | "
                f"{cell(r, 'all_gather_shm', 'all_gather')} | {r['reduce_scatter']:.4f} | "
                f"{cell(r, 'reduce_scatter_via_all_reduce', 'reduce_scatter')} | "
                f"{cell(r, 'reduce_scatter_shm', 'reduce_scatter')} |")
    (RESULTS / "collectives.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "collectives.json").write_text(json.dumps(with_machine(table, machine), indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
