"""`torchspmd plan`: its prediction against the measured peak of real FSDPv2 runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from _helpers import clean_env

from torchspmd.train.plan import HEADROOM, estimate, model_facts, propose

ROOT = Path(__file__).resolve().parents[1]


def _measure(config_dir, devices, batch, seq, dtype, out, grad_accum=1, context=1):
    env = clean_env()
    # Big allocations straight from (and back to) the OS, so that the peak RSS is the peak of
    # the live tensors rather than of malloc's cached free memory.
    env.update(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    # Each process gathers the parameters into its own memory, as each GPU does (the plan is
    # one device's memory); shared between the processes, they would be in every one's RSS.
    env["TORCHSPMD_SHARED_PARAMS"] = "0"
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(devices),
                        str(ROOT / "tests" / "_plan_worker.py"), str(config_dir), str(batch), str(seq), dtype, "3",
                        str(out), str(grad_accum), str(context)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(Path(out).read_text())["peak_growth"]


def _config(path):
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                                      use_cache=False, tie_word_embeddings=False)
    config.save_pretrained(path)


# One measured run per thing the prediction computes differently: fp32 with the state split 4
# ways (2 ways, fp32, is test_proposal_...'s run), and bf16 compute (its gathered parameters and
# activations in 2 bytes, FSDPv2's mixed precision).
@pytest.mark.parametrize("devices,batch,seq,dtype", [(4, 8, 256, "fp32"), (2, 8, 256, "bf16")])
def test_fsdpv2_prediction_within_15_percent_of_a_measured_run(tmp_path, devices, batch, seq, dtype):
    _config(tmp_path / "model")
    measured = _measure(tmp_path / "model", devices, batch, seq, dtype, tmp_path / "peak.json")
    predicted = estimate(model_facts(str(tmp_path / "model"), dtype), devices, batch, seq, dtype, "adamw")
    fsdp = predicted["FSDPv2"]["total"]
    assert abs(fsdp - measured) / measured <= 0.15, (fsdp / 2**20, measured / 2**20, predicted["FSDPv2"])
    # DDP needs more, checkpointing less
    assert predicted["DDP"]["total"] > fsdp > predicted["FSDPv2 + checkpointing"]["total"]


def test_context_prediction_within_15_percent_of_a_measured_run(tmp_path):
    """FSDPv2 with each sequence split over a 'context' axis of 2: a process holds half of each
    sequence's activations and logits, and a quarter of the model state ('fsdp' x 'context' of
    2 x 2). (A sequence the axis does not divide is exact too, but the loss's flatten of the
    logits gathers them over 'context': docs/context.md.)"""
    _config(tmp_path / "model")
    devices, batch, seq = 4, 4, 512
    measured = _measure(tmp_path / "model", devices, batch, seq, "fp32", tmp_path / "peak.json", context=2)
    facts = model_facts(str(tmp_path / "model"), "fp32")
    predicted = estimate(facts, devices, batch, seq, "fp32", "adamw", context=2)["FSDPv2"]
    assert abs(predicted["total"] - measured) / measured <= 0.15, (predicted["total"] / 2**20, measured / 2**20,
                                                                   predicted)
    whole = estimate(facts, devices, batch, seq, "fp32", "adamw")["FSDPv2"]
    # the same rows per process hold half the tokens: activations and the loss's buffers halve
    assert predicted["activations"] < 0.55 * 2 * whole["activations"]


def _measure_stages(config_dir, devices, fsdp, batch, seq, microbatches, schedule, out):
    """The largest peak growth over the processes of a run of ``torchspmd.pipeline`` stages
    ('pipeline' devices / fsdp x 'fsdp' fsdp), fp32 AdamW, as _measure's environment."""
    env = clean_env(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", TORCHSPMD_SHARED_PARAMS="0")
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(devices),
                        str(ROOT / "tests" / "_plan_worker.py"), "stages", str(config_dir), str(batch), str(seq), "3",
                        str(out), str(fsdp), str(microbatches), schedule],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(Path(out).read_text())
    per_process = 2 if schedule.startswith("interleaved") else 1
    assert sorted({k for rank in result["ranks"] for k in rank["stages"]}) == list(range(2 * per_process))
    return result["peak_growth"]


# One measured run per schedule (each holds a different number of micro-batches in flight);
# 1f1b's with 'fsdp' 2 inside the stages (gathered units, sharded state), gpipe's and
# interleaved-1f1b's with one process per stage (nothing gathered).
@pytest.mark.parametrize("devices,fsdp,microbatches,schedule", [(4, 2, 2, "1f1b"), (2, 1, 4, "gpipe"),
                                                                (2, 1, 4, "interleaved-1f1b")])
def test_stage_prediction_within_15_percent_of_a_measured_run(tmp_path, devices, fsdp, microbatches, schedule):
    """Two pipeline stages of the Llama above (alone, or with 'fsdp' 2 inside each; with
    interleaved-1f1b, two per process, four in all): the
    larger stage's predicted peak against the largest measured over the processes (the
    peak of the training steps, over the memory before the model was built: see
    _plan_worker.stages)."""
    _config(tmp_path / "model")
    batch, seq = 8, 128
    measured = _measure_stages(tmp_path / "model", devices, fsdp, batch, seq, microbatches, schedule,
                               tmp_path / "peak.json")
    predicted = estimate(model_facts(str(tmp_path / "model"), "fp32"), devices, batch, seq, "fp32", "adamw",
                         pipeline=2, microbatches=microbatches, schedule=schedule)["FSDPv2"]
    assert predicted["microbatches"] == microbatches
    assert abs(predicted["total"] - measured) / measured <= 0.15, (predicted["total"] / 2**20, measured / 2**20,
                                                                   predicted)


def test_stages_and_model_axis_divide_what_each_device_holds():
    """The prediction's parts with a 'model' axis and pipeline stages (the stages' sum is
    checked against measured runs above)."""
    from torchspmd.train.config import bubble

    facts = model_facts("tiny", "fp32")
    one = estimate(facts, 4, 16, 128)["FSDPv2"]
    tp = estimate(facts, 4, 16, 128, model=2)["FSDPv2"]
    # 'model' 2 halves the data-parallel devices (state x 2) and splits the state (/ 2): the same state
    assert tp["parameters + optimizer"] == pytest.approx(one["parameters + optimizer"])
    assert tp["activations"] == pytest.approx(2 * one["activations"])  # twice the rows, counted whole
    st = estimate(facts, 4, 16, 128, pipeline=2)["FSDPv2"]
    assert st["microbatches"] == 4 and st["bubble"] == pytest.approx(bubble(2, "1f1b", 4)) == 0.2
    layers = facts.layers // 2 * facts.layer_params
    assert layers + facts.last_params < facts.params
    assert st["parameters + optimizer"] == pytest.approx(
        (4 + 8) * (layers + max(facts.first_params, facts.last_params)) / 2, rel=0.3)
    gpipe = estimate(facts, 4, 16, 128, pipeline=2, schedule="gpipe", microbatches=4)["FSDPv2"]
    assert gpipe["activations"] > st["activations"]  # all four micro-batches in flight, not two
    from torchspmd import SpmdError

    with pytest.raises(SpmdError, match="must divide the 4 devices"):
        estimate(facts, 4, 16, 128, model=3)
    with pytest.raises(SpmdError, match="choose --microbatches among"):
        estimate(facts, 4, 16, 128, pipeline=2, microbatches=3)
    # 'context' 2: the same rows per process hold half the tokens; the state is split over all 4
    cp = estimate(facts, 4, 8, 128, context=2)["FSDPv2"]
    half = estimate(facts, 4, 16, 64)["FSDPv2"]  # 4 rows of 64 tokens per process, state over 4
    for part in ("parameters + optimizer", "activations", "logits, loss buffers"):
        assert cp[part] == pytest.approx(half[part]), part
    with pytest.raises(SpmdError, match="'context' axis \\(2\\) does not combine with the 'model' axis"):
        estimate(facts, 4, 16, 128, model=2, context=2)
    with pytest.raises(SpmdError, match="'context' axis \\(3\\) must divide the 4 devices"):
        estimate(facts, 4, 16, 128, context=3)


def test_preset_plan_command_runs():
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "plan", "--model", "tiny", "--devices", "2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FSDPv2 + checkpointing" in r.stdout and "fits" in r.stdout
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "plan", "--model", "tiny", "--devices", "8",
                        "--mesh-model", "2", "--pipeline", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mesh: 'fsdp' 2 x 'model' 2 x 'pipeline' 2" in r.stdout
    assert "stages: 2 of up to 2 layers, 1f1b, 4 micro-batches: bubble 20%" in r.stdout
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "plan", "--model", "tiny", "--devices", "4",
                        "--context", "2", "--seq", "255"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mesh: 'fsdp' 2 x 'context' 2 (128 tokens of each sequence per process)" in r.stdout
    assert "Proposed (FSDPv2 x context 2;" in r.stdout


def test_plan_errors_name_the_argument():
    from torchspmd import SpmdError

    with pytest.raises(SpmdError, match="--model 'nope'"):
        model_facts("nope")
    facts = model_facts("tiny")
    with pytest.raises(SpmdError, match="--optimizer 'lion'"):
        estimate(facts, 2, 8, 64, "fp32", "lion")


def test_proposal_is_the_largest_micro_batch_that_fits_and_its_run_measures_as_predicted(tmp_path):
    """A device size between what 2 and 4 rows per device need: plan proposes 2 rows and the
    grad_accum that keeps the global batch of 16; a real 2-process run of that proposal
    peaks within 15% of the proposal's prediction."""
    _config(tmp_path / "model")
    facts = model_facts(str(tmp_path / "model"), "fp32")
    need = {rows: estimate(facts, 2, 16, 128, "fp32", "adamw", 8 // rows)["FSDPv2"]["total"] for rows in (1, 2, 4, 8)}
    assert need[1] < need[2] < need[4] < need[8]
    memory = (need[2] + need[4]) / 2 / HEADROOM
    proposal = propose(facts, 2, 16, 128, memory, "fp32")
    assert (proposal.strategy, proposal.rows, proposal.grad_accum, proposal.devices) == ("FSDPv2", 2, 4, 2)
    assert proposal.total == need[2] <= HEADROOM * memory
    measured = _measure(tmp_path / "model", 2, 16, 128, "fp32", tmp_path / "peak.json", grad_accum=4)
    assert abs(proposal.total - measured) / measured <= 0.15, (proposal.total / 2**20, measured / 2**20)


def test_proposal_climbs_to_checkpointing_offload_then_more_devices():
    facts = model_facts("small", "bf16")
    plan = estimate(facts, 2, 64, 512, "bf16", "adamw", 32)  # one row per device
    order = ["FSDPv2", "FSDPv2 + checkpointing", "FSDPv2 + checkpointing + CPU offload"]
    for name in order:  # a device just big enough for one row under each strategy
        memory = plan[name]["total"] / HEADROOM * 1.0001
        p = propose(facts, 2, 64, 512, memory, "bf16")
        assert (p.strategy, p.devices, p.devices_changed, p.rows, p.grad_accum) == (name, 2, False, 1, 32), p
        assert p.total <= HEADROOM * memory
    # without offload (as train, which has none) and too small for 2 devices: more devices, whose
    # shares of the parameters, gradients and optimizer state are smaller
    small = estimate(facts, 8, 64, 512, "bf16", "adamw", 8)[order[1]]["total"] / HEADROOM * 1.0001
    p = propose(facts, 2, 64, 512, small, "bf16", ladder=order[:2])
    assert (p.devices, p.devices_changed, p.strategy) == (8, True, order[1]) and p.rows * p.grad_accum * 8 == 64
    assert propose(facts, 2, 64, 512, 1e3, "bf16") is None  # 1 kB: nothing fits


def test_plan_command_proposes_for_each_device_size():
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "plan", "--model", "small", "--devices", "2",
                        "--memory-gb", "1", "--memory-gb", "24"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Proposed"))
    assert lines[start + 1].startswith("  1 GB: FSDPv2") and "grad_accum" in lines[start + 1], r.stdout
    assert lines[start + 2].startswith("  24 GB: FSDPv2, 32 rows per device x grad_accum 1"), r.stdout
