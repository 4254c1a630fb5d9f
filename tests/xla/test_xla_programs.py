"""Whole programs on the XLA backend (one process, 4 CPU devices), against the native engine
(4 gloo processes, run by the native engine's environment: torch 2.13 or newer, which it needs):
the examples, `torchspmd train`, and checkpoints carried from one engine to the other."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import clean_env, example_losses, native_python

pytest.importorskip("torch_xla")

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-4  # fp32, XLA's CPU kernels against PyTorch's, over a few optimizer steps


def _env(engine: str) -> dict:
    # with torch_xla installed, PJRT_DEVICE=CPU: the XLA backend; else 4 gloo processes
    choice = {"PJRT_DEVICE": "CPU"} if engine == "xla" else {"TORCHSPMD_BACKEND": "cpu"}
    return clean_env(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), CPU_NUM_DEVICES=4, **choice)


def run(engine: str, *cmd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    python = sys.executable if engine == "xla" else native_python()
    r = subprocess.run([python, *cmd], capture_output=True, text=True, env=_env(engine), timeout=timeout,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


SMALL_DECODER = ["--steps", "6", "--log-every", "1", "--dim", "64", "--layers", "2", "--heads", "4",
                 "--intermediate", "160", "--batch", "8", "--seq", "16", "--vocab", "250"]


def test_fsdp_v2_example_same_losses_on_both_engines():
    native = run("native", "examples/fsdp_v2.py", *SMALL_DECODER)
    xla = run("xla", "examples/fsdp_v2.py", *SMALL_DECODER)
    assert "4 device(s)" in native.stdout and "4 device(s)" in xla.stdout
    a, b = example_losses(native.stdout), example_losses(xla.stdout)
    assert sorted(a) == sorted(b) == list(range(6))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=RTOL), (step, a, b)


@pytest.mark.parametrize("name,args", [
    ("fsdp_v2_checkpointing.py", ["--steps", "3", "--dim", "64"]),
    ("fsdp_v2_shard_output.py", ["--steps", "3"]),
    ("spmd_data_parallel.py", ["--steps", "3", "--per-device-batch", "8"]),
])
def test_example_runs_on_xla(name, args):
    r = run("xla", f"examples/{name}", *args)
    losses = example_losses(r.stdout)
    assert losses and all(v == v for v in losses.values())
    if name == "fsdp_v2_shard_output.py":
        assert "logits ('fsdp', None, None)" in r.stdout


def test_hf_finetune_example_on_xla(tmp_path):
    pytest.importorskip("trl")
    r = run("xla", "examples/hf_finetune.py", "--steps", "10", "--out", str(tmp_path))
    assert "over 4 devices (xla backend)" in r.stdout
    result = json.loads(r.stdout.split("result:")[1].strip().splitlines()[0])
    assert result["last_loss"] < result["first_loss"] and result["lora_weights"] > 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


TRAIN = ["--data.max_bytes", "200000", "--data.seq_len", "32", "--model.max_seq_len", "32", "--model.dim", "64",
         "--model.num_layers", "2", "--model.intermediate_size", "96", "--optim.batch_size", "8",
         "--logging.every", "1", "--logging.eval_every", "2", "--logging.eval_batches", "2",
         "--logging.sample_tokens", "0", "--logging.tensorboard", "false", "--checkpoint.every", "2",
         "--optim.warmup_steps", "2"]


def train(engine: str, out: Path, *args: str) -> dict[int, dict]:
    r = run(engine, "-m", "torchspmd.cli", "train", "--out-dir", str(out), *TRAIN, *args)
    assert f"4 device(s), backend {'xla' if engine == 'xla' else 'cpu'}" in r.stdout
    with open(out / "metrics.csv") as f:
        return {int(row["step"]): row for row in csv.DictReader(f)}


def _close(a: dict, b: dict, steps, field="loss"):
    for s in steps:
        assert float(b[s][field]) == pytest.approx(float(a[s][field]), rel=RTOL), (field, s, a[s][field], b[s][field])


def test_train_same_losses_on_both_engines_and_checkpoints_cross_over(tmp_path):
    native = train("native", tmp_path / "native", "--optim.max_steps", "4")
    xla = train("xla", tmp_path / "xla", "--optim.max_steps", "4")
    _close(native, xla, [1, 2, 3, 4])
    _close(native, xla, [2, 4], "eval_loss")
    ck = "checkpoints/step-00000002"
    assert (tmp_path / "xla" / ck / ".metadata").is_file() and (tmp_path / "xla" / ck / "state.pt").is_file()
    # the XLA run's last checkpoint reads back as a plain model (what export and generate use)
    from torchspmd.train.export import load_plain_model

    a, b = (load_plain_model(str(tmp_path / e))[0].state_dict() for e in ("native", "xla"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=RTOL, atol=1e-5)
    # a checkpoint written by one engine resumes on the other: the steps after it are the same
    on_xla = train("xla", tmp_path / "n2x", "--optim.max_steps", "4",
                   "--checkpoint.resume", str(tmp_path / "native" / ck))
    _close(native, on_xla, [3, 4])
    on_native = train("native", tmp_path / "x2n", "--optim.max_steps", "4",
                      "--checkpoint.resume", str(tmp_path / "xla" / ck))
    _close(xla, on_native, [3, 4])
    # and the weights at the end are those of the run each resumed run continues
    for continued, resumed in (("native", "n2x"), ("xla", "x2n")):
        a, b = (load_plain_model(str(tmp_path / e))[0].state_dict() for e in (continued, resumed))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=RTOL, atol=1e-5, msg=lambda m, k=k, r=resumed: f"{r} {k}: {m}")
