"""Where an FSDPv2 step's CPU time goes, by kind of code, as processes are added (Linux ``perf``).

    python bench/perf_step.py [--repeats 3] [--nproc 2 4] [--out bench/results]

Trains the seed decoder of ``bench/suite.py`` (107M parameters, one FSDPv2 unit per layer,
fused Adam, global batch 4 x 64 tokens) on ``--nproc`` processes of this machine under
``perf record`` (CPU-clock samples of every process of the run, ``--freq`` per second of
CPU time). Recording is switched on by rank 0 after the warm-up steps (all processes past a
barrier) and off after the timed steps, through perf's control pipe, so start-up, imports
and the first steps' heap growth are left out. Each sample's function is put in one of the
kinds below (first match); a kind's CPU seconds per step are its samples over the frequency
and the timed steps, summed over all the processes. The process counts run interleaved,
``--repeats`` rounds; writes ``perf_step.md`` / ``perf_step.json`` (median and min-max of
the rounds). Needs ``perf`` (linux-tools) and permission to profile one's own processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: (kind, what it is, pattern on the symbol name or, for the last three, the library), first match wins.
KINDS = (
    ("matrix products", "MKL/oneDNN GEMM kernels and their packing of the operands", r"gemm|mkl_blas|dnnl|brg"),
    ("cat", "`cat` kernels: FSDP2 copying each unit's gradients into its row of the reduce-scatter input "
            "(`_chunk_cat`), and any other concatenation", r"cat_serial_kernel|cat_contig|catArray|cat_out"),
    ("copies", "tensor copies (`copy_`, `.to`, `clone`, contiguous), memcpy", r"copy_kernel|memcpy|memmove|copy_stub"),
    ("additions", "element-wise `add` (the reduce-scatter's sums, autograd's gradient sums, residuals)",
     r"add_kernel"),
    ("Adam", "the fused Adam kernel", r"adam"),
    ("other ATen kernels", "every other element-wise, reduction, softmax, norm, embedding kernel",
     r"at::native|at::vec|Vectorized"),
    ("Python", "the interpreter (libpython)", r"libpython"),
    ("system", "the kernel: page faults, scheduling, sockets", r"kernel\.kallsyms"),
    ("everything else", "dispatch, autograd engine, c10, libc/malloc, gloo, ...", r""),
)


def worker(result: str, ctl: str, steps: int, warmup: int) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from _common import seed_fsdpv2
    from suite import BATCH, SEED, SEQ

    model, loader, opt = seed_fsdpv2(steps)
    rank0 = dist.get_rank() == 0
    for step, (x, y) in enumerate(loader):
        if step == warmup:
            dist.barrier()
            if rank0:
                Path(ctl).write_text("enable\n")
            t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, SEED["vocab_size"]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    dist.barrier()  # every process's timed steps are done
    if rank0:
        wall = (time.perf_counter() - t0) / (steps - warmup)
        Path(ctl).write_text("disable\n")
        Path(result).write_text(json.dumps({"step_s": wall, "tokens_per_s": BATCH * SEQ / wall}))


def kind_of(sym: str, dso: str) -> str:
    for kind, _, pattern in KINDS:
        where = dso if kind in ("Python", "system") else sym
        if re.search(pattern, where):
            return kind
    return KINDS[-1][0]


def _samples(data: Path) -> dict[str, int]:
    """Samples per kind in a ``perf.data`` file."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,sym,dso"], capture_output=True, text=True,
                         check=True).stdout
    counts = {kind: 0 for kind, _, _ in KINDS}
    line_re = re.compile(r"^\s*[0-9a-f]+\s+(.*?)\s*\(([^()]*)\)\s*$")
    for line in out.splitlines():
        m = line_re.match(line)
        if m:
            counts[kind_of(m.group(1), m.group(2))] += 1
    return counts


def run(n: int, a, tmp: Path) -> dict:
    from torchspmd.launch.host import allocator_env as _allocator_env

    ctl, data, result = tmp / f"ctl{n}", tmp / f"perf{n}.data", tmp / f"result{n}.json"
    for p in (ctl, data, result):
        p.unlink(missing_ok=True)
    os.mkfifo(ctl)
    cores = os.cpu_count() or 1
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // n)))
    env.update(_allocator_env(env))
    cmd = ["perf", "record", "-q", "-F", str(a.freq), "-D", "-1", "--control", f"fifo:{ctl}", "-o", str(data), "--",
           sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(n), __file__, "--worker", "--result",
           str(result), "--ctl", str(ctl), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    row = json.loads(result.read_text())
    timed = a.steps - a.warmup
    per_step = {kind: c / a.freq / timed for kind, c in _samples(data).items()}
    return {**row, "cpu_s_per_step": sum(per_step.values()), "kinds": per_step}


def _cell(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=14, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=7, help="steps before recording starts")
    p.add_argument("--freq", type=int, default=499, help="samples per second of CPU time")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result")
    p.add_argument("--ctl")
    a = p.parse_args()
    if a.worker:
        return worker(a.result, a.ctl, a.steps, a.warmup)
    if shutil.which("perf") is None:
        sys.exit("bench/perf_step.py needs Linux perf on PATH (the linux-tools package of this kernel)")
    runs: dict[int, list[dict]] = {n: [] for n in a.nproc}
    with tempfile.TemporaryDirectory(prefix="perf_step") as tmp:
        for r in range(a.repeats):
            order = a.nproc[r % len(a.nproc):] + a.nproc[:r % len(a.nproc)]
            for n in order:
                row = run(n, a, Path(tmp))
                runs[n].append(row)
                top = sorted(row["kinds"].items(), key=lambda kv: -kv[1])[:3]
                print(f"round {r + 1}/{a.repeats}: {n} processes {row['tokens_per_s']:.0f} tok/s, "
                      f"{row['cpu_s_per_step']:.2f} CPU-s per step (" +
                      ", ".join(f"{k} {v:.2f}" for k, v in top) + ")", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    from _common import provenance, with_machine

    machine = provenance()
    (a.out / "perf_step.json").write_text(json.dumps(with_machine({str(n): v for n, v in runs.items()}, machine),
                                                     indent=1))
    counts = a.nproc
    lines = ["# Where an FSDPv2 step's CPU time goes, by kind of code", "", machine, "",
             f"`python bench/perf_step.py --repeats {a.repeats} --nproc {' '.join(map(str, counts))}"
             + ("" if (a.steps, a.warmup, a.freq) == (14, 7, 499) else
                f" --steps {a.steps} --warmup {a.warmup} --freq {a.freq}") + "` on this machine "
             f"({os.cpu_count()} cores): the seed decoder (107M), FSDPv2 with the shared-memory collectives, 4 x 64 "
             f"tokens per step, fused Adam; `perf record` at {a.freq} samples per CPU-second over steps "
             f"{a.warmup + 1}-{a.steps} of each run, every process of the run. CPU seconds per step of all the "
             "processes together, median (min-max) of the interleaved rounds.", "",
             "| kind | " + " | ".join(f"{n} processes" for n in counts) + " |"
             + ("" if len(counts) < 2 else f" {counts[-1]} over {counts[0]}, per round |"),
             "|---|" + "---|" * (len(counts) + (len(counts) >= 2))]
    for kind, what, _ in KINDS + (("all", "", ""),):
        cells = []
        for n in counts:
            cells.append(_cell([r["cpu_s_per_step"] if kind == "all" else r["kinds"][kind] for r in runs[n]]))
        if len(counts) >= 2:
            lo, hi = runs[counts[0]], runs[counts[-1]]
            get = (lambda r: r["cpu_s_per_step"]) if kind == "all" else (lambda r: r["kinds"][kind])
            growth = [get(h) - get(l) for l, h in zip(lo, hi)]
            cells.append(("+" if statistics.median(growth) >= 0 else "") + _cell(growth) + " s")
        name = f"**{kind}**" if kind == "all" else f"{kind}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| processes | tokens/s | step (s) |", "|---|---|---|"]
    for n in counts:
        lines.append(f"| {n} | {_cell([r['tokens_per_s'] for r in runs[n]], 0)} | "
                     f"{_cell([r['step_s'] for r in runs[n]])} |")
    lines += ["", "Kinds (a sample goes to the first that matches its function):", ""]
    lines += [f"- {kind}: {what}" for kind, what, _ in KINDS]
    (a.out / "perf_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
