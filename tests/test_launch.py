"""`python script.py` relaunching itself per device, `torchspmd run`, and the examples."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import clean_env, interrupt_when

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torchspmd as ts
    ts.use_spmd()
    import torch.distributed as dist
    print(f"hello from a world of {ts.global_runtime_device_count()} rank={dist.get_rank()} args={sys.argv[1:]}")
    print(f"process_count={ts.process_count()} local={ts.local_device_count()} backend={ts.backend()}")
    if "--fail-on-1" in sys.argv and dist.get_rank() == 1:
        raise RuntimeError("rank one fails on purpose")
    """
)


_env = clean_env


def _run(args, **env):
    return subprocess.run(args, capture_output=True, text=True, env=_env(**env), timeout=240, cwd=ROOT)


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "prog.py"
    p.write_text(SCRIPT)
    return p


def test_plain_python_relaunches_per_device_and_prints_once(script):
    r = _run([sys.executable, str(script), "a", "--b"], CPU_NUM_DEVICES=2)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("hello")]
    assert lines == ["hello from a world of 2 rank=0 args=['a', '--b']"]
    assert "process_count=2 local=2 backend=cpu" in r.stdout


def test_num_devices_environment_variable(script):
    # (TORCHSPMD_ALL_RANKS_OUTPUT=0 is off, as unset: rank 0 alone prints)
    r = _run([sys.executable, str(script)], TORCHSPMD_NUM_DEVICES=3, TORCHSPMD_ALL_RANKS_OUTPUT=0)
    assert r.returncode == 0, r.stderr
    assert [l for l in r.stdout.splitlines() if l.startswith("hello")] == ["hello from a world of 3 rank=0 args=[]"]


def test_a_missing_or_broken_script_fails_once_before_any_worker(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nif True\n    print('never')\n")
    for path, message in [(tmp_path / "missing.py", f"torchspmd run: no such script: {str(tmp_path / 'missing.py')!r}"),
                          (bad, f"torchspmd run: SyntaxError in the script ({bad}, line 2): expected ':'")]:
        r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(path)])
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert r.stderr.startswith("torchspmd: " + message) and r.stderr.count("torchspmd run:") == 1, r.stderr
        assert "Traceback" not in r.stderr and "rank" not in r.stderr, r.stderr


def test_single_device_runs_in_process(script):
    r = _run([sys.executable, str(script)])
    assert r.returncode == 0, r.stderr
    assert "hello from a world of 1 rank=0" in r.stdout


def test_failure_on_one_rank_fails_the_job(script):
    r = _run([sys.executable, str(script), "--fail-on-1"], CPU_NUM_DEVICES=2)
    assert r.returncode == 1, r.stderr
    assert "[rank1]: RuntimeError: rank one fails on purpose" in r.stderr
    summary = [l for l in r.stderr.splitlines() if l.startswith("torchspmd: ")]
    assert summary[0].startswith("torchspmd: rank 1 failed: RuntimeError: rank one fails on purpose (at "), r.stderr


def test_torchspmd_run(script):
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(script), "x"])
    assert r.returncode == 0, r.stderr
    assert [l for l in r.stdout.splitlines() if l.startswith("hello")] == ["hello from a world of 2 rank=0 args=['x']"]


def test_torchspmd_run_passes_torchrun_options(script):
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc-per-node=2", "--max-restarts=0", str(script)])
    assert r.returncode == 0, r.stderr
    assert "hello from a world of 2 rank=0" in r.stdout


def test_non_script_program_gets_a_clear_error():
    r = _run([sys.executable, "-c", "import torchspmd as ts; ts.use_spmd()"], CPU_NUM_DEVICES=2)
    assert r.returncode != 0
    assert "torchspmd run --nproc 2" in r.stderr


def test_bad_device_count_is_a_clear_error(script):
    r = _run([sys.executable, str(script)], TORCHSPMD_NUM_DEVICES="two")
    assert r.returncode != 0 and "TORCHSPMD_NUM_DEVICES='two' is not an integer" in r.stderr


def test_unknown_backend_is_a_clear_error():
    r = _run([sys.executable, "-c", "import torchspmd as ts; ts.use_spmd(backend='tpu')"])
    assert r.returncode != 0 and "use_spmd(backend='tpu')" in r.stderr


def test_info_names_the_engine_and_the_patches_it_applies():
    r = _run([sys.executable, "-m", "torchspmd.cli", "info"])
    assert r.returncode == 0 and "engine (default) native, backend cpu" in r.stdout, r.stdout + r.stderr
    listed = r.stdout.split("patches applied by use_spmd()")[1]
    for name in ("torch.nn.Module registration hooks", "DTensor op handlers", "torch.optim.Optimizer.profile_hook_step",
                 "torch function mode: implicit replication"):
        assert f"  {name} [torch " in listed, listed


MALLOC_SCRIPT = textwrap.dedent(
    """
    import os, torchspmd as ts
    ts.use_spmd()
    names = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
    print(f"rank {ts.global_ordinal()} malloc", [os.environ.get(k) for k in names], flush=True)
    """
)


def test_workers_get_the_malloc_settings_unless_the_user_chose(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(MALLOC_SCRIPT)
    run = [sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(p)]
    tuned = [str(32 * 2**20), str(2**40), str(256 * 2**20), None]
    # the workers' environment, as launched and relaunched per device (the user's choices below reach
    # them the same way: one launch with a choice of the user's checks that path end to end)
    for launch, env, want in [(run, {}, tuned), ([sys.executable, str(p)], {}, tuned),
                              (run, {"MALLOC_ARENA_MAX": "2"}, [None, None, None, "2"])]:
        r = _run(launch, CPU_NUM_DEVICES=2, TORCHSPMD_ALL_RANKS_OUTPUT=1, **env)
        assert r.returncode == 0, r.stderr
        got = sorted(l for l in r.stdout.splitlines() if " malloc " in l)
        assert got == [f"rank {i} malloc {want!r}" for i in range(2)], (env, r.stdout)
    # what the launcher adds for each choice of the user's (the function both launch paths call)
    from torchspmd.launch.host import allocator_env

    want = dict(zip(("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"), tuned))
    for env, added in [({}, want), ({"TORCHSPMD_MALLOC": "tuned"}, want), ({"TORCHSPMD_MALLOC": "default"}, {}),
                       ({"MALLOC_ARENA_MAX": "2"}, {}), ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, {}),
                       ({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, want)]:
        assert allocator_env({"PATH": "/bin", **env}) == added, env


RELEASE_SCRIPT = textwrap.dedent(
    """
    import functools, os, torch, torchspmd as ts
    ts.use_spmd()
    def resident():  # bytes in memory now
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = resident()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 2048, bias=False) for _ in range(16)])  # 8 MiB each
    built = resident()
    mesh = ts.Mesh(list(range(2)), (2, 1), ("fsdp", "model"))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={torch.nn.Linear})
    model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    print(f"rank {ts.global_ordinal()} grew {built - before} {resident() - before}", flush=True)
    """
)


def test_fsdpv2_hands_back_the_memory_of_the_parameters_it_no_longer_holds(tmp_path):
    # Under the launcher's malloc settings freed memory is kept; the whole model a process
    # builds before FSDPv2 keeps its half must not stay resident for the rest of the run.
    p = tmp_path / "r.py"
    p.write_text(RELEASE_SCRIPT)
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(p)], TORCHSPMD_ALL_RANKS_OUTPUT=1)
    assert r.returncode == 0, r.stderr
    model = 16 * 1024 * 2048 * 4
    grew = [l.split()[-2:] for l in r.stdout.splitlines() if " grew " in l]
    assert len(grew) == 2, r.stdout
    for built, wrapped in ((int(a), int(b)) for a, b in grew):
        assert built > 0.9 * model, (built, model)  # the whole model was resident
        # half of it is this process's shard (with FSDP2's own state: ~0.77x measured);
        # without handing the freed memory back, the growth stays at ~1.8x
        assert wrapped < model, (wrapped, model, r.stdout)


def test_bad_malloc_switch_is_a_clear_error(script):
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(script)], TORCHSPMD_MALLOC="fast")
    assert r.returncode != 0
    assert "TORCHSPMD_MALLOC='fast': expected 'tuned' (the default) or 'default'" in r.stderr, r.stderr


# --- how `torchspmd run` starts its workers (TORCHSPMD_START_METHOD) --------------------

PROGRAM = textwrap.dedent(
    """
    import sys
    preloaded = "torch" in sys.modules  # before this program imports anything
    import atexit, ctypes, os, torch, torchspmd as ts
    ts.use_spmd()
    rank = ts.global_ordinal()
    def private_mb():  # memory only this process maps (USS)
        with open("/proc/self/smaps_rollup") as f:
            kb = sum(int(l.split()[1]) for l in f if l.startswith(("Private_Clean:", "Private_Dirty:")))
        return kb / 1024
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
    block = libc.malloc(24 << 20)  # under the launcher's malloc settings: from the heap, not a fresh mapping
    # one write per line: under TORCHSPMD_START_METHOD=subprocess (torchrun's `python -u`) print()'s
    # text and newline are two writes, and two ranks' lines can mix
    sys.stdout.write(f"rank {rank} name={__name__} argv={'|'.join(sys.argv)} path0={sys.path[0]} "
                     f"preloaded={preloaded} threads={torch.get_num_threads()} heap={block < libc.sbrk(0)} "
                     f"private_mb={private_mb():.0f}\\n")
    sys.stdout.flush()
    import threading, time
    done = []
    def late():  # a non-daemon thread: the program ends when it has, before atexit
        time.sleep(0.2)
        done.append(1)
    threading.Thread(target=late).start()
    atexit.register(lambda: (sys.stdout.write(f"rank {rank} atexit thread_done={bool(done)}\\n"), sys.stdout.flush()))
    sys.exit(int(sys.argv[-1]))
    """
)


def _workers(r):
    return {int(l.split()[1]): dict(kv.split("=", 1) for kv in l.split()[2:])
            for l in r.stdout.splitlines() if l.startswith("rank ") and "name=" in l}


def _package(folder: Path) -> Path:
    """``folder/pkg``, a package holding PROGRAM as ``pkg/prog.py``."""
    pkg = folder / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "prog.py").write_text(PROGRAM)
    return pkg


def _program_run(once, start: str, as_module: bool) -> tuple[Path, subprocess.CompletedProcess]:
    """`torchspmd run --nproc 2` of PROGRAM (``pkg/prog.py x 0``, as a script or with -m) with
    TORCHSPMD_START_METHOD ``start``, made once for the test run (``once``): the folder it ran in
    and the run. test_workers_run_the_program_as_python_would checks it and
    test_forked_workers_share_the_launchers_runtime reads its workers' memory."""

    def make(folder):
        pkg = _package(folder)
        target = ["-m", "pkg.prog"] if as_module else [str(pkg / "prog.py")]
        r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", *target, "x", "0"],
                           capture_output=True, text=True, timeout=240, cwd=folder,
                           env=_env(TORCHSPMD_START_METHOD=start, TORCHSPMD_ALL_RANKS_OUTPUT=1, OMP_NUM_THREADS=1,
                                    PYTHONPATH=ROOT))
        return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}

    folder, r = once(f"launch-program-{start}-{'module' if as_module else 'script'}", make)
    return folder, subprocess.CompletedProcess([], r["returncode"], r["stdout"], r["stderr"])


@pytest.mark.parametrize("start", ["fork", "subprocess"])
@pytest.mark.parametrize("as_module", [False, True])
def test_workers_run_the_program_as_python_would(once, tmp_path, start, as_module):
    # Forked or new, a worker runs the program as `python -u prog.py args` (or `python -m`) would:
    # __main__, its argv and sys.path[0], one thread per core, the malloc settings in effect,
    # atexit handlers, its exit status.
    folder, r = _program_run(once, start, as_module)
    pkg = folder / "pkg"
    assert r.returncode == 0, r.stderr
    workers = _workers(r)
    assert sorted(workers) == [0, 1], r.stdout
    for w in workers.values():
        assert w["name"] == "__main__" and w["threads"] == "1" and w["heap"] == "True", w
        assert w["argv"].split("|") == [str(pkg / "prog.py"), "x", "0"], w
        assert w["path0"] == str(folder if as_module else pkg), w
        assert w["preloaded"] == str(start == "fork"), w
    assert sorted(l for l in r.stdout.splitlines() if " atexit " in l) == ["rank 0 atexit thread_done=True",
                                                                            "rank 1 atexit thread_done=True"]
    # the exit status of a program that calls sys.exit(3) (per start method: it does not depend on how
    # the program was named)
    if as_module:
        return
    pkg = _package(tmp_path)
    target = ["-m", "pkg.prog"] if as_module else [str(pkg / "prog.py")]
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", *target, "x", "3"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       env=_env(TORCHSPMD_START_METHOD=start, PYTHONPATH=ROOT))
    assert r.returncode == 3, r.stderr
    assert "torchspmd: rank 0 exited with code 3" in r.stderr or "torchspmd: rank 1 exited with code 3" in r.stderr


def test_forked_workers_print_whole_lines(tmp_path):
    # Ranks printing at the same moment, under PYTHONUNBUFFERED (as `python -u`): each line of
    # print() arrives whole, not mixed with another rank's (print writes its text and its end
    # separately; unbuffered, that is two writes). Without the workers' line buffering, about a
    # tenth of the lines were mixed here.
    p = tmp_path / "prog.py"
    p.write_text(textwrap.dedent(
        """
        import torch.distributed as dist, torchspmd as ts
        ts.use_spmd()
        rank = ts.global_ordinal()
        dist.barrier()
        for i in range(3000):
            print(f"rank {rank} line {i} end")
        """))
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(p)],
             TORCHSPMD_START_METHOD="fork", TORCHSPMD_ALL_RANKS_OUTPUT=1, PYTHONUNBUFFERED=1)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("rank ") or " line " in l]
    mixed = [l for l in lines if not re.fullmatch(r"rank [01] line \d+ end", l)]
    assert not mixed, mixed[:5]
    assert sorted(lines) == sorted(f"rank {r} line {i} end" for r in (0, 1) for i in range(3000))


def test_forked_workers_share_the_launchers_runtime(once):
    # The launcher has imported torch and torchspmd; its forks share those pages, so a worker's
    # own (private) memory after use_spmd() is a fraction of a new Python's (measured here:
    # ~10 MB against ~185 MB). The runs are test_workers_run_the_program_as_python_would's.
    private = {}
    for start in ("fork", "subprocess"):
        _, r = _program_run(once, start, as_module=False)
        assert r.returncode == 0, r.stderr
        private[start] = [float(w["private_mb"]) for w in _workers(r).values()]
    assert len(private["fork"]) == len(private["subprocess"]) == 2, private
    assert max(private["fork"]) < 0.5 * min(private["subprocess"]), private


AFFINITY = textwrap.dedent(
    """
    import os, sys, torchspmd as ts
    ts.use_spmd()
    sys.stdout.write(f"rank {ts.global_ordinal()} cores {' '.join(map(str, sorted(os.sched_getaffinity(0))))}\\n")
    sys.stdout.flush()
    """
)


def _cores_of_ranks(tmp_path, nproc, **env):
    p = tmp_path / "affinity.py"
    p.write_text(AFFINITY)
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(nproc), str(p)],
             TORCHSPMD_ALL_RANKS_OUTPUT=1, **env)
    assert r.returncode == 0, r.stderr
    found = {int(l.split()[1]): [int(c) for c in l.split()[3:]] for l in r.stdout.splitlines() if " cores " in l}
    assert sorted(found) == list(range(nproc)), r.stdout
    return [found[rank] for rank in range(nproc)]


@pytest.mark.parametrize("nproc", [2, 4])
def test_forked_workers_run_on_their_share_of_the_cores(tmp_path, nproc):
    # Each worker runs on its own share of the launcher's cores (consecutive, in rank order;
    # with more workers than cores, an equal number of workers per core), not on all of them.
    launcher = sorted(os.sched_getaffinity(0))
    shares = _cores_of_ranks(tmp_path, nproc)
    if nproc <= len(launcher):
        assert [c for share in shares for c in share] == launcher, shares  # disjoint, in order, all used
        assert max(map(len, shares)) - min(map(len, shares)) <= 1, shares
    else:
        assert all(len(share) == 1 for share in shares), shares
        used = [share[0] for share in shares]
        assert used == sorted(used) and set(used) <= set(launcher), shares
        counts = [used.count(c) for c in set(used)]
        assert max(counts) - min(counts) <= 1 and len(set(used)) == len(launcher), shares


@pytest.mark.parametrize("env", [{"TORCHSPMD_BIND_CORES": "0"}, {"KMP_AFFINITY": "disabled"},
                                 {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)) + 1)}],
                         ids=["switched-off", "user-placement", "more-threads-than-its-share"])
def test_workers_are_not_bound_when_the_user_chose(tmp_path, env):
    launcher = sorted(os.sched_getaffinity(0))
    assert _cores_of_ranks(tmp_path, 2, **env) == [launcher, launcher]


def test_bad_core_binding_switch_is_a_clear_error(script):
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(script)], TORCHSPMD_BIND_CORES="yes")
    assert r.returncode != 0
    assert "TORCHSPMD_BIND_CORES='yes': expected '1'" in r.stderr, r.stderr


@pytest.mark.parametrize("cores, world, expected", [
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ([0, 1, 2, 3, 4, 5, 6, 7], 3, [[0, 1], [2, 3, 4], [5, 6, 7]]),
    ([7, 2, 5], 3, [[2], [5], [7]]),
    ([0, 1], 4, [[0], [0], [1], [1]]),
    ([0, 1], 3, [[0], [0], [1]]),
    ([3], 2, [[3], [3]]),
])
def test_worker_cores(cores, world, expected):
    from torchspmd.launch.host import worker_cores

    assert [worker_cores(cores, r, world) for r in range(world)] == expected


def test_bad_start_method_is_a_clear_error(script):
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(script)],
             TORCHSPMD_START_METHOD="spawn")
    assert r.returncode != 0
    assert "TORCHSPMD_START_METHOD='spawn': expected 'fork'" in r.stderr, r.stderr


def test_an_uncaught_keyboard_interrupt_ends_a_forked_worker_as_it_ends_python(tmp_path):
    # Python ends a program that an uncaught KeyboardInterrupt stopped by SIGINT, after its
    # traceback and atexit handlers; a forked worker does the same (the oracle: `python prog.py`).
    prog = tmp_path / "prog.py"
    prog.write_text("import atexit\natexit.register(print, 'atexit ran', flush=True)\nraise KeyboardInterrupt\n")
    python = _run([sys.executable, str(prog)])
    forked = _run([sys.executable, "-c", textwrap.dedent(f"""
        import multiprocessing as mp
        from torchspmd.launch.launcher import run_program as _run_program
        p = mp.get_context("fork").Process(target=_run_program, args=({str(prog)!r},))
        p.start(); p.join()
        print("exitcode", p.exitcode)
        """)])
    assert python.returncode == -2, python.stderr
    assert forked.stdout.split() == ["atexit", "ran", "exitcode", "-2"], (forked.stdout, forked.stderr)
    assert python.stdout.split() == ["atexit", "ran"]
    for r in (python, forked):
        assert r.stderr.rstrip().endswith("KeyboardInterrupt"), r.stderr


PRELOADING = textwrap.dedent(
    """
    '''A program whose first imports are transformers'.'''
    import os, sys
    from transformers import LlamaConfig, LlamaForCausalLM
    import torchspmd as ts
    ts.use_spmd()
    with open("/proc/self/smaps_rollup") as f:  # memory only this process maps (USS)
        private = sum(int(l.split()[1]) for l in f if l.startswith(("Private_Clean:", "Private_Dirty:"))) / 1024
    print(f"rank {ts.global_ordinal()} private_mb={private:.0f}", flush=True)
    """
)


def test_the_launcher_imports_a_programs_leading_transformers_imports_once(tmp_path):
    # Forked workers find the program's first imports of transformers done by the launcher
    # (their pages shared): a worker's own memory is a fraction of what importing them itself
    # costs (measured here: 11-14 MB against 65-67 MB). TORCHSPMD_PRELOAD=0 turns it off.
    p = tmp_path / "prog.py"
    p.write_text(PRELOADING)
    private = {}
    for switch in ("1", "0"):
        r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(p)],
                 TORCHSPMD_PRELOAD=switch, TORCHSPMD_ALL_RANKS_OUTPUT=1, TORCHSPMD_START_METHOD="fork")
        assert r.returncode == 0, r.stderr
        private[switch] = [float(l.split("private_mb=")[1]) for l in r.stdout.splitlines() if "private_mb=" in l]
    assert len(private["1"]) == len(private["0"]) == 2, private
    assert max(private["1"]) < 0.5 * min(private["0"]), private


def test_preloading_stops_where_the_program_could_change_what_an_import_does(tmp_path):
    # huggingface_hub reads HF_HOME when it is imported: a program that sets it before importing
    # transformers must see its own value, not the launcher's (nothing is imported ahead of a
    # statement that is not an import); a failing import fails in the workers as in the program.
    home = tmp_path / "hf"
    p = tmp_path / "prog.py"
    p.write_text(textwrap.dedent(
        f"""
        import os
        os.environ["HF_HOME"] = {str(home)!r}
        from transformers import LlamaConfig
        import huggingface_hub.constants as c
        import torchspmd as ts
        ts.use_spmd()
        print(f"rank {{ts.global_ordinal()}} hf_home={{c.HF_HOME}}", flush=True)
        """))
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(p)], TORCHSPMD_ALL_RANKS_OUTPUT=1,
             TORCHSPMD_START_METHOD="fork", HF_HOME=str(tmp_path / "launchers"))
    assert r.returncode == 0, r.stderr
    assert sorted(l for l in r.stdout.splitlines() if "hf_home=" in l) == [
        f"rank 0 hf_home={home}", f"rank 1 hf_home={home}"], r.stdout

    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nfrom transformers import LlamaConfig, NoSuchThing\nprint('not reached')\n")
    expected = subprocess.run([sys.executable, str(bad)], capture_output=True, text=True, env=_env(), timeout=240)
    line = expected.stderr.strip().splitlines()[-1]
    assert expected.returncode == 1 and line.startswith("ImportError: cannot import name 'NoSuchThing'"), line
    r = _run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(bad)], TORCHSPMD_START_METHOD="fork")
    assert r.returncode == 1 and "not reached" not in r.stdout, r.stdout + r.stderr
    assert r.stderr.count(line) >= 2, r.stderr  # each worker's traceback ends with Python's own line


def test_rendezvous_event_names_are_torchs_without_inspecting_the_stack(monkeypatch):
    # torch's dynamic rendezvous names each event by inspect.stack() (0.18 s a call here with
    # torch and transformers imported, nine events a launch); the launcher's replacement must
    # give the names torch's own definition gives
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    from torchspmd import patches
    from torchspmd.patches import elastic

    patches.remove(elastic.QUICK_RENDEZVOUS_NAMES.name)  # (this test process may have launched already)
    torchs = rdzv.get_method_name
    try:
        elastic.quick_rendezvous_names()
        quick = rdzv.get_method_name
        elastic.quick_rendezvous_names()  # twice: replaced once
        assert rdzv.get_method_name is quick is not torchs
        assert patches.is_active(elastic.QUICK_RENDEZVOUS_NAMES.name)

        def record(name_of):  # as DynamicRendezvousHandler._record calls it: from the method it records
            return name_of()

        def next_rendezvous(name_of):
            return record(name_of)

        assert next_rendezvous(quick) == next_rendezvous(torchs) == "next_rendezvous"
        deepest = len(inspect.stack())  # from inside get_method_name: one frame more than here
        for depth in (0, 1, 3, deepest - 1, deepest, deepest + 1, 10_000, -1, -2):
            assert quick(depth) == torchs(depth), depth
        patches.remove(elastic.QUICK_RENDEZVOUS_NAMES.name)  # undone: torch's own again
        assert rdzv.get_method_name is torchs

        # a definition that is not torch's (another torch's) is left alone
        def other(depth=2):
            return "elsewhere"

        monkeypatch.setattr(rdzv, "get_method_name", other)
        elastic.quick_rendezvous_names()
        assert rdzv.get_method_name is other and not patches.is_active(elastic.QUICK_RENDEZVOUS_NAMES.name)
    finally:
        patches.remove(elastic.QUICK_RENDEZVOUS_NAMES.name)


LOOPING = textwrap.dedent(
    """
    import atexit, torch, torchspmd as ts
    ts.use_spmd()
    import torch.distributed as dist
    atexit.register(print, f"atexit ran on {dist.get_rank()}", flush=True)
    print(f"ready {dist.get_rank()}", flush=True)
    t = torch.ones(1000)
    while True:  # collectives until interrupted: a process stopped first leaves its peer mid-collective
        dist.all_reduce(t)
        t /= 2
    """
)


def test_ctrl_c_stops_the_workers_with_one_line_and_status_130(tmp_path):
    prog = tmp_path / "loop.py"
    prog.write_text(LOOPING)
    code, out, err = interrupt_when([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(prog)],
                                    lambda lines: {"ready 0", "ready 1"} <= {x.rstrip() for x in lines}, ROOT,
                                    clean_env(TORCHSPMD_ALL_RANKS_OUTPUT=1))
    assert code == 130, (out, err)
    assert "torchspmd: interrupted (SIGINT): the workers were stopped" in err, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Closing process" not in err, err
    assert "atexit ran on 0" in out and "atexit ran on 1" in out  # each program ended as Python ends one
