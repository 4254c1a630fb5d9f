"""`torchspmd train --mesh.model N`: the default job (a transformers Llama) computing
tensor-parallel over a 'model' axis, against the same job without one.

The 1D job (FSDP over every device) is the reference: test_train_oracle checks it against
one process of plain transformers. Its checkpoints are read back with torch's own DCP
utility, which shares nothing with torchspmd.
"""

import csv
from pathlib import Path

import pytest
import torch
from _helpers import clean_env, dcp_states
from safetensors.torch import load_file
from test_train import ROOT, losses, train

# a checkpoint at every step, all kept: the jobs' weights, AdamW moments and gradients are compared at every step
STEPS = 4
ARGS = ["--optim.max_steps", str(STEPS), "--optim.warmup_steps", "2", "--checkpoint.every", "1", "--checkpoint.keep",
        "0"]
BETA1 = 0.9  # the job's AdamW beta1 (optim.beta1's default)


def ck(out: Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:08d}"


# Weights after AdamW steps: rtol 1e-5, and atol 5e-6 for elements whose gradient is near
# zero, where Adam's normalisation (m / sqrt(v)) turns the tensor-parallel summation order's
# last-bit differences of the gradient into differences of the step (measured: 2.4e-6 on
# weights of about 0.02; the moments themselves agree to 2e-8).
# Each step's gradient is read from the first moments (g_t = (m_t - beta1 m_{t-1}) / (1 - beta1)),
# which multiplies their differences by up to (1 + beta1) / (1 - beta1) = 19.
WEIGHTS_ATOL, MOMENTS_ATOL, GRADS_ATOL = 5e-6, 1e-7, 1e-6


def close(a: dict, b: dict, where: str, atol: float = WEIGHTS_ATOL) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        if isinstance(a[k], dict):
            close(a[k], b[k], f"{where}.{k}", atol)
        elif isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=atol, msg=f"{where}.{k}")


def metric(out: Path, field: str) -> dict[int, float]:
    with open(Path(out) / "metrics.csv") as f:
        return {int(r["step"]): float(r[field]) for r in csv.DictReader(f) if r[field]}


def gradients(states: list[dict]) -> list[dict]:
    """Each step's gradient (clipped, as AdamW got it), from the checkpoints of steps 1, 2, ...:
    AdamW's first moment is m_t = beta1 m_{t-1} + (1 - beta1) g_t, from m_0 = 0."""
    out, before = [], None
    for s in states:
        m = {k: v["exp_avg"] for k, v in s["optim"]["state"].items()}
        out.append({k: (m[k] - (BETA1 * before[k] if before else 0)) / (1 - BETA1) for k in m})
        before = m
    return out


RUNS = {"1d": (2, []),  # FSDP over 2 devices
        "2d": (4, ["--mesh.model", "2"]),  # (fsdp 2, model 2)
        "stages": (4, ["--mesh.pipeline", "2", "--mesh.model", "2"])}  # (pipeline 2, fsdp 1, model 2)


def _jobs(folder: Path) -> None:
    for name, (devices, flags) in RUNS.items():
        r = train(folder / name, *ARGS, *flags, devices=devices)
        assert "Warning" not in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def jobs(once, tmp_path_factory):
    """(a folder of this test runner's for what the tests write, the two jobs' output
    folders: made once for all the test runners, ``once`` in conftest.py)"""
    shared, _ = once("tp-jobs", _jobs)
    return tmp_path_factory.mktemp("tp"), {name: shared / name for name in RUNS}


@pytest.mark.parametrize("job", ["2d", "stages"])
def test_the_2d_job_trains_as_the_1d_job(jobs, job):
    """And the job with two pipeline stages, each computing its layers tensor-parallel."""
    _, out = jobs
    want, got = losses(out["1d"]), losses(out[job])
    assert got.keys() == want.keys() == {1, 2, 3, 4}
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=0), s
    want, got = metric(out["1d"], "grad_norm"), metric(out[job], "grad_norm")  # (before clipping)
    assert got.keys() == want.keys() == set(range(1, STEPS + 1))
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=0), s
    # at every step, the same checkpoint keys and values: model, and AdamW's moments, whole; and so
    # the same gradients
    read = dcp_states(*(ck(out[name], s) for name in ("1d", job) for s in range(1, STEPS + 1)))
    states = {"1d": read[:STEPS], job: read[STEPS:]}
    for s, (a, b) in enumerate(zip(states[job], states["1d"]), 1):
        assert a.keys() == b.keys()
        close(a["model"], b["model"], f"step {s} model")
        close(a["optim"]["state"], b["optim"]["state"], f"step {s} optim", MOMENTS_ATOL)
    for s, (a, b) in enumerate(zip(gradients(states[job]), gradients(states["1d"])), 1):
        close(a, b, f"step {s} gradient", GRADS_ATOL)


# From each kind of job's checkpoint, onto another kind: the 2D job's onto 1D, the stages' onto 2D
# (a checkpoint holds whole tensors by name: test_train's resume across device counts and stage
# counts, and test_train_checkpoints, check the other directions of the same reading)
@pytest.mark.parametrize("saved,resumed_on", [("2d", ("1d", 2, [])), ("stages", ("2d", 4, ["--mesh.model", "2"]))],
                         ids=["2d_to_1d", "stages_to_2d"])
def test_a_checkpoint_resumes_on_the_other_mesh(jobs, saved, resumed_on):
    tmp, out = jobs
    name, devices, flags = resumed_on
    again = tmp / f"{saved}-on-{name}"
    train(again, *ARGS, *flags, "--checkpoint.resume", str(ck(out[saved], 2)), devices=devices)
    want, got = losses(out[saved]), losses(again)
    assert sorted(got) == [3, 4]
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=0), s
    # the weights and AdamW's state at the end, as the uninterrupted job's
    a, b = dcp_states(ck(again, STEPS), ck(out[saved], STEPS))
    assert a.keys() == b.keys()
    close(a["model"], b["model"], "model")
    close(a["optim"]["state"], b["optim"]["state"], "optim", MOMENTS_ATOL)


def test_export_of_the_2d_job_gives_the_1d_jobs_weights(jobs):
    import subprocess
    import sys

    tmp, out = jobs
    weights = {}
    for k in ("1d", "2d"):
        hf = tmp / f"hf-{k}"
        r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "export", str(out[k]), str(hf)],
                           capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT)
        assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr[-3000:]
        weights[k] = load_file(hf / "model.safetensors")
    close(weights["2d"], weights["1d"], "export")


def test_mesh_model_that_does_not_divide_the_devices_is_named(tmp_path):
    r = train(tmp_path, *ARGS, "--mesh.model", "3", devices=4, check=False)
    assert r.returncode != 0
    assert "mesh.model = 3 does not divide the 4 devices" in r.stdout + r.stderr


def test_torchspmd_explain_shows_the_jobs_layouts_and_one_steps_collectives(tmp_path):
    import subprocess
    import sys

    from test_train import SMALL

    cmd = [sys.executable, "-m", "torchspmd.cli", "explain", "--out-dir", str(tmp_path), "--mesh.devices", "4",
           "--mesh.model", "2", *SMALL]
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.count("Collectives of one step") == 1  # printed once, by rank 0
    assert "model.layers.0.self_attn.q_proj.weight" in out and "colwise over 'model' (paired)" in out
    assert "rowwise over 'model' (paired)" in out
    # the row-parallel outputs' all-reduces over 'model' are counted with their module
    assert "mlp.down_proj" in out and "model (size 2)" in out
    assert "Warning" not in r.stderr
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
