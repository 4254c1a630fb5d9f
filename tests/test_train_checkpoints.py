"""Checkpoints of `torchspmd train` that survive kills, and clear errors for bad ones.

A process is SIGKILLed at each moment of a save (inside the shard writes, just before and
just after the rename that completes a checkpoint) and the job is started again with the
same command: the last good checkpoint must be whole (equal to the never-interrupted run's
checkpoint of that step) and the resumed run must equal the never-interrupted run. The job
is deterministic on the same number of processes, so "equal" is exact (rtol = atol = 0):
every loss, every weight, every optimizer moment. Checkpoints are read back with torch's
own `dcp_to_torch_save` (in a process that never imports torchspmd: _helpers.dcp_states),
not with torchspmd's loader.

The runs resume after warm-up (inside the cosine decay) with gradient accumulation.
"""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _helpers import assert_identical, clean_env, dcp_states
from test_train import ROOT, SMALL, losses, train

# 6 steps of 2 micro-batches, warm-up over the first 2: steps 3-6 are in the cosine decay.
# A checkpoint every 2 steps; keep 1, so every save also prunes the one before it.
# Dropout makes the losses depend on the random state, which a resume must restore as it was.
ARGS = ["--optim.max_steps", "6", "--optim.warmup_steps", "2", "--optim.grad_accum", "2",
        "--checkpoint.every", "2", "--checkpoint.keep", "1", "--model.dropout", "0.1"]
KILL_IN_SAVE = "TORCHSPMD_FAULT_KILL_IN_SAVE"


def ck(out: Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:08d}"


def entries(out: Path, sub: str = "checkpoints") -> list[str]:
    return sorted(p.name for p in (Path(out) / sub).iterdir())


def full_states(*checkpoints: Path) -> list[dict]:
    """Checkpoints as torch's DCP utility assembles them (whole tensors: model, optimizer),
    each with its state.pt (step, scheduler, RNG state, sampler position)."""
    return [{"dcp": dcp, "state.pt": torch.load(c / "state.pt", weights_only=False)}
            for c, dcp in zip(checkpoints, dcp_states(*checkpoints))]


def _straight(out: Path) -> None:
    train(out, *ARGS, "--checkpoint.keep", "0")
    assert entries(out) == [f"step-0000000{s}" for s in (2, 4, 6)]


@pytest.fixture(scope="module")
def straight(once):
    """The never-interrupted run, every checkpoint kept (made once for all the test
    runners: ``once`` in conftest.py; the tests read it)."""
    return once("checkpoints-straight", _straight)[0]


def test_the_runs_resume_inside_the_cosine_decay(straight):
    # the learning rate logged at step s is the one step s + 1 uses: the peak for steps 2 and 3,
    # then the cosine decay; the runs below resume at steps 2 and 4
    with open(straight / "metrics.csv") as f:
        lr = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    assert lr[1] == lr[2] == 3e-3 and lr[2] > lr[3] > lr[4] > lr[5] > lr[6] == pytest.approx(3e-4)


# What the checkpoint directory holds right after the kill, and the last good checkpoint.
AFTER_KILL = {
    # rank 1 dies once its shard file is written: the new checkpoint has shards, no index
    "shards": ([".step-00000004.tmp", "step-00000002"], 2),
    # rank 0 dies with the new checkpoint complete but still under its temporary name
    "before-rename": ([".step-00000004.tmp", "step-00000002"], 2),
    # rank 0 dies once the new checkpoint is in place, before the old one is pruned
    "after-rename": (["step-00000002", "step-00000004"], 4),
}


@pytest.mark.parametrize("point", list(AFTER_KILL))
def test_killed_inside_a_save_resumes_exactly(tmp_path, straight, point):
    out = tmp_path / "run"
    r = train(out, *ARGS, env={KILL_IN_SAVE: f"4:{point}"}, check=False)
    assert r.returncode != 0
    assert sorted(losses(out)) == [1, 2, 3, 4]  # it died in the save of step 4, not before
    names, good = AFTER_KILL[point]
    assert entries(out) == names
    tmp = out / "checkpoints" / ".step-00000004.tmp"
    if point == "shards":
        assert list(tmp.glob("*.distcp")) and not (tmp / ".metadata").exists() and not (tmp / "state.pt").exists()
    if point == "before-rename":
        assert (tmp / ".metadata").exists() and (tmp / "state.pt").exists()
    # the last good checkpoint is whole: the straight run's checkpoint of that step, bit for bit
    assert_identical(*full_states(ck(out, good), ck(straight, good)))
    if point == "before-rename":  # what it leaves is what "shards" leaves (a temporary folder, the last good
        return  # checkpoint whole): the resume from it is the one "shards" checks
    r = train(out, *ARGS)  # the same command again (checkpoint.resume = 'auto')
    assert f"resumed from {ck(out, good)} at step {good}" in r.stdout
    assert ("removed the unfinished checkpoint(s) .step-00000004.tmp" in r.stdout) == (point != "after-rename")
    assert entries(out) == ["step-00000006"]  # the leftovers are gone, the old checkpoints pruned
    assert losses(out) == losses(straight)
    assert_identical(*full_states(ck(out, 6), ck(straight, 6)))


def test_killed_process_in_the_cosine_decay_restarts_and_resumes_exactly(tmp_path, straight):
    # torchrun restarts the job after rank 1 is killed after step 5; it resumes from step 4
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "2", "--max-restarts", "1", "-m", "torchspmd.cli",
           "train", "--out-dir", str(out), *SMALL, *ARGS]
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(TORCHSPMD_FAULT_KILL_AT_STEP=5),
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"resumed from {ck(out, 4)} at step 4" in r.stdout
    assert losses(out) == losses(straight)
    assert_identical(*full_states(ck(out, 6), ck(straight, 6)))


def test_the_next_start_removes_what_interrupted_saves_left(tmp_path):
    from torchspmd import checkpoint as ckpt

    def make(name: str, text: str = "") -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_text(text or name)

    make("step-00000002")
    make(".step-00000003.pruned")  # pruning was interrupted
    make(".step-00000004.tmp")  # a save was interrupted
    make(".step-00000005.replaced", "old 5")  # set aside for a new step 5 that never arrived: put back
    make(".step-00000006.replaced", "old 6")  # set aside and replaced: dropped
    make("step-00000006", "new 6")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000002", "step-00000006"]
    assert ckpt.clean(tmp_path) == [".step-00000003.pruned", ".step-00000004.tmp", ".step-00000006.replaced"]
    assert entries(tmp_path, "") == ["step-00000002", "step-00000005", "step-00000006"]
    assert (tmp_path / "step-00000005" / "state.pt").read_text() == "old 5"
    assert (tmp_path / "step-00000006" / "state.pt").read_text() == "new 6"


# --- bad checkpoints: clear errors, on every process ---------------------------------------

def _garbage(f: Path) -> None:
    f.write_bytes(os.urandom(f.stat().st_size))  # same size: only reading it finds out


def _truncate(f: Path) -> None:
    with open(f, "r+b") as h:
        h.truncate(f.stat().st_size // 2)


def _touch(path: str) -> None:
    Path(path).touch()


class _RunsCode:
    """Unpickling it would call _touch: a state.pt that runs code when it is loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (_touch, (self.path,))


def _state_that_runs_code(p: Path) -> None:
    torch.save({"step": 1, "x": _RunsCode(p / "ran")}, p / "state.pt")


def _flip_a_bit(f: Path) -> None:  # the same size: only the checksum can tell
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _without_checksums(damage):
    """``damage`` to a checkpoint written before checksums.json (what its readers find)."""
    def apply(p: Path) -> None:
        (p / "checksums.json").unlink()
        damage(p)
    return apply


DAMAGE = {
    "flipped bit in a shard": (lambda p: _flip_a_bit(p / "__1_0.distcp"),
                               "is corrupt: the file __1_0.distcp has changed since it was written (its SHA-256 is "
                               "not the one in checksums.json)"),
    "flipped bit in the state": (lambda p: _flip_a_bit(p / "state.pt"),
                                 "is corrupt: the file state.pt has changed since it was written"),
    "garbage checksums": (lambda p: _garbage(p / "checksums.json"), "is corrupt: checksums.json cannot be read"),
    "garbage shard": (_without_checksums(lambda p: _garbage(p / "__1_0.distcp")),
                      "is corrupt: the shard file __1_0.distcp cannot be read"),
    "truncated shard": (lambda p: _truncate(p / "__0_0.distcp"),
                        "is corrupt: the shard file __0_0.distcp is truncated"),
    "missing shard": (lambda p: (p / "__1_0.distcp").unlink(),
                      "is incomplete: the shard file __1_0.distcp is missing"),
    "missing metadata": (lambda p: (p / ".metadata").unlink(), "is incomplete: .metadata"),
    "garbage metadata": (lambda p: _garbage(p / ".metadata"), "is corrupt: .metadata cannot be read"),
    "missing state": (lambda p: (p / "state.pt").unlink(), "is incomplete: state.pt"),
    "garbage state": (_without_checksums(lambda p: _garbage(p / "state.pt")), "is corrupt: state.pt cannot be read"),
    # read with weights_only=True: refused, nothing run (a loaded one would have made the file)
    "state that runs code": (_without_checksums(_state_that_runs_code), "_touch, which is not read back"),
}


def _save_damage_load(root: str, damage: str) -> str:
    """On every rank: save a small FSDPv2 model and its AdamW state, damage the checkpoint
    (rank 0), load it; return the error message."""
    import numpy as np
    import torch.distributed as dist

    import torchspmd as ts
    from torchspmd import checkpoint as ckpt

    torch.manual_seed(0)
    mesh = ts.Mesh(np.arange(2), (2,), ("fsdp",))
    model = ts.FSDPv2(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    path = ckpt.save(root, 1, model, opt, {"step": 1}, "")
    if dist.get_rank() == 0 and damage in DAMAGE:
        DAMAGE[damage][0](path)
    dist.barrier()
    try:
        ckpt.load(path if damage in DAMAGE else Path(root) / "step-00000002", model, opt)
    except ckpt.BadCheckpoint as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("damage", [*DAMAGE, "no such directory"])
def test_a_bad_checkpoint_raises_a_clear_error_on_every_process(dist, tmp_path, damage):
    messages = dist(2).run(_save_damage_load, str(tmp_path / "ck"), damage)
    expected = DAMAGE[damage][1] if damage in DAMAGE else "step-00000002: no such directory"
    path = tmp_path / "ck" / ("step-00000001" if damage in DAMAGE else "step-00000002")
    for m in messages:
        assert m.startswith(f"checkpoint {path}") and expected in m, messages
    assert not (path / "ran").exists()


def test_a_metadata_file_that_asks_for_a_huge_memo_is_refused_before_it_is_unpickled(tmp_path):
    # A damaged .metadata whose first bytes are a pickle opcode storing at memo index 2**26:
    # Python's unpickler would fill a 1 GB memo before reading on (with a larger index,
    # enough to have the process killed for memory; a random garbage file did that once).
    # The check reads the opcodes first and refuses it, in another process so that its
    # peak memory can be read.
    ck = tmp_path / "step-00000001"
    ck.mkdir()
    (ck / ".metadata").write_bytes(b"\x80\x04N" + b"r" + (2**26).to_bytes(4, "little") + bytes(64))
    (ck / "state.pt").write_bytes(b"")
    code = f"""
import resource
from torchspmd.checkpoint import BadCheckpoint, check
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    check({str(ck)!r})
except BadCheckpoint as e:
    print(e)
print("grew_mb", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoint {ck} is corrupt: .metadata cannot be read (UnpicklingError" in r.stdout, r.stdout
    assert float(r.stdout.split("grew_mb")[1]) < 100, r.stdout


FIX = ("; delete that directory to resume from the checkpoint before it, or set checkpoint.resume to another "
       "checkpoint directory (or 'none' to start over)")


def _job_error(r: subprocess.CompletedProcess) -> str:
    """The failed job's error output, with no traceback in it. (Each process that raises the
    error prints it, and two processes' lines can run together on the shared stderr.)"""
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    return r.stderr


@pytest.mark.parametrize("damage", ["garbage shard", "missing metadata"])
def test_resuming_from_a_bad_checkpoint_stops_with_the_path_and_the_fix(tmp_path, straight, damage):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    bad = ck(out, 6)
    shutil.copytree(ck(straight, 4), ck(out, 4))
    shutil.copytree(ck(straight, 6), bad)
    DAMAGE[damage][0](bad)
    err = _job_error(train(out, *ARGS, "--optim.max_steps", "8", check=False))
    assert f"torchspmd: checkpoint.resume = 'auto': checkpoint {bad} {DAMAGE[damage][1]}" in err, err[-3000:]
    assert FIX in err, err[-3000:]
    if damage == "garbage shard":  # following the advice resumes from the checkpoint before it
        shutil.rmtree(bad)
        r = train(out, *ARGS, "--optim.max_steps", "5")
        assert f"resumed from {ck(out, 4)} at step 4" in r.stdout


def test_resuming_from_a_missing_path_stops_with_the_setting_and_the_fix(tmp_path):
    err = _job_error(train(tmp_path, *ARGS, "--checkpoint.resume", str(tmp_path / "nope"), check=False))
    assert (f"torchspmd: checkpoint.resume = '{tmp_path / 'nope'}': no such checkpoint directory; give a "
            f"step-NNNNNNNN directory under a job's out_dir/checkpoints, 'auto' (the newest in out_dir, if any) "
            f"or 'none'") in err, err[-3000:]


def _resumable(tmp_path: Path, straight: Path, steps=(2, 4)) -> Path:
    """A job directory holding copies of the straight run's checkpoints ``steps``."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    for s in steps:
        shutil.copytree(ck(straight, s), ck(out, s))
    return out


def test_resuming_from_a_job_directory_names_its_newest_checkpoint_and_deletes_nothing(tmp_path, straight):
    # the job's own directory given by hand: following "delete that directory" would delete the run
    out = _resumable(tmp_path, straight)
    err = _job_error(train(tmp_path / "other", *ARGS, "--checkpoint.resume", str(out), check=False))
    assert (f"torchspmd: checkpoint.resume = '{out}': checkpoint {out} is not a torchspmd checkpoint (it has neither "
            f".metadata nor state.pt); checkpoints are the step-NNNNNNNN directories under a job's "
            f"out_dir/checkpoints: the newest under it is {ck(out, 4)}") in err, err[-3000:]
    assert "delete" not in err, err[-3000:]


def test_a_damaged_checkpoint_given_by_hand_points_at_another_step(tmp_path, straight):
    out = _resumable(tmp_path, straight)
    bad = ck(out, 4)
    DAMAGE["truncated shard"][0](bad)
    err = _job_error(train(tmp_path / "other", *ARGS, "--checkpoint.resume", str(bad), check=False))
    assert (f"torchspmd: checkpoint.resume = '{bad}': checkpoint {bad} {DAMAGE['truncated shard'][1]}") in err, \
        err[-3000:]
    assert (f"; point checkpoint.resume at another step-NNNNNNNN directory (the one before it is {ck(out, 2)}), "
            f"or set it to 'none' to start over") in err, err[-3000:]
    assert "delete" not in err, err[-3000:]


def test_resuming_a_checkpoint_of_more_layers_stops_with_the_weight_and_the_fix(tmp_path, straight):
    # it loaded the weights it had room for, then failed with a KeyError (a traceback)
    out = _resumable(tmp_path, straight, steps=(4,))
    err = _job_error(train(out, *ARGS, "--model.num_layers", "1", check=False))
    assert (f"torchspmd: checkpoint.resume = 'auto': checkpoint {ck(out, 4)}: it has weights for "
            f"'model.layers.1.") in err, err[-3000:]
    assert ("which this model does not have; it was saved from another model (one with more layers or modules); the "
            "job that saved it had other [model] settings (in its config.toml): resume with those, or start this job "
            "in another out_dir") in err, err[-3000:]
    assert FIX not in err


def test_resuming_with_other_model_settings_of_the_same_shapes_is_refused(tmp_path, straight):
    # 2 heads instead of 4 over the same projections: the weights load, into another network
    out = _resumable(tmp_path, straight, steps=(4,))
    err = _job_error(train(out, *ARGS, "--model.num_heads", "2", check=False))
    assert (f"torchspmd: checkpoint.resume = 'auto': checkpoint {ck(out, 4)} was saved with model.num_heads = 4 "
            f"(its config.toml) and this job has model.num_heads = 2: the weights load, but into another network; "
            f"resume with model.num_heads = 4, or start this job in another out_dir") in err, err[-3000:]


def test_resuming_with_another_seed_and_optimizer_settings(tmp_path, straight):
    # another seed: a warning. Another lr, weight decay, betas: this job's are used (and said); the
    # checkpoint's were kept, while config.toml showed this job's.
    import math
    import pickle

    out = _resumable(tmp_path, straight, steps=(4,))
    r = train(out, *ARGS, "--seed", "1", "--optim.lr", "0.001", "--optim.weight_decay", "0.05",
              "--optim.beta2", "0.99")
    assert f"resumed from {ck(out, 4)} at step 4" in r.stdout
    assert (f"torchspmd: warning: checkpoint {ck(out, 4)} was saved with seed = 0 and this job has seed = 1: it "
            f"resumes, but does not continue the saved run exactly") in r.stderr, r.stderr[-3000:]
    assert ("resuming with this job's optim.lr = 0.001 (the checkpoint's: 0.003), optim.weight_decay = 0.05 (the "
            "checkpoint's: 0.1), optim.beta2 = 0.99 (the checkpoint's: 0.95)") in r.stdout, r.stdout[-3000:]

    def lr(step):  # after `step` steps: warm-up over 2 steps, then cosine over 6 to 0.1 of the peak
        return 0.001 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 2) / 4)))

    with open(out / "metrics.csv") as f:
        rows = {int(row["step"]): float(row["lr"]) for row in csv.DictReader(f)}
    assert rows.keys() == {5, 6}
    for step in rows:
        assert rows[step] == pytest.approx(lr(step), rel=1e-12)
    saved, = full_states(ck(out, 6))
    groups = saved["dcp"]["optim"]["param_groups"]
    groups = pickle.loads(groups) if isinstance(groups, bytes) else groups
    assert [x for g in groups for x in (g["lr"], g["weight_decay"], *g["betas"])] == pytest.approx(
        [lr(6), 0.05, 0.9, 0.99, lr(6), 0.0, 0.9, 0.99], rel=1e-12)


def test_ctrl_c_says_where_the_job_stands_and_which_checkpoint_continues_it(tmp_path):
    # Ctrl-C reaches the launcher and every worker: one line from the job (its newest
    # checkpoint), one from the launcher, status 130; no traceback from any process
    import re as _re

    from _helpers import interrupt_when

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torchspmd.cli", "train", "--out-dir", str(out), *SMALL, "--optim.max_steps", "10000",
           "--checkpoint.every", "1", "--checkpoint.keep", "2", "--logging.every", "1", "--logging.sample_tokens", "0"]

    def two_steps(lines):
        return any(_re.match(r"step\s+2\b", x) for x in lines)

    code, stdout, err = interrupt_when(cmd, two_steps, ROOT, clean_env())
    assert code == 130, (stdout[-2000:], err[-4000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    said = [x for x in err.splitlines() if x.startswith("torchspmd train: interrupted after step")]
    assert len(said) == 1 and f"the newest checkpoint is {newest}:" in said[0], err
    assert err.rstrip().endswith("torchspmd: interrupted (SIGINT): the workers were stopped"), err
