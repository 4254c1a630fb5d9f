"""`torchspmd train` end to end on 2 (and 4) CPU processes."""

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import ROOT, assert_identical, clean_env, dcp_states

SMALL = ["--data.max_bytes", "300000", "--data.seq_len", "64", "--model.max_seq_len", "64", "--model.dim", "64",
         "--model.num_layers", "2", "--model.intermediate_size", "128", "--optim.batch_size", "8",
         "--logging.every", "1", "--logging.eval_every", "1000", "--logging.sample_tokens", "0",
         "--logging.tensorboard", "false"]


def train(out, *args, devices=2, env=None, check=True):
    if "--optim.warmup_steps" not in args:  # the default (20) is more than these runs' steps: refused
        args = (*args, "--optim.warmup_steps", "1")
    cmd = [sys.executable, "-m", "torchspmd.cli", "train", "--out-dir", str(out), "--mesh.devices", str(devices),
           *SMALL, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(**(env or {})), timeout=600, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def losses(out) -> dict[int, float]:
    with open(Path(out) / "metrics.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["loss"]}


def final_weights(out):
    from torchspmd.train.export import load_plain_model

    model, *_ = load_plain_model(str(out))
    return model.state_dict()


def weights_and_optimizer(state: dict) -> dict:
    """A checkpoint's tensors (as _helpers.dcp_state reads them), flat: 'model.<name>' and
    'optim.<name>.<key>' (AdamW's step and moments)."""
    return {**{f"model.{k}": v for k, v in state["model"].items()},
            **{f"optim.{n}.{k}": v for n, s in state["optim"]["state"].items() for k, v in s.items()}}


def test_default_job_runs_and_learns(tmp_path):
    # the default preset, cut to a few steps (and a small corpus read)
    cmd = [sys.executable, "-m", "torchspmd.cli", "train", "--out-dir", str(tmp_path), "--optim.max_steps", "40",
           "--data.max_bytes", "400000", "--checkpoint.every", "20", "--logging.every", "5",
           "--logging.eval_every", "20", "--logging.sample_tokens", "20"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    # a default run prints no warning (DTensor's "sequential all_gather" among them), from any process
    for text in (r.stdout, r.stderr):  # Python warnings, and torch's logged ones ("[rank0]:W1130 10:07:30 ...")
        assert not re.search(r"warn|(^|\]:)W\d{4} \d", text, re.IGNORECASE | re.MULTILINE), text[-4000:]
    assert "2 device(s)" in r.stdout and "--- sample ---" in r.stdout
    assert r.stdout.count("step     40") == 1  # printed once, by rank 0
    assert r.stdout.count("plan: ") == 1 and "GB per device predicted" in r.stdout  # the planner, at start
    got = losses(tmp_path)
    assert got[40] < got[5] - 0.5
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step-00000020", "step-00000040"]
    ck = tmp_path / "checkpoints" / "step-00000040"
    assert (ck / "config.toml").exists() and (ck / ".metadata").exists()
    assert list((tmp_path / "tensorboard").iterdir())
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[-1]["eval_loss"] and float(rows[-1]["tokens_per_s"]) > 0 and float(rows[-1]["memory_gb"]) > 0


def test_exact_resume(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    # (the warm-up ends where the first half does: the cosine after it depends on max_steps alone)
    warm = ("--optim.warmup_steps", "4")
    train(straight, "--optim.max_steps", "8", "--checkpoint.every", "4", *warm)
    train(halves, "--optim.max_steps", "4", "--checkpoint.every", "4", *warm)
    r = train(halves, "--optim.max_steps", "8", "--checkpoint.every", "4", *warm)
    assert "resumed from" in r.stdout
    assert losses(halves) == losses(straight)  # identical, not merely close
    a, b = final_weights(straight), final_weights(halves)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the last checkpoints as torch's DCP utility reads them: weights and optimizer state, bit for bit
    last = Path("checkpoints") / "step-00000008"
    assert_identical(*dcp_states(halves / last, straight / last))


def test_resume_on_another_device_count(tmp_path):
    """A job on 2 devices, resumed on 4 from its step 2, and that one resumed on 2 again from its
    step 4: the losses and the final state are the straight job's."""
    run = ("--optim.max_steps", "6", "--checkpoint.every", "2", "--checkpoint.keep", "0")
    straight, moved, back = tmp_path / "straight", tmp_path / "moved", tmp_path / "back"
    train(straight, *run, devices=2)
    for source, out, step, first, second in ((straight, moved, 2, 2, 4), (moved, back, 4, 4, 2)):
        r = train(out, *run, devices=second, *("--checkpoint.resume", str(source / "checkpoints" / f"step-{step:08d}")))
        assert f"{second} device(s)" in r.stdout and "saved on " + str(first) in r.stdout
        a, b = losses(straight), losses(out)
        assert sorted(b) == list(range(step + 1, 7))
        for s in b:
            assert b[s] == pytest.approx(a[s], rel=1e-4)
        # the weights and AdamW's state at the end (the last checkpoints, read by torch's DCP utility): fp32
        # (measured: 1.5e-8 at most, on values of about 0.1)
        last = Path("checkpoints") / "step-00000006"
        got, want = (weights_and_optimizer(s) for s in dcp_states(out / last, straight / last))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_interrupted_save_keeps_the_last_good_checkpoint(tmp_path):
    r = train(tmp_path, "--optim.max_steps", "8", "--checkpoint.every", "4", check=False,
              env={"TORCHSPMD_FAULT_SAVE_AT_STEP": "8"})
    assert r.returncode != 0 and "simulated crash during checkpoint save" in r.stderr
    from torchspmd.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-00000004"
    assert (tmp_path / "checkpoints" / ".step-00000008.tmp").exists()  # the broken one is set aside
    r = train(tmp_path, "--optim.max_steps", "8", "--checkpoint.every", "4")
    assert "resumed from" in r.stdout and "step-00000004" in r.stdout
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-00000008"
    # the resumed job ends as the uninterrupted one: losses, weights and optimizer state, bit for bit
    straight = tmp_path / "straight"  # (beside the job's files)
    train(straight, "--optim.max_steps", "8", "--checkpoint.every", "4")
    assert losses(tmp_path) == losses(straight)
    last = Path("checkpoints") / "step-00000008"
    assert_identical(*dcp_states(tmp_path / last, straight / last))


def test_seed_decoder_and_meta_init_and_accumulation(tmp_path):
    # model.vocab_size: more embedding rows than the byte tokenizer's 257 (a Llama-2-sized table's setting)
    train(tmp_path / "seed", "--model.name", "seed", "--optim.max_steps", "4", "--checkpoint.every", "4",
          "--optim.grad_accum", "2", "--model.meta_init", "true", "--precision.checkpointing", "true",
          "--model.vocab_size", "300")
    got = losses(tmp_path / "seed")
    assert len(got) == 4 and all(v == v for v in got.values()) and got[1] < 6.0  # ~ln(300) at the start
    assert {tuple(v.shape) for k, v in final_weights(tmp_path / "seed").items() if "embed" in k} == {(300, 64)}


def test_local_jsonl_data_bf16_and_a_pretrained_model_with_meta_init(tmp_path):
    # model.meta_init (the llama-1b / llama2-7b presets set it) with model.pretrained trains the
    # pretrained weights: they were re-initialised. At lr 1e-9 the trained weights are the pretrained
    # directory's, as safetensors reads them, to rounding.
    from _helpers import tiny_llama
    from safetensors.torch import load_file

    pre = tmp_path / "pre"
    tiny_llama(vocab_size=257, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=64, tie_word_embeddings=False, use_cache=False).save_pretrained(pre)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join('{"text": "the quick brown fox jumps over the lazy dog %d"}' % i for i in range(400)))
    r = train(tmp_path / "run", "--data.path", str(data), "--optim.max_steps", "3", "--checkpoint.every", "3",
              "--precision.dtype", "bf16", "--model.pretrained", str(pre), "--model.meta_init", "true",
              "--optim.lr", "1e-9")
    assert len(losses(tmp_path / "run")) == 3
    want, got = load_file(pre / "model.safetensors"), final_weights(tmp_path / "run")
    assert want and want.keys() <= got.keys()
    for k in want:
        assert (got[k] - want[k]).abs().max().item() < 1e-6, k
    # the held-out sequences (2% of ~290) are fewer than a batch (8): no evaluation, and it says so
    assert re.search(r"no evaluation: the \d held-out sequences \(data.eval_fraction = 0.02\) are fewer than one "
                     r"micro-batch of 8", r.stdout), r.stdout[-3000:]
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert not any(row["eval_loss"] for row in csv.DictReader(f))


def test_the_seed_decoder_in_stages_with_the_model_axis_trains_as_without(tmp_path):
    """--model.name seed at (pipeline 2, model 2) on 4 devices: its attention split by heads
    (nn.MultiheadAttention, traced), MLP pairs, embedding and LM head over 'model' in each
    stage; the losses are the 2-device job's without either."""
    run = ("--model.name", "seed", "--optim.max_steps", "3")
    train(tmp_path / "plain", *run)
    train(tmp_path / "3d", *run, "--mesh.pipeline", "2", "--mesh.model", "2", devices=4)
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "3d")
    assert sorted(got) == [1, 2, 3]
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-5)


def test_a_short_run_adapts_the_defaults_it_contradicts(tmp_path):
    """--optim.max_steps 3 alone, on one device: the default warm-up (20 steps) becomes a tenth
    of the run, said under the printed config; the same warm-up set by the user is refused."""
    base = [sys.executable, "-m", "torchspmd.cli", "train", "--mesh.devices", "1", *SMALL, "--optim.max_steps", "3"]
    r = subprocess.run([*base, "--out-dir", str(tmp_path / "short")], capture_output=True, text=True,
                       env=clean_env(), timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "# optim.warmup_steps = 0: adapted, its default 20 is more than optim.max_steps = 3" in r.stdout
    assert sorted(losses(tmp_path / "short")) == [1, 2, 3]
    r = subprocess.run([*base, "--out-dir", str(tmp_path / "set"), "--optim.warmup_steps", "20"], capture_output=True,
                       text=True, env=clean_env(), timeout=600, cwd=ROOT)
    assert r.returncode != 0 and "optim.warmup_steps = 20 is more than optim.max_steps = 3" in r.stderr


ERRORS = [
    (["--model.nope", "1"], "unknown option --model.nope"),
    (["--preset", "huge"], "preset = 'huge': unknown preset"),
    (["--model.name", "notamodel"], "model.name = 'notamodel': not a causal language model type"),
    (["--data.path", "/nonexistent/x.txt"], "data.path = '/nonexistent/x.txt': no such file or directory"),
    (["--data.seq_len", "128"], "data.seq_len = 128 is beyond the model's positions"),
    (["--optim.batch_size", "7"], "not divisible by the 2 data-parallel devices"),
    (["--mesh.pipeline", "2", "--mesh.data", "2"],
     "mesh.data = 2 with mesh.pipeline = 2: a 'data' axis beside the stages is not available yet"),
    (["--mesh.pipeline", "2", "--pipeline.schedule", "1f1c"], "pipeline.schedule = '1f1c': choose one of"),
    (["--mesh.pipeline", "2", "--pipeline.microbatches", "3"],
     "pipeline.microbatches = 3: each process's 8 rows per micro-step"),
    (["--mesh.pipeline", "3"], "mesh.pipeline = 3 does not divide the 2 devices"),
]


@pytest.mark.parametrize("args,message", ERRORS)
def test_errors_are_clear_and_early(tmp_path, args, message):
    r = train(tmp_path, *args, "--optim.max_steps", "1", check=False)
    assert r.returncode != 0
    assert message in r.stderr


def test_config_file_errors_and_empty_data(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlearning_rate = 1.0\n")
    r = train(tmp_path / "a", "--config", str(bad), check=False)
    assert r.returncode != 0 and "unknown config key optim.learning_rate" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    r = train(tmp_path / "b", "--data.path", str(empty), check=False)
    assert r.returncode != 0 and "holds no text" in r.stderr


def test_checkpoint_from_another_model_shape(tmp_path):
    train(tmp_path, "--optim.max_steps", "2", "--checkpoint.every", "2")
    r = train(tmp_path, "--optim.max_steps", "4", "--model.dim", "96", check=False)
    assert r.returncode != 0 and "saved from a model of another shape" in r.stderr


def test_compiled_layers_train_like_eager(tmp_path):
    train(tmp_path / "eager", "--optim.max_steps", "4")
    r = train(tmp_path / "compiled", "--optim.max_steps", "4", "--compile", "true")
    assert "torch.compile: 2 compiled blocks" in r.stdout
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys()
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4)


def test_pipeline_stages_train_as_the_job_without_and_resume_across_stage_counts(tmp_path):
    """--mesh.pipeline 2: the stages' losses and evaluation are the job's without stages (both
    are one device's: fp32, rel 1e-5); a checkpoint saved without stages resumes on 2 stages x
    'fsdp' 2 (4 devices). (A checkpoint of stages resumes without them: test_train_tp.)"""
    run = ("--optim.max_steps", "4", "--checkpoint.every", "2", "--logging.eval_every", "2")
    plain, stages = tmp_path / "plain", tmp_path / "stages"
    train(plain, *run)
    r = train(stages, *run, "--mesh.pipeline", "2")
    assert "pipeline: 2 processes, 2 stages cut before model.layers.1" in r.stdout
    assert "4 micro-batches per micro-step: idle share (bubble) 20%" in r.stdout
    for text in (r.stdout, r.stderr):  # no warning from the stages' tracing
        assert not re.search(r"warn|(^|\]:)W\d{4} \d", text, re.IGNORECASE | re.MULTILINE), text[-3000:]
    want, got = losses(plain), losses(stages)
    assert sorted(got) == [1, 2, 3, 4]
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-5)

    def evals(out):
        with open(Path(out) / "metrics.csv") as f:
            return [float(row["eval_loss"]) for row in csv.DictReader(f) if row["eval_loss"]]

    assert evals(stages) == pytest.approx(evals(plain), rel=1e-5) and len(evals(plain)) == 2
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "explain", "--out-dir", str(tmp_path / "explain"),
                        "--mesh.devices", "2", "--mesh.pipeline", "2", "--optim.warmup_steps", "1", *SMALL],
                       capture_output=True, text=True, env=clean_env(), timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "stage 1 on process(es) [1]: model.layers.1, model.norm, lm_head" in r.stdout, r.stderr
    for source, out, args, devices in ((plain, tmp_path / "split", ("--mesh.pipeline", "2"), 4),):
        r = train(out, *run, *args, "--checkpoint.resume", str(source / "checkpoints" / "step-00000002"),
                  devices=devices)
        assert "resumed from" in r.stdout
        got = losses(out)
        assert sorted(got) == [3, 4]
        for s in got:
            assert got[s] == pytest.approx(want[s], rel=1e-5)
