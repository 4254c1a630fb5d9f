"""First contact with `torchspmd train`: every setting is checked in the launching process
before any worker starts (one error line naming the setting and the fix, unknown names
answered with the closest known ones); the presets fit the hardware they are meant for; the
job prints the planner's prediction, and warns before training when it will not fit."""

import subprocess
import sys

import pytest
from _helpers import LAUNCH_VARS, clean_env
from test_errors import _one_clear_error
from test_train import ROOT

import torchspmd.train as train_pkg
from torchspmd import cli
from torchspmd.launch import launcher as _launch
from torchspmd.train import config as tconfig

# (flags, what the one error line must contain)
RULES = [
    (["--model.name", "llamaa"], "model.name = 'llamaa': not a causal language model type transformers knows "
                                 "(did you mean 'llama'"),
    (["--model.name", "vit"], "model.name = 'vit': not a causal language model type"),
    (["--model.dim", "0"], "model.dim = 0: must be at least 1"),
    (["--model.num_layers", "0"], "model.num_layers = 0: must be at least 1"),
    (["--model.num_heads", "3"], "model.dim = 128 is not divisible by model.num_heads = 3"),
    (["--model.num_kv_heads", "3"], "model.num_heads = 4 is not divisible by model.num_kv_heads = 3"),
    (["--model.num_kv_heads", "-1"], "model.num_kv_heads = -1: must be at least 0"),
    (["--model.intermediate_size", "0"], "model.intermediate_size = 0: must be at least 1"),
    (["--model.dropout", "1"], "model.dropout = 1.0: give a probability in [0, 1)"),
    (["--model.vocab_size", "-5"], "model.vocab_size = -5: must be at least 0"),
    (["--data.seq_len", "512"], "data.seq_len = 512 is beyond the model's positions (model.max_seq_len = 256)"),
    (["--data.max_bytes", "-1"], "data.max_bytes = -1: must be at least 0"),
    (["--data.eval_fraction", "0.7"], "data.eval_fraction = 0.7: choose a value in [0, 0.5)"),
    (["--data.tokenizer", "no-such-tokenizer.json"], "data.tokenizer = 'no-such-tokenizer.json': no such file"),
    (["--data.path", "/no/such/corpus"], "data.path = '/no/such/corpus': no such file or directory"),
    (["--optim.lr", "-1"], "optim.lr = -1.0: give a positive learning rate"),
    (["--optim.lr", "0"], "optim.lr = 0.0: give a positive learning rate"),
    (["--optim.lr", "nan"], "optim.lr = nan: give a positive learning rate"),
    (["--optim.lr", "fast"], "optim.lr: expected float, got 'fast'"),
    (["--optim.min_lr_ratio", "1.5"], "optim.min_lr_ratio = 1.5: must be between 0 and 1"),
    (["--optim.beta1", "1.5"], "optim.beta1 = 1.5: AdamW's betas are in [0, 1)"),
    (["--optim.beta2", "-0.1"], "optim.beta2 = -0.1: AdamW's betas are in [0, 1)"),
    (["--optim.weight_decay", "-0.1"], "optim.weight_decay = -0.1: must be at least 0"),
    (["--optim.grad_clip", "-1"], "optim.grad_clip = -1.0: must be at least 0"),
    (["--optim.grad_clip", "inf"], "optim.grad_clip = inf: give a finite number"),
    (["--optim.warmup_steps", "50", "--optim.max_steps", "10"],
     "optim.warmup_steps = 50 is more than optim.max_steps = 10"),
    (["--optim.warmup_steps", "-1"], "optim.warmup_steps = -1: must be at least 0"),
    (["--optim.max_steps", "0"], "optim.max_steps = 0: must be at least 1"),
    (["--optim.batch_size", "0"], "optim.batch_size = 0: must be at least 1"),
    (["--optim.grad_accum", "3"], "optim.batch_size = 16 is not divisible by optim.grad_accum = 3"),
    (["--optim.batch_size", "3"], "the micro-batch of 3 sequences (optim.batch_size / optim.grad_accum) is not "
                                  "divisible by the 2 data-parallel devices"),
    (["--optim.max_bad_steps", "0"], "optim.max_bad_steps = 0: must be at least 1"),
    (["--model.name", "seed", "--model.num_kv_heads", "2"],
     "model.num_kv_heads = 2: the seed decoder has as many key/value heads as attention heads"),
    (["--mesh.devices", "-2"], "mesh.devices = -2: give the number of devices"),
    (["--mesh.data", "3"], "mesh.data = 3 does not divide the 2 devices"),
    (["--mesh.model", "0"], "mesh.model = 0: must be at least 1"),
    (["--mesh.backend", "tpu"], "mesh.backend = 'tpu': unknown backend"),
    (["--precision.dtype", "bf61"], "precision.dtype = 'bf61': choose 'fp32' or 'bf16' (did you mean 'bf16'?)"),
    (["--checkpoint.every", "0"], "checkpoint.every = 0: must be at least 1"),
    (["--checkpoint.keep", "-1"], "checkpoint.keep = -1: must be at least 0 (checkpoints kept, 0 for all)"),
    (["--checkpoint.resume", "/no/such/checkpoint"], "checkpoint.resume = '/no/such/checkpoint': no such checkpoint"),
    (["--checkpoint.resume", __file__], f"checkpoint.resume = {__file__!r}: a file, not a checkpoint directory"),
    (["--logging.every", "0"], "logging.every = 0: must be at least 1"),
    (["--logging.eval_every", "0"], "logging.eval_every = 0: must be at least 1"),
    (["--logging.eval_batches", "0"], "logging.eval_batches = 0: must be at least 1"),
    (["--logging.sample_tokens", "-1"], "logging.sample_tokens = -1: must be at least 0"),
    (["--seed", "-1"], "seed = -1: must be between 0 and 4294967295"),
    (["--compile", "maybe"], "compile: expected true or false, got 'maybe'"),
    (["--preset", "tinyy"], "preset = 'tinyy': unknown preset (did you mean 'tiny'?)"),
    (["--modle.dim", "64"], "train: unknown option --modle.dim (did you mean '--model.dim'"),
    (["--optim.learning_rate", "1e-3"], "train: unknown option --optim.learning_rate (did you mean '--optim.min_lr_ratio'"),
    (["stray"], "train: unexpected argument 'stray'"),
    (["--nproc", "4"], "train: unknown option --nproc: the job starts its own processes, one per device: give their "
                       "number as --mesh.devices N"),
    (["--nproc_per_node=4"], "train: unknown option --nproc_per_node: the job starts its own processes"),
]


@pytest.mark.parametrize("flags,message", RULES, ids=[" ".join(f) for f, _ in RULES])
def test_each_rule_is_one_error_line_before_any_worker(tmp_path, monkeypatch, capsys, flags, message):
    started = []
    monkeypatch.setattr(train_pkg, "run", lambda *a, **k: started.append("run"))
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: started.append("launch"))
    for var in LAUNCH_VARS:  # a fresh job's environment (as clean_env gives a subprocess), on 2 devices
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHSPMD_NUM_DEVICES", "2")
    code = cli.main(["train", "--out-dir", str(tmp_path / "out"), *flags])
    out, err = capsys.readouterr()
    assert code == 2 and not started and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchspmd: ") and message in lines[0], err


@pytest.mark.parametrize("flags,message", [RULES[0], RULES[15]], ids=["model name", "learning rate"])
def test_formerly_worker_errors_are_found_by_the_launching_process(tmp_path, flags, message):
    """Errors the workers used to find (twice, under torchrun's lines): now one line from the
    command, no worker."""
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "train", "--out-dir", str(tmp_path), *flags],
                       capture_output=True, text=True, env=clean_env(TORCHSPMD_NUM_DEVICES="2"), timeout=300,
                       cwd=ROOT)
    _one_clear_error(r, message)
    assert len(r.stderr.splitlines()) == 1 and r.stdout == "", r.stderr


def test_toml_keys_get_a_suggestion(tmp_path):
    with pytest.raises(tconfig.SpmdError, match=r"unknown config key optim\.batchsize \(did you mean 'batch_size'\?\)"):
        tconfig.apply_overrides(tconfig.TrainConfig(), {"optim": {"batchsize": 8}}, "--config x.toml")
    with pytest.raises(tconfig.SpmdError, match=r"unknown config key 'optm' \(did you mean 'optim'\?\)"):
        tconfig.apply_overrides(tconfig.TrainConfig(), {"optm": {}}, "--config x.toml")


# -- presets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(tconfig.PRESETS))
def test_each_preset_fits_its_stated_target(name):
    from torchspmd.train import plan

    cfg = tconfig.preset(name)
    tconfig.validate(cfg)
    target = tconfig.PRESET_TARGETS[name]
    tconfig.mesh_checks(cfg, target.devices)  # the micro-batch splits over the target's devices
    strategy = "FSDPv2 + checkpointing" if cfg.precision.checkpointing else "FSDPv2"
    predicted = plan.estimate(plan.config_facts(cfg), target.devices, cfg.optim.batch_size, cfg.data.seq_len,
                              cfg.precision.dtype, "adamw", cfg.optim.grad_accum,
                              context=cfg.mesh.context)[strategy]["total"]
    assert predicted <= plan.HEADROOM * target.memory_gb * 1e9, (name, predicted / 1e9, target)


def test_llama2_7b_preset_has_llama2_shapes():
    from torchspmd.train import plan

    cfg = tconfig.preset("llama2-7b")
    facts = plan.config_facts(cfg)
    assert facts.vocab == 32000
    assert 6.738e9 <= facts.params <= 6.739e9  # Llama-2-7B: 6,738,415,616 parameters
    assert cfg.optim.batch_size == 512 and cfg.optim.batch_size % (cfg.optim.grad_accum * 8) == 0


# -- the job's own prediction ----------------------------------------------------------------------

def test_train_warns_before_training_when_the_run_will_not_fit(monkeypatch, capsys):
    from torchspmd.train import loop

    cfg = tconfig.preset("small")
    monkeypatch.setattr(loop, "_device_memory", lambda: (2e9, "a test device"))
    loop._announce_plan(cfg, 2)
    out, err = capsys.readouterr()
    assert out.startswith("plan: ") and "GB per device predicted of 1.9 GB (a test device): FSDPv2, 32 x 512" in out
    assert err.startswith("torchspmd: warning: this run is predicted to need ") and err.count("\n") == 1, err
    assert "The planner proposes FSDPv2" in err and "set optim.grad_accum = " in err, err
    monkeypatch.setattr(loop, "_device_memory", lambda: (64e9, "a test device"))
    loop._announce_plan(cfg, 2)
    out, err = capsys.readouterr()
    assert out.startswith("plan: ") and err == ""


def test_the_planner_draws_none_of_the_callers_random_numbers():
    import torch

    from torchspmd.train import plan

    cfg = tconfig.preset("tiny")
    cfg.model.dropout = 0.1  # the probe's forward draws dropout masks
    before = torch.get_rng_state()
    plan.config_facts(cfg)
    assert torch.equal(torch.get_rng_state(), before)
