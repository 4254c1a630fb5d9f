"""What the benchmarks share: the timed training loop and starting a worker."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path


class CpuUse:
    """This process's CPU use over the timed steps: user and system seconds and context
    switches (voluntary: it waited; involuntary: the scheduler took its core away), summed
    over the steps passed to :meth:`add` (``getrusage(RUSAGE_SELF)``: all its threads), and
    the wall time of those same steps."""

    def __init__(self):
        self.user = self.sys = self.wall = 0.0
        self.voluntary = self.involuntary = 0
        self.steps = 0

    @staticmethod
    def now():
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime, r.ru_stime, r.ru_nvcsw, r.ru_nivcsw, time.perf_counter()

    def add(self, before, after) -> None:
        self.user += after[0] - before[0]
        self.sys += after[1] - before[1]
        self.voluntary += after[2] - before[2]
        self.involuntary += after[3] - before[3]
        self.wall += after[4] - before[4]
        self.steps += 1

    def per_step(self) -> dict:
        """Means per timed step: ``cpu_user_s``, ``cpu_sys_s``, ``csw_voluntary``,
        ``csw_involuntary`` and ``cpu_wall_s`` (the steps' wall time, to set the CPU time against:
        the tokens/s come from the median step)."""
        n = max(1, self.steps)
        return {"cpu_user_s": self.user / n, "cpu_sys_s": self.sys / n, "cpu_wall_s": self.wall / n,
                "csw_voluntary": self.voluntary / n, "csw_involuntary": self.involuntary / n}


def seed_fsdpv2(steps: int):
    """In a worker of ``torchspmd run``: ``use_spmd()``, the seed decoder of ``bench/suite.py``
    (107M) under FSDPv2 with one unit per layer on all the processes' 1-D mesh, a loader of
    ``steps`` global batches (4 x 64 tokens) and fused Adam: ``(model, loader, optimizer)``."""
    import functools

    import numpy as np
    import torch
    from suite import BATCH, SEED, _data

    import torchspmd as ts
    from torchspmd.models import DecoderLayer, DecoderModel

    ts.use_spmd()
    torch.manual_seed(0)
    model = DecoderModel(**SEED)
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
    model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(_data(SEED["vocab_size"], steps), batch_size=BATCH),
                               ts.device(), input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    return model, loader, torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)


def timed_steps(model, opt, loader, vocab: int, warmup: int, cpu: CpuUse | None = None,
                autocast=None, loading: bool = False) -> list[float]:
    """Train on every batch of ``loader``; return the seconds of each step after ``warmup``
    (and add the timed steps' CPU use to ``cpu``). ``autocast``: a context factory the
    forward and the loss run in (``torch.autocast``). A step is timed from after taking its
    batch to reading its loss; with ``loading``, from before taking the batch (the whole
    iteration: a loader that prepares batches in the program's thread and one that prepares
    them in a thread of its own are then timed alike)."""
    import contextlib

    import torch.nn.functional as F

    autocast = autocast or contextlib.nullcontext

    times = []
    batches = iter(loader)
    for step in itertools.count():
        t0 = time.perf_counter()
        c0 = CpuUse.now()
        try:
            x, y = next(batches)
        except StopIteration:
            break
        if not loading:
            t0 = time.perf_counter()
            c0 = CpuUse.now()
        with autocast():
            out = model(x)
            logits = out if hasattr(out, "reshape") else out["logits"]  # a transformers model returns an output object
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()  # wait for the step to finish
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.add(c0, CpuUse.now())
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


def provenance() -> str:
    """The machine and date of a run, as one line of a report: ``Machine: <cores> CPU cores
    (<architecture>, <CPU model>), <memory> GB memory, <GPUs>, torch <version>, Python
    <version>; run <UTC date>.`` Every part is read from the machine (``/proc``, ``platform``,
    ``torch``), the parts it cannot read left out; GB = 2^30 bytes."""
    import datetime
    import platform

    cpu = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            cpu += [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")][:1]
    except OSError:
        pass
    parts = [f"{os.cpu_count()} CPU cores ({', '.join(c for c in cpu if c)})"]
    memory = None
    try:
        with open("/proc/meminfo") as f:
            memory = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        try:
            import psutil

            memory = psutil.virtual_memory().total
        except ImportError:
            pass
    if memory:
        parts.append(f"{memory / 2**30:.1f} GB memory")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            parts.append(", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names)))
        parts.append(f"torch {torch.__version__}")
    parts.append(f"Python {platform.python_version()}")
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return f"Machine: {', '.join(parts)}; run {today}."


def with_machine(data, machine: str):
    """A report's JSON ``data`` with a ``machine`` field (``machine``: :func:`provenance`'s
    line): a dict gets the key, anything else becomes ``{"machine": ..., "rows": data}``."""
    return {"machine": machine, **data} if isinstance(data, dict) else {"machine": machine, "rows": data}


def write_report(out: Path, stem: str, lines: list[str], data) -> None:
    """``<out>/<stem>.md`` (the report's ``lines``, :func:`provenance`'s line after the
    title) and ``<out>/<stem>.json`` (``data``, with that line as its ``machine``), and the
    report on stdout."""
    machine = provenance()
    lines = [*lines[:1], "", machine, *lines[1:]]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(with_machine(data, machine), indent=1))
    print("\n".join(lines))


class PeakMemory:
    """The peak physical memory of a running process tree: sampled every ``interval``
    seconds, the sum over the root and all its descendants of their PSS (proportional set
    size: a page mapped by k processes counts 1/k to each). Pages the processes share
    (torch's libraries, a shared-memory collective buffer) count once, as the machine pays
    for them, so one process driving n devices and n processes of one device each are
    measured alike; RSS would count every shared page once per process.

        with PeakMemory(proc.pid) as mem:
            proc.wait()
        mem.peak_gb
    """

    def __init__(self, pid: int, interval: float = 0.5, children: bool = True):
        import threading

        self.pid, self.interval, self.children, self.peak_bytes, self.samples = pid, interval, children, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)] if self.children else [root]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass  # exited between listing and reading: it holds nothing now
        return total

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            self.samples += 1
            self._done.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / 2**30


def run_measured(cmd: list[str], env: dict, timeout: float | None = None,
                 **popen) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` to its end (killed after ``timeout`` seconds, as ``subprocess.run`` does);
    return its CompletedProcess and the peak PSS of its process tree in GB (``PeakMemory``)."""
    with subprocess.Popen(cmd, env=env, **popen) as proc, PeakMemory(proc.pid) as mem:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return done, mem.peak_gb


def run_worker(script: str, args: list[str], nproc: int, result: Path, env: dict | None = None) -> dict:
    """Run ``script --worker ...`` in ``nproc`` processes (``torchspmd run``; one plain process
    for 1) with the cores split between them; return the JSON rank 0 wrote to ``result``,
    with ``peak_pss_gb``, the peak physical memory of all the run's processes together
    (``PeakMemory``; the launcher included). Every run gets the malloc settings
    ``torchspmd run`` gives its workers (one process too, so that every strategy runs on
    the same allocator). ``env``: variables to add for this run."""
    from torchspmd.launch.host import allocator_env as _allocator_env

    cores = os.cpu_count() or 1
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // nproc)), **(env or {}))
    env.update(_allocator_env(env))
    result.parent.mkdir(parents=True, exist_ok=True)  # the worker writes there
    cmd = [script, *args, "--result", str(result)]
    if nproc == 1:
        cmd = [sys.executable, *cmd]
    else:
        cmd = [sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(nproc), *cmd]
    done, pss = run_measured(cmd, env)
    done.check_returncode()
    row = json.loads(result.read_text())
    result.unlink()
    return {**row, "peak_pss_gb": pss}
