"""Every example runs as is on 2 CPU devices, prints the global loss once, and learns."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import clean_env, example_losses

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = {
    "spmd_data_parallel.py": ["--steps", "12", "--per-device-batch", "32"],
    "fsdp_v2.py": ["--steps", "21", "--dim", "64", "--layers", "2", "--heads", "4", "--intermediate", "256",
                   "--vocab", "512", "--batch", "8", "--seq", "32"],
    "fsdp_v2_checkpointing.py": ["--steps", "6", "--dim", "64"],
    "fsdp_v2_shard_output.py": ["--steps", "6"],
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_on_two_cpu_devices(name):
    env = clean_env(CPU_NUM_DEVICES=2)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / name), *EXAMPLES[name]], capture_output=True,
                       text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = example_losses(r.stdout)
    assert len(printed) == r.stdout.count("Loss:"), "a step was printed more than once"
    losses = [printed[k] for k in sorted(printed)]
    assert len(losses) >= 3 and losses[-1] < losses[0]


def test_checkpointing_by_hand_equals_auto_wrap():
    env = clean_env(CPU_NUM_DEVICES=2)
    outs = []
    for extra in ([], ["--by-hand"]):
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "fsdp_v2_checkpointing.py"), "--steps", "3",
                            "--dim", "64", *extra], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append([l for l in r.stdout.splitlines() if "Loss:" in l])
    assert outs[0] == outs[1]


def test_hf_finetune_example(tmp_path):
    import trl  # noqa: F401  (the test extra installs it: its absence fails here, visibly)

    env = clean_env(CPU_NUM_DEVICES=2)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_finetune.py"), "--steps", "20",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parameters: DTensor (Shard(dim=0),) over 2 devices" in r.stdout
    result = json.loads(r.stdout.split("result:")[1].strip().splitlines()[0])
    assert result["last_loss"] < result["first_loss"] and result["lora_weights"] > 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_tensor_parallel_example_runs_on_four_cpu_devices():
    env = clean_env(CPU_NUM_DEVICES=4)
    steps = 10
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "fsdp_v2_tensor_parallel.py"), "--steps", str(steps),
                        "--log-every", "1", "--dim", "64", "--layers", "2", "--heads", "4", "--intermediate", "256",
                        "--vocab", "512", "--batch", "8", "--seq", "32", "--explain"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = example_losses(r.stdout)
    assert sorted(printed) == list(range(steps)) and r.stdout.count("Loss:") == steps, r.stdout
    losses = [printed[k] for k in range(steps)]
    assert losses[-1] < losses[0], losses
    # each process stores 1/(fsdp x model) of the up-projection, and the layout table says how it computes
    assert "(1/4; fsdp x model = 2 x 2)" in r.stdout, r.stdout
    assert "tensor-parallel colwise over 'model' (paired)" in r.stdout, r.stdout
    assert not [l for l in r.stderr.splitlines() if "Warning" in l], r.stderr[-3000:]
