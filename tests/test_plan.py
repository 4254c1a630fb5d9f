"""`torchspmd plan`: its prediction against the measured peak of real FSDPv2 runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from torchspmd.plan import estimate, model_facts
from _helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]


def _measure(config_dir, devices, batch, seq, dtype, out):
    env = clean_env()
    # Big allocations straight from (and back to) the OS, so that the peak RSS is the peak of
    # the live tensors rather than of malloc's cached free memory.
    env.update(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(devices),
                        str(ROOT / "tests" / "_plan_worker.py"), str(config_dir), str(batch), str(seq), dtype, "3",
                        str(out)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(Path(out).read_text())["peak_growth"]


@pytest.mark.parametrize("devices,batch,seq,dtype", [(2, 8, 128, "fp32"), (4, 8, 256, "fp32"), (2, 8, 256, "bf16")])
def test_fsdpv2_prediction_within_15_percent_of_a_measured_run(tmp_path, devices, batch, seq, dtype):
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                                      use_cache=False, tie_word_embeddings=False)
    config.save_pretrained(tmp_path / "model")
    measured = _measure(tmp_path / "model", devices, batch, seq, dtype, tmp_path / "peak.json")
    predicted = estimate(model_facts(str(tmp_path / "model"), dtype), devices, batch, seq, dtype, "adamw")
    fsdp = predicted["FSDPv2"]["total"]
    assert abs(fsdp - measured) / measured <= 0.15, (fsdp / 2**20, measured / 2**20, predicted["FSDPv2"])
    # DDP needs more, checkpointing less
    assert predicted["DDP"]["total"] > fsdp > predicted["FSDPv2 + checkpointing"]["total"]


def test_preset_plan_command_runs():
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "plan", "--model", "tiny", "--devices", "2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FSDPv2 + checkpointing" in r.stdout and "fits" in r.stdout


def test_plan_errors_name_the_argument():
    from torchspmd import SpmdError

    with pytest.raises(SpmdError, match="--model 'nope'"):
        model_facts("nope")
    facts = model_facts("tiny")
    with pytest.raises(SpmdError, match="--optimizer 'lion'"):
        estimate(facts, 2, 8, 64, "fp32", "lion")
