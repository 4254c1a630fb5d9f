"""Where an FSDPv2 training step's time goes: the breakdown issue #15 asks for.

    python bench/profile_step.py                      # seed decoder, 2 and 4 processes
    python bench/profile_step.py --nproc 2 --steps 6

Each configuration trains bench/suite.py's seed decoder (107M parameters, one FSDPv2 unit
per layer, fused Adam, global batch 4 x 64 tokens) with torchspmd FSDPv2 on n processes sharing
this machine's cores. Rank 0 measures:

- the step's phases with ``time.perf_counter`` around them (forward with the loss,
  backward, optimizer step, ``zero_grad`` and reading the loss), median over the timed steps;
- inside one profiled step (``torch.profiler``, CPU), the self time of ATen operators split
  into matrix/attention kernels (``mm``, ``addmm``, ``bmm``, ``linear``' kernels, SDPA, ...),
  the collectives (c10d/gloo operators and the copies FSDP2 and torchspmd's shared-memory
  collectives make, counted through their ``record_function`` ranges), and every other
  ATen operator (element-wise work, copies, the optimizer's arithmetic); what is left of
  the wall time of the step is Python and dispatch (PyTorch's own code, DTensor's
  dispatch, hooks) and waiting on the other processes.

Writes ``bench/results/profile_step.md`` and ``profile_step.json``. One run per
configuration: the table says what the breakdown is, not a speed to compare (use
bench/suite.py for that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import provenance, run_worker, with_machine  # noqa: E402

RESULTS = HERE / "results"
KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product",
           "aten::_flash_attention", "aten::matmul", "aten::linear", "aten::_softmax", "aten::_log_softmax",
           "aten::embedding", "aten::native_layer_norm", "aten::gelu", "aten::mkldnn", "aten::_mkl")
# FSDP2's record_function ranges around its collectives (each name gets " (<module>)"):
# their inclusive time holds the copies in and out and the collective itself.
COMM_RANGES = {"FSDP::all_gather", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce",
               "FSDP::post_backward_rs_wait"}


def _category(name: str) -> str:
    if any(name.startswith(p) for p in ("c10d::", "gloo:", "nccl:", "record_param_comms")):
        return "collectives"
    if any(name.startswith(k) for k in KERNELS):
        return "matrix and attention kernels"
    if name.startswith("aten::"):
        return "other ATen operators"
    return ""


def worker(steps: int, warmup: int, result: str) -> None:
    import functools

    import numpy as np
    import torch
    import torch.nn.functional as F
    from suite import BATCH, SEQ, _build, _data
    from torch.profiler import ProfilerActivity, profile

    import torchspmd as ts

    ts.use_spmd()
    n = ts.global_runtime_device_count()
    model, layer_cls, vocab = _build("seed", "seed")
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)  # as bench/suite.py
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(_data(vocab, steps + 1), batch_size=BATCH), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    phases: dict[str, list[float]] = {"forward + loss": [], "backward": [], "optimizer step": [],
                                      "zero_grad + loss.item()": []}
    walls = []
    prof_wall = None
    events = None
    for step, (x, y) in enumerate(loader):
        profiling = step == steps  # the last batch: profiled, not timed
        if profiling:
            prof = profile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
        t0 = time.perf_counter()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        loss.item()
        t4 = time.perf_counter()
        if profiling:
            prof.__exit__(None, None, None)
            prof_wall = t4 - t0
            events = prof.events()
            top = prof.key_averages()
        elif step >= warmup:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k].append(v)
            walls.append(t4 - t0)
    if ts.global_ordinal() != 0:
        return
    us = {"matrix and attention kernels": 0.0, "collectives": 0.0, "other ATen operators": 0.0}
    for e in events:
        in_comm, parent = False, e
        while parent is not None:
            if parent.name.split(" (")[0] in COMM_RANGES:
                in_comm = True
                break
            parent = parent.cpu_parent
        cat = "collectives" if in_comm else _category(e.name)
        if cat:  # (a collective range's own Python time counts as collectives too)
            us[cat] += e.self_cpu_time_total
    wall_us = prof_wall * 1e6
    us["Python, dispatch, hooks and waiting"] = max(0.0, wall_us - sum(us.values()))
    Path(result).write_text(json.dumps({
        "processes": n, "tokens_per_step": BATCH * SEQ,
        "step_s_median": statistics.median(walls), "step_s_runs": walls,
        "phases_s_median": {k: statistics.median(v) for k, v in phases.items()},
        "profiled_step_s": prof_wall,
        "profiled_shares": {k: v / wall_us for k, v in us.items()},
        "top_ops": [(e.key, e.self_cpu_time_total / 1e3) for e in
                    sorted(top, key=lambda e: -e.self_cpu_time_total)[:12]],
    }))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, nargs="*", default=[2, 4])
    p.add_argument("--steps", type=int, default=8, help="training steps timed (after warm-up), then one profiled")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.steps, a.warmup, a.result)
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for n in a.nproc:
        row = run_worker(str(Path(__file__).resolve()), ["--worker", "--steps", str(a.steps), "--warmup",
                                                         str(a.warmup)], n, RESULTS / f".profile_{n}.json")
        rows.append(row)
        print(json.dumps(row["profiled_shares"]), flush=True)
    machine = provenance()
    (RESULTS / "profile_step.json").write_text(json.dumps(with_machine(rows, machine), indent=1))
    lines = [
        "# Where an FSDPv2 step's time goes",
        "",
        machine,
        "",
        f"`python bench/profile_step.py --nproc {' '.join(map(str, a.nproc))} --steps {a.steps} --warmup {a.warmup}` "
        f"on this machine: the seed decoder (107M parameters, one FSDPv2 unit per layer, fused Adam, 4 x 64 tokens per "
        f"step), torchspmd FSDPv2, n processes sharing the cores. One run per configuration (not a speed "
        f"comparison: see suite.md).",
        "",
        "Phases (median seconds over the timed steps, rank 0):",
        "",
        "| processes | step | " + " | ".join(rows[0]["phases_s_median"]) + " |",
        "|---|---|" + "---|" * len(rows[0]["phases_s_median"]),
    ]
    for r in rows:
        lines.append(f"| {r['processes']} | {r['step_s_median']:.3f} | "
                     + " | ".join(f"{v:.3f}" for v in r["phases_s_median"].values()) + " |")
    lines += ["", "One profiled step (rank 0, share of its wall time):", "",
              "| processes | profiled step (s) | " + " | ".join(rows[0]["profiled_shares"]) + " |",
              "|---|---|" + "---|" * len(rows[0]["profiled_shares"])]
    for r in rows:
        lines.append(f"| {r['processes']} | {r['profiled_step_s']:.3f} | "
                     + " | ".join(f"{100 * v:.0f}%" for v in r["profiled_shares"].values()) + " |")
    lines += ["", "Heaviest operators by self time in the profiled step (ms):", ""]
    for r in rows:
        lines.append(f"- {r['processes']} processes: " + ", ".join(f"`{k}` {v:.0f}" for k, v in r["top_ops"]))
    (RESULTS / "profile_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
