"""Bad input: each is one clear error that names the setting or argument and says how to
fix it. Job errors that can be found before any worker starts are found in the launching
process: printed once, without a traceback, with a non-zero exit status. API errors inside
a multi-process program are the same error on every process."""

import json
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from _helpers import clean_env
from test_train import ROOT, train

import torchspmd as ts
from torchspmd.train import config as tconfig
from torchspmd.train import data as tdata


def _text(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(n_chars))


def _word_tokenizer(path, size: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, size)}}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(path))
    assert t.get_vocab_size() == size
    return str(path)


def _pretrained(path, vocab: int, positions: int = 64) -> str:
    from _helpers import tiny_llama

    tiny_llama(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               max_position_embeddings=positions).save_pretrained(path)
    return str(path)


def _one_clear_error(r, message: str) -> None:
    """Exit status non-zero, ``message`` printed once, no traceback, and no worker started
    (the launching process found it: no process summary, no start-up line of the job)."""
    assert r.returncode != 0, r.stdout[-2000:]
    assert r.stderr.count(message) == 1, r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "[rank" not in r.stderr, r.stderr[-4000:]
    assert "torchspmd: rank" not in r.stderr and "device(s)" not in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# -- the job: found before any worker starts ------------------------------------------------

def _job_cases(tmp_path):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('[optim]\nlr = 0.01\nbatch_size = = 8\n')
    missing = tmp_path / "nowhere" / "job.toml"
    small = tmp_path / "small.txt"
    small.write_text(_text(1000))  # 1001 tokens: 15 sequences of 64, 1 held out, 14 < a batch of 16
    cases = {
        "mesh.data": (["--mesh.data", "3"], {},
                      "mesh.data = 3 does not divide the 2 devices; choose one of 1, 2"),
        "mesh.data=0": (["--mesh.data", "0"], {}, "mesh.data = 0: must be at least 1"),
        "invalid toml": (["--config", str(bad_toml)], {},
                         f"--config {bad_toml}: not valid TOML (Invalid value (at line 3, column 14)); fix the file"),
        "missing config": (["--config", str(missing)], {},
                           f"--config {missing}: no such file; give the path of a TOML file"),
        "small corpus": (["--data.path", str(small), "--optim.batch_size", "16"], {},
                         "the corpus is smaller than one batch: its 1001 tokens make 14 training sequences of "
                         "data.seq_len = 64 and 1 held out (data.eval_fraction = 0.02), and a batch "
                         "(optim.batch_size) takes 16; give more text (data.path"),
        "num devices env": (["--mesh.devices", "0"], {"TORCHSPMD_NUM_DEVICES": "0"},
                            "TORCHSPMD_NUM_DEVICES=0: the number of devices must be at least 1"),
        "negative devices": (["--mesh.devices", "-1"], {}, "mesh.devices = -1: give the number of devices"),
    }
    if not torch.cuda.is_available():
        cases["no cuda"] = (["--mesh.backend", "cuda"], {},
                            "mesh.backend = 'cuda': no cuda device is visible to PyTorch "
                            "(torch.get_device_module('cuda').is_available() is False); set mesh.backend = 'cpu' or "
                            "leave it empty")
    return cases


JOB_CASES = ["mesh.data", "mesh.data=0", "invalid toml", "missing config", "small corpus", "num devices env",
             "negative devices", "no cuda"]


@pytest.mark.parametrize("case", JOB_CASES)
def test_job_error_is_printed_once_by_the_launching_process(tmp_path, case):
    cases = _job_cases(tmp_path)
    if case not in cases:
        pytest.skip("CUDA is available on this machine")
    args, env, message = cases[case]
    _one_clear_error(train(tmp_path / "out", *args, "--optim.max_steps", "1", env=env, check=False), message)


def test_tokenizer_larger_than_the_pretrained_model(tmp_path):
    model = _pretrained(tmp_path / "model", vocab=64)
    big = _word_tokenizer(tmp_path / "big.json", 300)
    r = train(tmp_path / "out", "--model.pretrained", model, "--data.tokenizer", big, "--optim.max_steps", "1",
              check=False)
    _one_clear_error(r, f"data.tokenizer = '{big}' has 300 tokens, more than the 64 of the model "
                        f"(model.pretrained = '{model}', its config's vocab_size)")
    assert f"use the model's own tokenizer (data.tokenizer = '{model}')" in r.stderr


def _cfg(**sections) -> tconfig.TrainConfig:
    cfg = tconfig.preset("tiny")
    tconfig.apply_overrides(cfg, sections, "test")
    tconfig.validate(cfg)
    return cfg


def test_preflight_accepts_what_fits_and_refuses_what_does_not(tmp_path):
    """The launcher's checks at their boundaries: a tokenizer as large as the model's
    vocabulary, a corpus of exactly one batch, a mesh.data that divides the devices."""
    model = _pretrained(tmp_path / "model", vocab=64)
    text = tmp_path / "t.txt"
    rng = random.Random(0)
    text.write_text(" ".join(f"w{rng.randrange(2, 64)}" for _ in range(64 * 17)))  # 1089 tokens with the end of
    # text: 17 sequences of 64, 1 held out, 16 to train
    fits = dict(out_dir=str(tmp_path / "out"), model={"pretrained": model},
                data={"path": str(text), "seq_len": 64, "tokenizer": _word_tokenizer(tmp_path / "64.json", 64)},
                optim={"batch_size": 16}, mesh={"devices": 2, "data": 2, "backend": "cpu"})
    tconfig.preflight(_cfg(**fits))
    assert (tmp_path / "out" / "cache").is_dir()  # tokenized here: the workers map the file
    too_big = {**fits, "data": {**fits["data"], "tokenizer": _word_tokenizer(tmp_path / "65.json", 65)}}
    with pytest.raises(ts.SpmdError, match="has 65 tokens, more than the 64 of the model"):
        tconfig.preflight(_cfg(**too_big))
    with pytest.raises(ts.SpmdError, match="takes 18; give more text"):
        tconfig.preflight(_cfg(**{**fits, "optim": {"batch_size": 18}}))
    with pytest.raises(ts.SpmdError, match="data.seq_len = 65 is beyond the 64 positions of the model"):
        tconfig.preflight(_cfg(**{**fits, "data": {**fits["data"], "seq_len": 65}}))
    with pytest.raises(ts.SpmdError, match="mesh.data = 4 does not divide the 2 devices"):
        tconfig.preflight(_cfg(**{**fits, "mesh": {"devices": 2, "data": 4, "backend": "cpu"}}))


@pytest.mark.parametrize("n_train,accum,fits", [(16, 1, True), (15, 1, False), (8, 2, True), (7, 2, False)])
def test_corpus_of_one_batch(n_train, accum, fits):
    data = SimpleNamespace(seq_len=10, eval_fraction=0.0, max_bytes=0)
    optim = SimpleNamespace(batch_size=16, grad_accum=accum)
    n_tokens = n_train * 10 + 1  # the last sequence needs its next token
    if fits:
        tdata.check_corpus(n_tokens, data, optim)
    else:
        batch = "a micro-batch (optim.batch_size / optim.grad_accum)" if accum > 1 else "a batch (optim.batch_size)"
        with pytest.raises(ts.SpmdError, match=rf"make {n_train} training sequences of data.seq_len = 10, and "
                                               rf"{batch.replace('(', '[(]').replace(')', '[)]')} takes {16 // accum}"):
            tdata.check_corpus(n_tokens, data, optim)


def test_config_that_is_not_a_text_file(tmp_path):
    binary = tmp_path / "weights.toml"
    binary.write_bytes(np.random.default_rng(0).bytes(64) + b"\xff\xfe")
    with pytest.raises(ts.SpmdError, match="not a text file"):
        tconfig.load_toml(binary)
    with pytest.raises(ts.SpmdError, match="is a directory; give the path of a TOML file"):
        tconfig.load_toml(tmp_path)


def test_not_a_tokenizer_or_a_model(tmp_path):
    junk = tmp_path / "tokenizer.json"
    junk.write_text(_text(100))
    with pytest.raises(ts.SpmdError, match=r"data.tokenizer = '.*tokenizer.json': not a tokenizer \("):
        tdata.make_tokenizer(str(junk))
    from torchspmd.train.models import pretrained_config

    with pytest.raises(ts.SpmdError, match=r"model.pretrained = '.*': not a transformers model directory \(.*\); "
                                           r"give a directory written by save_pretrained"):
        pretrained_config(str(tmp_path))


# -- use_spmd ---------------------------------------------------------------------------------

_USE_SPMD = r"""
import json, os, sys
import torch, torchspmd as ts
out = {}
def attempt(name, **kw):
    try:
        ts.use_spmd(**kw)
        out[name] = None
    except ts.SpmdError as e:
        out[name] = str(e)
attempt("num_devices=0", num_devices=0)
os.environ["TORCHSPMD_NUM_DEVICES"] = "0"
attempt("env=0")
del os.environ["TORCHSPMD_NUM_DEVICES"]
os.environ["TORCHSPMD_BACKEND"] = "bogus"
attempt("bogus env")
del os.environ["TORCHSPMD_BACKEND"]
if not torch.cuda.is_available():
    attempt("cuda", backend="cuda")
    os.environ["TORCHSPMD_BACKEND"] = "cuda"
    attempt("cuda env")
print(json.dumps(out))
"""


def test_use_spmd_errors():
    r = subprocess.run([sys.executable, "-c", _USE_SPMD], capture_output=True, text=True, env=clean_env(), timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["num_devices=0"] == "use_spmd(num_devices=0): give a positive integer"
    assert got["env=0"] == ("TORCHSPMD_NUM_DEVICES=0: the number of devices must be at least 1; set it to the "
                            "number of processes to run, or unset it")
    assert got["bogus env"].startswith("TORCHSPMD_BACKEND=bogus: unknown backend; choose one of cpu, cuda, xla")
    if "cuda env" in got:
        assert got["cuda env"] == ("TORCHSPMD_BACKEND=cuda: no cuda device is visible to PyTorch "
                                   "(torch.get_device_module('cuda').is_available() is False); use "
                                   "TORCHSPMD_BACKEND=cpu")
    if "cuda" in got:
        assert got["cuda"] == ("use_spmd(backend='cuda'): no cuda device is visible to PyTorch "
                               "(torch.get_device_module('cuda').is_available() is False); use backend='cpu'")


# -- load_full_state_dict on every rank -----------------------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)  # 3 rows over 2 processes: an uneven shard

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _load_bad_state_dicts():
    torch.manual_seed(0)
    mesh = ts.Mesh(np.arange(2), (2, 1), ("fsdp", "model"))
    model = ts.FSDPv2(_Net(), mesh=mesh)

    def whole():
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    before = whole()
    g = torch.Generator().manual_seed(1)  # the same values on every process
    new = {k: torch.randn(v.shape, generator=g) for k, v in before.items()}
    cases = {
        "missing": {k: v for k, v in new.items() if k not in ("fc1.bias", "fc2.weight")},
        "unexpected": {**new, "fc3.weight": torch.randn(2, 3, generator=g), "fc3.bias": torch.randn(2, generator=g)},
        "renamed": {f"module.{k}": v for k, v in new.items()},
        "shape": {**new, "fc1.weight": torch.randn(7, 4, generator=g), "fc2.bias": torch.randn(4, generator=g)},
        "not a tensor": {**new, "fc2.bias": [0.1, 0.2, 0.3]},
    }
    errors = {}
    for name, sd in cases.items():
        try:
            ts.load_full_state_dict(model, sd)
            errors[name] = None
        except Exception as e:
            errors[name] = (type(e).__name__, str(e))
    unchanged = all(torch.equal(v, before[k]) for k, v in whole().items())
    # strict=False loads what there is and returns the rest
    left = ts.load_full_state_dict(model, cases["missing"], strict=False)
    after = whole()
    loaded = all(torch.equal(after[k], new[k]) for k in cases["missing"])
    kept = all(torch.equal(after[k], before[k]) for k in left)
    return errors, unchanged, left, loaded and kept


def test_load_full_state_dict_errors_on_every_rank(dist):
    results = dist(2).run(_load_bad_state_dicts)
    assert results[0] == results[1]  # the same error on every process
    errors, unchanged, left, partial_ok = results[0]
    assert unchanged  # a refused state dict changes nothing
    assert left == ["fc1.bias", "fc2.weight"] and partial_ok
    assert all(e is not None and e[0] == "SpmdError" for e in errors.values()), errors
    msg = {k: e[1] for k, e in errors.items()}
    assert msg["missing"] == ("load_full_state_dict: the state dict has no value for 2 of the model's keys: "
                              "'fc1.bias', 'fc2.weight'; pass strict=False to keep the model's own values for them")
    assert msg["unexpected"] == ("load_full_state_dict: the state dict has 2 keys the model lacks: 'fc3.bias', "
                                 "'fc3.weight'; pass strict=False to ignore them")
    assert "no value for 4 of the model's keys: 'fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias'" in msg["renamed"]
    assert "4 keys the model lacks: 'module.fc1.bias', 'module.fc1.weight'" in msg["renamed"]
    assert "strip the prefix 'module.' from the state dict's keys" in msg["renamed"]
    assert msg["shape"] == ("load_full_state_dict: 'fc1.weight' has shape (7, 4) in the state dict and (6, 4) in "
                            "the model, 'fc2.bias' has shape (4,) in the state dict and (3,) in the model; the state "
                            "dict comes from a model of another shape: build the model with the same configuration")
    assert msg["not a tensor"] == ("load_full_state_dict: the value of 'fc2.bias' is a list, not a tensor; give "
                                   "tensors (torch.as_tensor(value))")


def _wrong_orders():
    """Wrappers, annotations and optimizers in an order that cannot work: each case's
    error (type, message) on this process; None where it ran."""
    import functools

    mesh = ts.Mesh(np.arange(2), (2, 1), ("fsdp", "model"))
    x = ts.mark_sharding(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), mesh, ("fsdp", None))

    def step(model, opt):
        model(x).sum().backward()
        opt.step()

    def opt_before_fsdp():
        net = _Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step(ts.FSDPv2(net, mesh=mesh), opt)

    def opt_before_mark():
        net = _Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ts.mark_sharding(net.fc1.weight, mesh, ("fsdp", None))
        step(net, opt)

    def opt_after():  # the right order: trains
        net = ts.FSDPv2(_Net(), mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        before = net.fc1.weight.full_tensor().clone()
        step(net, opt)
        assert not torch.equal(before, net.fc1.weight.full_tensor())
        ts.FSDPv2(nn.Sequential(ts.FSDPv2(_Net(), mesh=mesh)), mesh=mesh)  # nested, inner first: fine

    def opt_group_added_later():  # checked once, then a group holding a replaced parameter added
        other = _Net()
        old = other.fc1.weight
        ts.FSDPv2(other, mesh=mesh)  # replaces it
        net = ts.FSDPv2(_Net(), mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        step(net, opt)
        opt.add_param_group({"params": [old]})
        step(net, opt)

    def fsdp_inside_wrapped():
        net = _Net()
        ts.FSDPv2(net, mesh=mesh)
        ts.FSDPv2(net.fc1, mesh=mesh)

    def mark_after_fsdp():
        net = _Net()
        ts.FSDPv2(net, mesh=mesh)
        ts.mark_sharding(net.fc1.weight, mesh, ("model", None))

    cases = {
        "opt_before_fsdp": opt_before_fsdp,
        "opt_before_mark": opt_before_mark,
        "opt_after": opt_after,
        "opt_group_added_later": opt_group_added_later,
        "fsdp_of_replicate": lambda: ts.FSDPv2(ts.replicate(_Net(), mesh), mesh=mesh),
        "replicate_of_fsdp": lambda: ts.replicate(ts.FSDPv2(_Net(), mesh=mesh), mesh),
        "replicate_annotated": lambda: _replicate_annotated(mesh),
        "fsdp_inside_wrapped": fsdp_inside_wrapped,
        "mark_after_fsdp": mark_after_fsdp,
        "fsdp_of_function": lambda: ts.FSDPv2(lambda t: t, mesh=mesh),
        "shard_output_not_callable": lambda: ts.FSDPv2(_Net(), mesh, 3),
        "axis_names_string": lambda: ts.Mesh(np.arange(2), (2,), "data"),
        "checkpoint_of_a_container": lambda: ts.checkpoint_module(nn.ModuleList([nn.Linear(2, 2)])),
        "minibatch_rows_not_split": lambda: ts.MpDeviceLoader(
            [torch.zeros(2, 2)], ts.device(), input_sharding=ts.ShardingSpec(mesh, (None, "fsdp"), minibatch=True)),
        "policy_of_a_class": lambda: ts.FSDPv2(_Net(), mesh=mesh, auto_wrap_policy=functools.partial(
            ts.transformer_auto_wrap_policy, transformer_layer_cls=nn.Linear)),
    }
    errors = {}
    for name, case in cases.items():
        torch.manual_seed(0)
        try:
            case()
            errors[name] = None
        except Exception as e:
            errors[name] = (type(e).__name__, str(e))
    return errors


def _replicate_annotated(mesh):
    net = _Net()
    ts.mark_sharding(net.fc1.weight, mesh, ("fsdp", None))
    ts.replicate(net, mesh)


def test_wrong_order_is_refused_with_the_fix_on_every_rank(dist):
    results = dist(2).run(_wrong_orders)
    assert results[0] == results[1]  # the same error on every process
    errors = results[0]
    assert errors["opt_after"] is None
    expected = {
        "opt_before_fsdp": ("SpmdError", "SGD.step(): this optimizer holds parameter 'fc1.weight', which FSDPv2 "
                            "replaced with its shard", "Build the optimizer after wrapping"),
        "opt_before_mark": ("SpmdError", "SGD.step(): this optimizer holds a parameter that mark_sharding replaced",
                            "optimizer = torch.optim.SGD(model.parameters(), ...)"),
        "opt_group_added_later": ("SpmdError", "SGD.step(): this optimizer holds parameter 'fc1.weight', which "
                                  "FSDPv2 replaced with its shard", "Build the optimizer after wrapping"),
        "fsdp_of_replicate": ("SpmdError", "was made data-parallel by ts.replicate", "Wrap the plain model"),
        "replicate_of_fsdp": ("SpmdError", "replicate: parameter 'fc1.weight' is sharded", "Leave it out"),
        "replicate_annotated": ("SpmdError", "replicate: parameter 'fc1.weight' is sharded", "Leave it out"),
        "fsdp_inside_wrapped": ("SpmdError", "parameter 'weight' is already sharded by an FSDPv2 around",
                                "wrap inner modules first"),
        "mark_after_fsdp": ("SpmdError", "mark_sharding: this parameter was made by FSDPv2",
                            "annotate the model's parameters before wrapping it"),
        "fsdp_of_function": ("TypeError", "FSDPv2(module=...): expected an nn.Module, got function", ""),
        "shard_output_not_callable": ("TypeError", "FSDPv2(shard_output=...): expected a callable", "got int"),
        "axis_names_string": ("SpmdError", "Mesh(axis_names='data'): give a tuple of names", "('data',)"),
        "checkpoint_of_a_container": ("SpmdError", "checkpoint_module: ModuleList has no forward of its own",
                                      "apply checkpoint_module to each layer inside it"),
        "minibatch_rows_not_split": ("SpmdError", "a ShardingSpec with minibatch=True must split dim 0",
                                     "ShardingSpec(mesh, ('fsdp', None), minibatch=True)"),
        "policy_of_a_class": ("SpmdError", "transformer_layer_cls=Linear): give a set of layer classes",
                              "transformer_layer_cls={Linear}"),
    }
    for name, (kind, what, fix) in expected.items():
        assert errors[name] is not None and errors[name][0] == kind, (name, errors[name])
        assert what in errors[name][1] and fix in errors[name][1], (name, errors[name][1])
