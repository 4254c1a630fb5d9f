"""Where an FSDPv2 process's memory goes: the physical memory of rank 0 at each phase.

    python bench/memory_step.py                   # seed decoder, 4 processes, both malloc settings
    python bench/memory_step.py --nproc 2 --steps 3

Trains bench/suite.py's seed decoder (107M parameters, one FSDPv2 unit per layer, fused
Adam, global batch 4 x 64 tokens) with torchspmd FSDPv2 on n processes, under the malloc
settings ``torchspmd run`` gives its workers (``tuned``), with a 4 MiB mmap threshold
(``mmap-4MiB``: large blocks are mapped afresh and returned at once) and with the gathered
parameters copied into every process's own memory (``params-copied``:
``TORCHSPMD_SHARED_PARAMS=0``; by default they are gathered once into shared memory) and
with the workers started as new Python processes (``subprocess``:
``TORCHSPMD_START_METHOD=subprocess``; by default they are forks of the launcher), the
configurations interleaved over ``--repeats`` runs (``--settings`` picks some). Rank 0 reads its own PSS (proportional set size: a page
shared by k processes counts 1/k) and USS (pages only it maps) after importing torch,
after building the model, after wrapping it, after each decoder layer's forward and
backward, and after each step; the launcher's PSS is read from outside. The suite's
``PeakMemory`` gives the peak of all processes together (sampled every 0.5 s), and the
steps' median time (the first step left out) is reported to show what each setting costs.

``--mixed-precision bf16`` wraps with FSDPv2's ``mixed_precision='bf16'`` (parameters
gathered and computed in bf16, fp32 shards, gradient reduction and Adam state) and writes
``memory_step_bf16.*`` instead.

Writes ``bench/results/memory_step.md`` and ``memory_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import provenance, run_measured  # noqa: E402

RESULTS = HERE / "results"
SETTINGS = {
    "tuned": {},  # the launcher's own (torchspmd.launch.launcher.MALLOC_ENV)
    "mmap-4MiB": {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40),
                  "MALLOC_TOP_PAD_": str(256 * 2**20)},
    # the gathered parameters copied into each process's memory, as FSDP2 does (the launcher's malloc settings)
    "params-copied": {"TORCHSPMD_SHARED_PARAMS": "0"},
    # the workers started as new Python processes (torchrun's way), not forked from the launcher
    "subprocess": {"TORCHSPMD_START_METHOD": "subprocess"},
}

ABOUT = {
    "tuned": "the malloc settings `torchspmd run` gives its workers, which are forks of the launcher",
    "mmap-4MiB": "the same with a 4 MiB mmap threshold",
    "params-copied": "the gathered parameters copied into each process's memory (TORCHSPMD_SHARED_PARAMS=0; by "
                     "default they are gathered once into shared memory)",
    "subprocess": "the workers started as new Python processes, as torchrun does (TORCHSPMD_START_METHOD=subprocess; "
                  "by default they are forks of the launcher, which has imported torch and torchspmd)",
}


def worker(steps: int, result: str, mixed_precision: str | None = None) -> None:
    import functools
    import time

    import numpy as np
    import psutil
    import torch
    import torch.nn.functional as F

    import torchspmd as ts

    me = psutil.Process()
    marks: list[tuple[str, float, float]] = []

    def mark(name: str) -> None:
        if ts.global_ordinal() == 0:
            info = me.memory_full_info()
            marks.append((name, info.pss / 2**30, info.uss / 2**30))

    ts.use_spmd()
    mark("torch imported, process group up")
    import suite

    model, layer_cls, vocab = suite._build("seed", "seed")
    mark("whole model built")
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy, mixed_precision=mixed_precision)
    mark("sharded (FSDPv2)")
    for i, layer in enumerate(model.module.layers):
        layer.register_forward_hook(lambda *_, i=i: mark(f"forward of layer {i}"))
        layer.register_full_backward_hook(lambda *_, i=i: mark(f"backward of layer {i}"))
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(suite._data(vocab, steps), batch_size=suite.BATCH),
                               ts.device(), input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    times = []
    for step, (x, y) in enumerate(loader):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        times.append(time.perf_counter() - t0)
        mark(f"step {step} done")
    if ts.global_ordinal() == 0:
        Path(result).write_text(json.dumps({"marks": marks, "step_s": statistics.median(times[1:] or times)}))


def run(setting: str, nproc: int, steps: int, mixed_precision: str | None = None, out: Path = RESULTS) -> dict:
    import subprocess

    from _common import PeakMemory

    from torchspmd.launch.host import allocator_env as _allocator_env

    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)), **SETTINGS[setting])
    env.update(_allocator_env(env))  # the launcher's settings unless the setting chose its own
    result = out / f".memory_{setting}.json"
    cmd = [sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(nproc), __file__, "--worker",
           "--steps", str(steps), "--result", str(result)] + (
               ["--mixed-precision", mixed_precision] if mixed_precision else [])
    with subprocess.Popen(cmd, env=env) as proc, PeakMemory(proc.pid) as every, \
            PeakMemory(proc.pid, children=False) as launcher:
        proc.wait()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    row = json.loads(result.read_text())
    result.unlink()
    return {**row, "setting": setting, "nproc": nproc, "peak_all_gb": every.peak_gb, "launcher_pss_gb": launcher.peak_gb}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--out", default=str(RESULTS), help="where the results go")
    p.add_argument("--mixed-precision", choices=["bf16"], help="FSDPv2(mixed_precision=...); results go to "
                                                               "memory_step_bf16.*")
    a = p.parse_args()
    if a.worker:
        return worker(a.steps, a.result, a.mixed_precision)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.settings
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(a.repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:  # rotated each round
            runs[k].append(run(k, a.nproc, a.steps, a.mixed_precision, out))
            x = runs[k][-1]
            print(f"repeat {r + 1}: {k}: peak {x['peak_all_gb'] / a.nproc:.2f} GB per device, step {x['step_s']:.2f} s",
                  flush=True)
    import torch

    mp_arg = (f" --mixed-precision {a.mixed_precision}" if a.mixed_precision else "") + (
        f" --out {a.out}" if out.resolve() != RESULTS.resolve() else "")
    mp_text = f", mixed_precision='{a.mixed_precision}'" if a.mixed_precision else ""
    stem = f"memory_step_{a.mixed_precision}" if a.mixed_precision else "memory_step"
    machine = provenance()
    lines = ["# Where an FSDPv2 process's memory goes" + (f" ({a.mixed_precision})" if a.mixed_precision else ""), "",
             machine, "",
             f"`python bench/memory_step.py --nproc {a.nproc} --steps {a.steps} --repeats {a.repeats} --settings "
             f"{' '.join(names)}{mp_arg}` on this machine "
             f"({os.cpu_count()} cores, torch {torch.__version__}): the seed decoder (107M parameters, one FSDPv2 unit "
             f"per layer, fused Adam, 4 x 64 tokens per step{mp_text}), {a.nproc} processes. "
             + " ".join(f"`{k}`: {ABOUT[k]}." for k in names)
             + " Each round runs the settings in an order rotated by one. GB = 2^30 bytes.",
             "", "| setting | peak of all processes / devices (GB), per run | launcher PSS (GB) | step (s), per run |",
             "|---|---|---|---|"]
    for k in names:
        peaks = ", ".join(f"{x['peak_all_gb'] / a.nproc:.2f}" for x in runs[k])
        launchers = ", ".join(f"{x['launcher_pss_gb']:.2f}" for x in runs[k])
        steps = ", ".join(f"{x['step_s']:.2f}" for x in runs[k])
        lines.append(f"| {k} | {peaks} | {launchers} | {steps} |")
    lines += ["", "Rank 0's own memory at each phase (last run of each setting; PSS, USS in GB):", "",
              "| phase | " + " | ".join(f"{k} PSS | {k} USS" for k in names) + " |",
              "|---|" + "---|---|" * len(names)]
    last = {k: runs[k][-1]["marks"] for k in names}
    for i, (name, *_) in enumerate(last[names[0]]):
        cells = []
        for k in names:
            m = last[k][i] if i < len(last[k]) and last[k][i][0] == name else None
            cells += [f"{m[1]:.3f}", f"{m[2]:.3f}"] if m else ["", ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine, "runs": runs, "nproc": a.nproc, "steps": a.steps,
                                                      "mixed_precision": a.mixed_precision}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
