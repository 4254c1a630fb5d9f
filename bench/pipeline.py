"""Pipeline stages x FSDP against FSDPv2 over all the processes, on the same cores.

    python bench/pipeline.py [--repeats 3] [--steps 8] [--warmup 2] [--microbatches 4]
                             [--strategies ...] [--out bench/results]

Four processes (``torchspmd run --nproc 4``, OMP threads = cores / 4) train the same model
(the seed decoder, small: see ``MODEL``) on the same global batches (``BATCH`` x ``SEQ``
tokens) with AdamW, three ways:

- ``fsdpv2``: ``ts.FSDPv2`` over a 1-D ``'fsdp'`` mesh of 4, one unit per ``DecoderLayer``,
  the batch's rows split over the 4 processes by ``MpDeviceLoader``;
- ``pp2xfsdp2-1f1b``: ``ts.pipeline`` over a ``('pipeline', 'fsdp')`` = (2, 2) mesh: the
  model cut into 2 stages at ``DecoderLayer`` boundaries (balanced by parameter count),
  each stage's parameters and its rows of every micro-batch split over its 2 processes by
  FSDP2's ``fully_shard`` (one unit per layer, and the stage), ``--microbatches``
  micro-batches per step, the 1F1B schedule;
- ``pp2xfsdp2-gpipe``: the same with the GPipe schedule (every forward, then every backward).

What differs besides the schedule is what ``ts.pipeline`` does today: its stages are
traced (``torch.export``) graph modules, and their FSDP2 units use FSDP2's own collectives
(gloo), where FSDPv2 plugs in torchspmd's shared-memory ones (``collectives="auto"``).
Both run the same timed loop (written here, as ``runner.step`` replaces forward and
backward): the loader's time is outside the step.

Per run: tokens/s from the median step after ``--warmup`` (a step: forward, backward,
optimizer step, the loss read back), the peak RSS of every process (the table gives the
largest over the 4 ranks) and the peak PSS of the whole run (``_common.PeakMemory``: the
launcher included, shared pages once) divided by the 4 processes, and every step's loss
(the pipelined runs must follow FSDPv2's: same model, batches and optimizer).

The bubble. For S stages and M micro-batches the schedule's ideal bubble fraction is
(S - 1) / (M + S - 1) (equal stages, free communication). Measured: in the pipelined runs
each stage's ``forward_one_chunk``, ``backward_one_chunk`` and ``perform_reduce_grad``
(FSDP's gradient reduce-scatter) and the schedule's loss computation are timed
(``time.perf_counter`` around each call, wrapped on the stage and schedule objects of
``torch.distributed.pipelining``): a process's busy time. Its bubble in one step is
``1 - busy / (the wall time of runner.step)``: the share of the pipeline part of the step
(optimizer excluded) it spent outside its stage's work, waiting for its neighbour's
activations or gradients (and the runner's own bookkeeping: splitting the batch, the
loss's broadcast). Each run gives the median over its timed steps of the mean over the 4
processes, and each stage's. On cores shared by more processes than cores, a process that
waits lends its core to the others, and the busy time is wall time (a stage descheduled
while computing counts as busy): the figure is the processes' waiting share, not an idle
share of the machine.

Each strategy runs ``--repeats`` times, the strategies interleaved in an order rotated by
one each round; the table gives the median and the min-max over the runs, and each
strategy's ratio to FSDPv2 per round (median, min-max). Writes ``<out>/pipeline.md`` and
``<out>/pipeline.json`` (``--out``, default bench/results) and nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from _common import run_worker, write_report

HERE = Path(__file__).resolve().parent
MODEL = {"vocab_size": 3200, "dim": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024,
         "max_seq_len": 64}
BATCH, SEQ = 16, 64
NPROC = 4
STAGES = 2
STRATEGIES = ["fsdpv2", "pp2xfsdp2-1f1b", "pp2xfsdp2-gpipe"]
NAMES = {"fsdpv2": "FSDPv2 over 4 ('fsdp' = 4)",
         "pp2xfsdp2-1f1b": "pipeline 2 x fsdp 2, 1F1B",
         "pp2xfsdp2-gpipe": "pipeline 2 x fsdp 2, GPipe"}


def _batches(steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (steps * BATCH, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _loss_fn(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, MODEL["vocab_size"]), targets.reshape(-1))


class _Busy:
    """Wall time spent inside the wrapped methods, summed until :meth:`take`."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, obj, name: str) -> bool:
        fn = getattr(obj, name, None)
        if fn is None:
            return False

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)  # on the instance: its class and other instances unchanged
        return True

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def worker(strategy: str, steps: int, warmup: int, microbatches: int, result: str) -> None:
    import functools
    import resource

    import numpy as np
    import torch
    import torch.distributed as dist

    import torchspmd as ts
    from torchspmd.models import DecoderLayer, DecoderModel

    ts.use_spmd()
    n = ts.global_runtime_device_count()
    torch.manual_seed(0)
    model = DecoderModel(**MODEL)
    data = _batches(steps)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    times, losses, bubbles, stage, sizes = [], [], [], None, None
    busy_s, pipe_s = [], []
    if strategy == "fsdpv2":
        mesh = ts.Mesh(np.arange(n), (n,), ("fsdp",))
        policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sharded = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
        for step, (x, y) in enumerate(sharded):
            t0 = time.perf_counter()
            loss = _loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())  # waits for the step to finish
            if step >= warmup:
                times.append(time.perf_counter() - t0)
    else:
        schedule = strategy.rsplit("-", 1)[1]
        mesh = ts.Mesh(np.arange(n), (STAGES, n // STAGES), ("pipeline", "fsdp"))
        example = data[:BATCH][0]
        runner = ts.pipeline(model, mesh, split=DecoderLayer, microbatches=microbatches, schedule=schedule,
                             example_inputs=example)
        opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)
        stage = runner.describe()["this process's stages"][0]
        sizes = runner.describe()["parameters per stage"]
        busy = _Busy()
        for st in runner.stages:  # traced when made (example_inputs)
            for name in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad"):
                if not busy.wrap(st, name):
                    raise SystemExit(f"bench/pipeline.py: torch {torch.__version__}'s pipeline stage has no {name}; "
                                     f"the bubble cannot be measured this way")
        for step, (x, y) in enumerate(loader):
            t0 = time.perf_counter()
            loss = runner.step(x, y, _loss_fn)
            t1 = time.perf_counter()
            if step == 0:  # the first step made the schedule; the loss is computed there, outside the stage
                for sched in runner.schedules:
                    busy.wrap(sched, "_maybe_compute_loss")
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            spent = busy.take()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
                if step > 0:  # step 0 ran before the loss was wrapped
                    bubbles.append(1 - spent / (t1 - t0))
                    busy_s.append(spent)
                    pipe_s.append(t1 - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    mine = {"rss": rss, "bubble": statistics.median(bubbles) if bubbles else None, "stage": stage,
            "bubble_steps": bubbles, "busy_s": statistics.median(busy_s) if busy_s else None,
            "pipe_s": statistics.median(pipe_s) if pipe_s else None}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        row = {"strategy": strategy, "tokens_per_s": BATCH * SEQ / statistics.median(times), "step_s": times,
               "losses": losses, "peak_rss_gb_ranks": [e["rss"] for e in every]}
        if stage is not None:
            per_step = [statistics.mean(s) for s in zip(*(e["bubble_steps"] for e in every))]
            row["bubble"] = statistics.median(per_step)
            by_stage = {k: [e for e in every if e["stage"] == k] for k in sorted({e["stage"] for e in every})}
            row["bubble_stages"] = {str(k): statistics.median(e["bubble"] for e in es) for k, es in by_stage.items()}
            row["busy_s_stages"] = {str(k): statistics.median(e["busy_s"] for e in es) for k, es in by_stage.items()}
            row["pipe_s_stages"] = {str(k): statistics.median(e["pipe_s"] for e in es) for k, es in by_stage.items()}
            row["parameters_per_stage"] = sizes
        Path(result).write_text(json.dumps(row))


def _formula(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def _spread(xs, fmt="{:.0f}") -> str:
    return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker")
    p.add_argument("--result")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.microbatches, args.result)
    if BATCH % (args.microbatches * (NPROC // STAGES)):
        p.error(f"--microbatches {args.microbatches}: the batch's {BATCH} rows must split into micro-batches x "
                f"{NPROC // STAGES} 'fsdp' processes")
    cores = os.cpu_count() or 1
    runs: dict[str, list[dict]] = {s: [] for s in args.strategies}
    order = list(args.strategies)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    for r in range(args.repeats):
        k = r % len(order)
        for strategy in order[k:] + order[:k]:  # a rotating order: each round starts elsewhere
            t0 = time.monotonic()
            row = run_worker(__file__, ["--worker", strategy, "--steps", str(args.steps), "--warmup",
                                        str(args.warmup), "--microbatches", str(args.microbatches)],
                             NPROC, args.out / f".pipeline-{strategy}.json")
            row["run_s"] = time.monotonic() - t0
            runs[strategy].append(row)
            bubble = f", bubble {row['bubble']:.3f}" if "bubble" in row else ""
            print(f"round {r + 1}/{args.repeats}: {strategy} {row['tokens_per_s']:.0f} tok/s{bubble} "
                  f"({row['run_s']:.0f} s)", flush=True)
    formula = _formula(STAGES, args.microbatches)
    default_out = args.out.resolve() == (HERE / "results").resolve()
    cmd = (f"python bench/pipeline.py --repeats {args.repeats} --steps {args.steps} --warmup {args.warmup} "
           f"--microbatches {args.microbatches}"
           + ("" if args.strategies == STRATEGIES else f" --strategies {' '.join(args.strategies)}")
           + ("" if default_out else f" --out {args.out}"))
    lines = [
        "# Pipeline 2 x FSDP 2 against FSDPv2 over 4: tokens/s, memory, bubble",
        "",
        (f"`{cmd}`: seed decoder {MODEL}, global batch {BATCH} x {SEQ} tokens, AdamW; {NPROC} gloo processes "
        f"(`torchspmd run`, OMP threads = {max(1, cores // NPROC)}); pipelined runs: {STAGES} stages x 'fsdp' "
        f"{NPROC // STAGES}, {args.microbatches} micro-batches of {BATCH // args.microbatches} rows "
        f"({BATCH // args.microbatches // (NPROC // STAGES)} per process). Each run: median of "
        f"{args.steps - args.warmup} timed steps after {args.warmup} warm-up; {args.repeats} runs of each strategy, "
        f"interleaved in a rotating order. Machine: {platform.machine()}, {cores} cores, torch "
        f"{__import__('torch').__version__}; {time.monotonic() - started:.0f} s in all; load average (1 min) "
        f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end."),
        "",
        ("| strategy | tokens/s, median of runs | min-max of runs | vs FSDPv2, median of rounds | min-max of rounds | "
         "peak RSS per process, max of ranks (GB), median of runs | peak PSS of the run / processes (GB) | "
         "bubble measured, median of runs | min-max of runs | bubble, (S-1)/(M+S-1) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    base = runs.get("fsdpv2")
    for strategy, rs in runs.items():
        tps = [x["tokens_per_s"] for x in rs]
        ratios = [x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(rs, base)] if base else []
        rss = [max(x["peak_rss_gb_ranks"]) for x in rs]
        pss = [x["peak_pss_gb"] / NPROC for x in rs]
        bubbles = [x["bubble"] for x in rs if "bubble" in x]
        ref = base[0]["losses"] if base else None
        loss_diff = (max(abs(a - b) for x in rs for a, b in zip(x["losses"], ref)) if ref and strategy != "fsdpv2"
                     else None)
        row = {"strategy": strategy, "nproc": NPROC, "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
               "vs_fsdpv2": statistics.median(ratios) if ratios else None, "vs_fsdpv2_runs": ratios,
               "peak_rss_gb_max_rank": statistics.median(rss), "peak_rss_gb_max_rank_runs": rss,
               "peak_rss_gb_ranks_runs": [x["peak_rss_gb_ranks"] for x in rs],
               "peak_pss_gb_per_process": statistics.median(pss), "peak_pss_gb_per_process_runs": pss,
               "step_s_runs": [x["step_s"] for x in rs], "losses_runs": [x["losses"] for x in rs],
               "max_abs_loss_diff_vs_fsdpv2": loss_diff, "run_s": [x["run_s"] for x in rs]}
        if bubbles:
            row.update(bubble=statistics.median(bubbles), bubble_runs=bubbles,
                       bubble_stages_runs=[x["bubble_stages"] for x in rs],
                       busy_s_stages_runs=[x["busy_s_stages"] for x in rs],
                       pipe_s_stages_runs=[x["pipe_s_stages"] for x in rs],
                       parameters_per_stage=rs[0]["parameters_per_stage"], bubble_formula=formula,
                       stages=STAGES, microbatches=args.microbatches)
        rows.append(row)
        vs = f"{row['vs_fsdpv2']:.2f}" if ratios else ""
        b_med = f"{row['bubble']:.3f}" if bubbles else "not pipelined"
        b_spread = _spread(bubbles, "{:.3f}") if bubbles else ""
        b_formula = f"{formula:.3f} (S={STAGES}, M={args.microbatches})" if bubbles else ""
        lines.append(f"| {NAMES[strategy]} | {row['tokens_per_s']:.0f} | {_spread(tps)} | {vs} | "
                     f"{_spread(ratios, '{:.2f}') if ratios else ''} | {row['peak_rss_gb_max_rank']:.2f} | "
                     f"{row['peak_pss_gb_per_process']:.2f} | {b_med} | {b_spread} | {b_formula} |")
    lines += ["", ("Per stage, each run: the measured bubble (busy ms / runner.step ms), medians over the timed steps "
                   "of each process, then over the stage's processes. Parameters per stage (the runner balances "
                   "the stages by parameter count): "
                   + ", ".join(f"stage {k} {n / 1e6:.2f}M" for k, n in
                               enumerate(next((r["parameters_per_stage"] for r in rows if "bubble" in r), [])))
                   + "."), ""]
    for row in rows:
        if "bubble" in row:
            per = "; ".join(", ".join(f"stage {k} {b:.3f} ({1e3 * busy[k]:.0f} / {1e3 * pipe[k]:.0f})"
                                      for k, b in bs.items())
                            for bs, busy, pipe in zip(row["bubble_stages_runs"], row["busy_s_stages_runs"],
                                                      row["pipe_s_stages_runs"]))
            lines.append(f"- {NAMES[row['strategy']]}: {per}")
    diffs = [(NAMES[r["strategy"]], r["max_abs_loss_diff_vs_fsdpv2"]) for r in rows
             if r["max_abs_loss_diff_vs_fsdpv2"] is not None]
    if diffs:
        lines += ["", "Losses: the largest |loss - FSDPv2's loss| over every step of every run: "
                  + "; ".join(f"{name} {d:.1e}" for name, d in diffs) + "."]
    lines += ["", ("The bubble measured: 1 - (this process's time inside its stage's forward_one_chunk, "
                   "backward_one_chunk, perform_reduce_grad and the loss) / (the wall time of runner.step), mean over "
                   "the 4 processes, median over the timed steps. The formula assumes equal stages and free "
                   "communication; 4 processes share the cores here, so a waiting process lends its core to the "
                   "others (see the module docstring of bench/pipeline.py).")]
    write_report(args.out, "pipeline", lines, rows)


if __name__ == "__main__":
    main()
