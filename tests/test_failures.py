"""A failed multi-process job names the process that failed first.

End to end: tiny scripts under `torchspmd run --nproc 2`; then the summary's ordering rules
on error files written by the workers' recorder (torch.distributed.elastic's format)."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import clean_env
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchspmd.launch import failures

ROOT = Path(__file__).resolve().parents[1]

HEAD = """
import os, signal, sys, threading, torch, torchspmd as ts
ts.use_spmd()
import torch.distributed as dist
rank = dist.get_rank()
"""


def _run(tmp_path, body, start="fork"):
    """``body`` under ``torchspmd run --nproc 2``, the workers started by ``start`` (forks of the
    launcher, the default, or new Python processes: TORCHSPMD_START_METHOD)."""
    script = tmp_path / "prog.py"
    script.write_text(HEAD + textwrap.dedent(body))
    env = clean_env(TORCHSPMD_START_METHOD=start)
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", str(script)],
                       capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    summary = [l for l in r.stderr.splitlines() if l.startswith("torchspmd: ")]
    return r, summary, script


def _line(script, text):
    """'path:line' of the script line containing ``text``."""
    n = next(i for i, l in enumerate(script.read_text().splitlines(), 1) if text in l)
    return f"{script}:{n}"


def _no_agent_noise(stderr):
    assert "failed (exitcode" not in stderr and "closing signal" not in stderr, stderr


@pytest.mark.parametrize("start", ["fork", "subprocess"])
def test_rank_1_raises(tmp_path, start):
    r, summary, script = _run(tmp_path, """
        if rank == 1:
            raise ValueError("bad thing 0.7313")
        dist.barrier()
    """, start)
    assert r.returncode == 1, r.stderr
    assert "[rank1]: ValueError: bad thing 0.7313" in r.stderr  # its traceback is kept
    assert summary[0] == (f"torchspmd: rank 1 failed: ValueError: bad thing 0.7313 (at {_line(script, 'raise')}); "
                          f"its traceback is printed above, in lines starting [rank1]:"), r.stderr
    # rank 0 lost its connection in the barrier, or was stopped by the launcher first
    assert len(summary) == 2 and summary[1].startswith("torchspmd: rank 0 "), summary
    assert "after rank 1 failed" in summary[1], summary
    _no_agent_noise(r.stderr)


def test_rank_0_raises(tmp_path):
    r, summary, _ = _run(tmp_path, """
        if rank == 0:
            raise KeyError("missing 0.2451")
        dist.barrier()
    """)
    assert r.returncode == 1, r.stderr
    assert summary[0].startswith("torchspmd: rank 0 failed: KeyError: 'missing 0.2451' (at "), r.stderr
    assert len(summary) == 2 and summary[1].startswith("torchspmd: rank 1 ") and "after rank 0 failed" in summary[1]


def test_a_rank_stopped_by_the_launcher_is_a_consequence(tmp_path):
    r, summary, _ = _run(tmp_path, """
        dist.barrier()
        if rank == 1:
            raise RuntimeError("rank one 0.5912")
        threading.Event().wait()  # until the launcher stops this process
    """)
    assert r.returncode == 1, r.stderr
    assert len(summary) == 2, r.stderr
    assert summary[0].startswith("torchspmd: rank 1 failed: RuntimeError: rank one 0.5912 (at "), summary
    assert summary[1] == "torchspmd: rank 0 was stopped (SIGTERM) after rank 1 failed", summary
    _no_agent_noise(r.stderr)


def test_the_same_error_on_every_rank(tmp_path):
    # Decision: the summary names the rank that raised first, and says the others failed
    # with the same error (a rank the launcher stopped before it raised is listed as stopped).
    r, summary, _ = _run(tmp_path, """
        dist.barrier()
        raise ValueError(f"bad input: batch size 3 is not divisible by {dist.get_world_size()}")
    """)
    assert r.returncode == 1, r.stderr
    assert len(summary) == 2, r.stderr
    first = int(summary[0].split()[2])
    assert summary[0].startswith(f"torchspmd: rank {first} failed: ValueError: bad input: batch size 3 is not "
                                 f"divisible by 2 (at "), summary
    assert summary[1] in (f"torchspmd: rank {1 - first} failed with the same error",
                          f"torchspmd: rank {1 - first} was stopped (SIGTERM) after rank {first} failed"), summary


@pytest.mark.parametrize("start", ["fork", "subprocess"])
@pytest.mark.parametrize("how, code, said", [
    ("os._exit(3)", 3, "torchspmd: rank 1 exited with code 3 and recorded no exception"),
    ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9, "torchspmd: rank 1 was killed by SIGKILL"),
])
def test_death_inside_a_collective_ends_the_job(tmp_path, how, code, said, start):
    r, summary, _ = _run(tmp_path, f"""
        t = torch.randn(8)
        dist.all_reduce(t)
        if rank == 1:
            {how}
        dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
        threading.Event().wait()
    """, start)
    assert r.returncode == code, r.stderr
    assert summary[0].startswith(said), r.stderr
    assert summary[1].startswith("torchspmd: rank 0 ") and "after rank 1 failed" in summary[1]
    # a SIGKILL nobody explains gets the out-of-memory hint (no OOM kill was counted: "most likely")
    hints = [line for line in summary[2:] if line.startswith("torchspmd: most likely the kernel's out-of-memory")]
    assert len(summary) == 2 + len(hints) and len(hints) == ("SIGKILL" in how), r.stderr


SHARED = """
    import functools, numpy as np, torch.nn as nn, torch.nn.functional as F
    from torchspmd.engines.native.communication import gradient_sums

    WHERE = False

    def die(*args):
        if rank == 1 and WHERE:
            os._exit(3)

    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if "KIND" == "fsdpv2":  # rank 1 dies as the second unit gathers its parameters (shared memory)
        mesh = ts.Mesh(np.arange(2), (2,), ("fsdp",))
        net = ts.FSDPv2(net, mesh, auto_wrap_policy=functools.partial(
            ts.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}), collectives="shm")
        net[2].register_forward_pre_hook(die, prepend=True)  # (before FSDP2 gathers: rank 0 is inside)
    else:  # Pattern 1: rank 1 dies inside DDP's hook, after its row of the shared buffer is written
        mesh = ts.Mesh(np.arange(2), (2,), ("data",))
        original = gradient_sums.SharedMemorySum._meet
        gradient_sums.SharedMemorySum._meet = lambda self: (die(), original(self))
    spec = ts.ShardingSpec(mesh, (mesh.axis_names[0], None))
    for step in range(3):
        WHERE = step == 2
        x = ts.shard_batch(torch.randn(6, 4), spec)
        F.mse_loss(net(x), ts.shard_batch(torch.randn(6, 2), spec)).backward()
    threading.Event().wait()
"""


@pytest.mark.parametrize("kind", ["fsdpv2", "ddp-hook"])
def test_a_process_that_dies_inside_a_shared_memory_collective_ends_the_job(tmp_path, kind):
    """The shared-memory transport's waits (gloo's barriers around FSDPv2's gather, the
    step's sums polling the shared memory inside DDP's hook) notice a peer that is gone."""
    r, summary, _ = _run(tmp_path, SHARED.replace("KIND", kind))
    assert r.returncode == 3, r.stderr
    assert summary[0].startswith("torchspmd: rank 1 exited with code 3 and recorded no exception"), r.stderr
    assert summary[1].startswith("torchspmd: rank 0 ") and "after rank 1 failed" in summary[1], summary


PIPELINE = """
    import numpy as np, torch.nn as nn, torch.nn.functional as F

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(4))  # (two stages a process: interleaved)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    step = 0

    def loss_fn(out, y):  # runs on the last stage (rank 1), once per micro-batch
        if step == 2:
            FAIL
        return F.mse_loss(out, y)

    mesh = ts.Mesh(np.arange(2), (2,), ("pipeline",))
    runner = ts.pipeline(Net(), mesh, split=Layer, microbatches=2, schedule="SCHEDULE")
    for step in range(1, 4):
        runner.step(torch.randn(4, 4), torch.randn(4, 2), loss_fn)
    threading.Event().wait()
"""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
@pytest.mark.parametrize("fail, said", [
    ('raise ValueError("stage failed 0.8812")', "torchspmd: rank 1 failed: ValueError: stage failed 0.8812 (at "),
    ("os.kill(os.getpid(), signal.SIGKILL)", "torchspmd: rank 1 was killed by SIGKILL"),
], ids=["raises", "killed"])
def test_a_stage_that_fails_mid_schedule_ends_the_job(tmp_path, schedule, fail, said):
    # rank 0 (the first stage) waits mid-schedule for rank 1's activations' gradients
    r, summary, _ = _run(tmp_path, PIPELINE.replace("FAIL", fail).replace("SCHEDULE", schedule))
    assert r.returncode != 0, r.stderr
    assert summary and summary[0].startswith(said), r.stderr
    assert any(line.startswith("torchspmd: rank 0 ") and "after rank 1 failed" in line for line in summary[1:]), summary


# --- the ordering rules, on records written by the workers' recorder ------------------


def _record(tmp_path, monkeypatch, name, exc):
    """The error file a worker's recorder writes for ``exc`` raised now."""
    path = tmp_path / f"{name}.json"
    monkeypatch.setenv(failures.ERROR_FILE_ENV, str(path))
    try:
        raise exc
    except BaseException as e:
        failures._Recorder().record_exception(e)
    return str(path)


GLOO = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    "[127.0.0.1]:41234. This is typically caused by a remote worker crashing.")


def test_first_by_recorded_time_not_by_rank(tmp_path, monkeypatch):
    late_rank_first = _record(tmp_path, monkeypatch, "r3", ValueError("bad shape 0.83"))
    early_rank_later = _record(tmp_path, monkeypatch, "r0", ValueError("bad shape 0.83"))
    other = _record(tmp_path, monkeypatch, "r1", TypeError("not a tensor"))
    text, code = failures.summarize({0: ProcessFailure(0, 100, 1, early_rank_later),
                                    1: ProcessFailure(1, 101, 1, other),
                                    3: ProcessFailure(3, 103, 1, late_rank_first)})
    lines = text.splitlines()
    assert lines[0].startswith("torchspmd: rank 3 failed: ValueError: bad shape 0.83 (at " + __file__), lines
    assert lines[1:] == ["torchspmd: rank 0 failed with the same error",
                         "torchspmd: rank 1 also failed: TypeError: not a tensor"]
    assert code == 1
    record = json.loads(Path(late_rank_first).read_text())["message"]  # still torch's format
    assert record["message"] == "ValueError: bad shape 0.83" and "Traceback" in record["extraInfo"]["py_callstack"]


def test_a_lost_connection_is_a_consequence_even_when_recorded_first(tmp_path, monkeypatch):
    lost = _record(tmp_path, monkeypatch, "r0", GLOO)
    cause = _record(tmp_path, monkeypatch, "r1", ValueError("bad thing"))
    text, code = failures.summarize({0: ProcessFailure(0, 100, 1, lost), 1: ProcessFailure(1, 101, 1, cause)})
    assert text.splitlines()[0].startswith("torchspmd: rank 1 failed: ValueError: bad thing"), text
    assert text.splitlines()[1] == ("torchspmd: rank 0 failed after rank 1 failed: RuntimeError: Connection closed "
                                    "by peer [127.0.0.1]:41234 (a lost connection)")


def test_a_peer_lost_in_shared_memory_sums_is_a_consequence(tmp_path, monkeypatch):
    from torchspmd.errors import PeerLost

    lost = _record(tmp_path, monkeypatch, "r0", PeerLost("torchspmd: process 1 (pid 7) ended while this one waited "
                                                         "for it to start a sum; its own error says why"))
    none = str(tmp_path / "absent.json")
    text, _ = failures.summarize({0: ProcessFailure(0, 100, 1, lost), 1: ProcessFailure(1, 101, -9, none)})
    assert text.splitlines()[:2] == [
        "torchspmd: rank 1 was killed by SIGKILL",
        ("torchspmd: rank 0 failed after rank 1 failed: PeerLost: torchspmd: process 1 (pid 7) ended while this one "
         "waited for it to start a sum; its own error says why (a lost connection)")], text


def test_exits_without_a_record(tmp_path, monkeypatch):
    lost = _record(tmp_path, monkeypatch, "r0", GLOO)
    none = str(tmp_path / "absent.json")
    text, code = failures.summarize({0: ProcessFailure(0, 100, 1, lost), 1: ProcessFailure(1, 101, -9, none),
                                    2: ProcessFailure(2, 102, -signal.SIGTERM, none),
                                    3: ProcessFailure(3, 103, 1, none)}, stopped_pids={102, 103})
    assert text.splitlines() == [
        "torchspmd: rank 1 was killed by SIGKILL",
        "torchspmd: rank 0 failed after rank 1 failed: RuntimeError: Connection closed by peer [127.0.0.1]:41234 "
        "(a lost connection)",
        "torchspmd: rank 2 was stopped (SIGTERM) after rank 1 failed",
        "torchspmd: rank 3 was stopped (exit code 1) after rank 1 failed",
        failures.out_of_memory_hint(False)]
    assert code == 137
    # Without the agent's word on whom it stopped, SIGTERM means stopped by the launcher.
    text, code = failures.summarize({0: ProcessFailure(0, 100, -signal.SIGTERM, none),
                                    1: ProcessFailure(1, 101, 3, none)})
    assert text.splitlines()[0].startswith("torchspmd: rank 1 exited with code 3 and recorded no exception"), text
    assert text.splitlines()[1] == "torchspmd: rank 0 was stopped (SIGTERM) after rank 1 failed" and code == 3


def test_a_kill_by_the_oom_killer_says_what_fixes_it(tmp_path, monkeypatch):
    none = str(tmp_path / "absent.json")
    events = tmp_path / "memory.events"
    monkeypatch.setattr(failures, "MEMORY_EVENTS", str(events))
    events.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    start = failures.oom_kills()
    events.write_text("low 0\nhigh 0\nmax 4\noom 3\noom_kill 3\n")  # the run's process was the third
    text, _ = failures.summarize({0: ProcessFailure(0, 100, -signal.SIGKILL, none),
                                  1: ProcessFailure(1, 101, -signal.SIGTERM, none)}, stopped_pids={101},
                                 oom_kills_at_start=start)
    last = text.splitlines()[-1]
    assert start == 2 and last == failures.out_of_memory_hint(True), text
    assert "out-of-memory killer ended it" in last and "checkpoint_module" in last and "torchspmd plan" in last
    # no kill counted (another signal sender, or a machine that does not say): "most likely"
    text, _ = failures.summarize({0: ProcessFailure(0, 100, -signal.SIGKILL, none)}, oom_kills_at_start=3)
    assert "most likely the kernel's out-of-memory killer" in text.splitlines()[-1]
    # a process that failed with an error gets no such line
    events.unlink()
    assert failures.oom_kills() is None


def test_only_lost_connections_say_so(tmp_path, monkeypatch):
    lost = _record(tmp_path, monkeypatch, "r0", GLOO)
    text, code = failures.summarize({0: ProcessFailure(0, 100, 1, lost)})
    assert text.splitlines()[1] == ("torchspmd: rank 0 lost its connection to another process: that process (on "
                                    "another host, or not started by this launcher) probably failed first"), text


def test_an_error_the_cli_prints_is_summarised_as_printed(tmp_path):
    # A setting error inside every worker: rank 0 prints it as one line, the others only
    # record it; the job exits 2 and the summary does not repeat it or promise a traceback.
    r, summary, _ = _run(tmp_path, """
        from torchspmd.cli import main
        sys.exit(main(["export", str(os.path.join(os.path.dirname(__file__), "no-such-checkpoint")),
                       str(os.path.join(os.path.dirname(__file__), "exported"))]))
    """)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    message = "no-such-checkpoint: not a torchspmd checkpoint (or an output directory holding one)"
    # once: by rank 0, or by the summary when rank 1 ended first and the launcher stopped rank 0
    # before it printed (seen with the machine loaded)
    assert r.stderr.count(message) == 1, r.stderr
    if summary[0].startswith("torchspmd: rank "):
        assert summary[0].startswith("torchspmd: rank 1 failed: SpmdError: ") and message in summary[0], summary
        assert "printed above" not in summary[0], summary  # no traceback promised, none printed
        assert len(summary) == 2 and summary[1].startswith("torchspmd: rank 0 "), summary
        return
    assert summary[0].endswith(message), summary
    assert len(summary) == 3, summary
    assert summary[1].startswith("torchspmd: rank ") and summary[1].endswith(
        "failed: SpmdError (its message is printed above)"), summary
    first = int(summary[1].split()[2])
    # the other rank failed too, or the launcher stopped it before it raised (seen in CI), as
    # in test_the_same_error_on_every_rank
    assert summary[2] in (f"torchspmd: rank {1 - first} failed with the same error",
                          f"torchspmd: rank {1 - first} was stopped (SIGTERM) after rank {first} failed"), summary


def test_an_error_one_worker_prints_alone_is_in_the_summary(tmp_path):
    # Only rank 1 fails with a printed error: rank 1 does not print it (rank 0 prints for all),
    # so the summary carries the message.
    r, summary, _ = _run(tmp_path, """
        from torchspmd.cli import main
        if rank == 1:
            sys.exit(main(["export", str(os.path.join(os.path.dirname(__file__), "no-such-checkpoint")),
                           str(os.path.join(os.path.dirname(__file__), "exported"))]))
        dist.barrier()
    """)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("no-such-checkpoint: not a torchspmd checkpoint") == 1, r.stderr
    assert summary[0].startswith("torchspmd: rank 1 failed: SpmdError: "), summary
    assert "no-such-checkpoint: not a torchspmd checkpoint" in summary[0] and "printed above" not in summary[0]
    assert "after rank 1 failed" in summary[1], summary
