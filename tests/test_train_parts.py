"""The train job's parts: transformers architectures under FSDPv2, data formats, tokenizers."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchspmd as ts
from torchspmd.train import data as tdata
from torchspmd.train.config import ModelConfig
from torchspmd.train.models import build_model, layer_classes, logits_of

ARCHS = ["llama", "mistral", "qwen2", "gemma", "gpt2", "seed"]
VOCAB = 61


def _cfg(name):
    return ModelConfig(name=name, dim=32, num_layers=2, num_heads=4, intermediate_size=48, max_seq_len=16)


def _steps(name, spmd):
    torch.manual_seed(0)
    model, info = build_model(_cfg(name), VOCAB)
    layers = {c.__name__ for c in layer_classes(model)}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4 * 3, 9), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if spmd:
        import functools

        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
        policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls=layer_classes(model))
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(3):
        xb, yb = x[4 * i: 4 * i + 4], y[4 * i: 4 * i + 4]
        if spmd:
            xb, yb = ts.mark_sharding(xb, mesh, ("fsdp", None)), ts.mark_sharding(yb, mesh, ("fsdp", None))
        loss = F.cross_entropy(logits_of(model(xb)).reshape(-1, VOCAB), yb.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return layers, losses


@pytest.mark.parametrize("name", ARCHS)
def test_architecture_under_fsdpv2_matches_one_device(dist, name):
    ref_layers, ref = _steps(name, False)
    for layers, losses in dist(2).run(_steps, name, True):
        assert layers == ref_layers and len(layers) == 1
        np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)


def test_layer_class_found_without_no_split_modules():
    model, _ = build_model(_cfg("llama"), VOCAB)
    model._no_split_modules = None
    assert {c.__name__ for c in layer_classes(model)} == {"LlamaDecoderLayer"}


def test_text_jsonl_parquet_and_datasets_sources(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha text")
    (folder / "b.jsonl").write_text(json.dumps({"text": "beta"}) + "\n" + json.dumps({"text": "gamma"}) + "\n")
    pq.write_table(pa.table({"text": ["delta", "epsilon"]}), folder / "c.parquet")
    docs = list(tdata.iter_documents(str(folder), "text"))
    assert docs == ["alpha text", "beta", "gamma", "delta", "epsilon"]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": ["one", "two"]}).save_to_disk(str(saved))
    assert list(tdata.iter_documents(str(saved), "body")) == ["one", "two"]
    with pytest.raises(ts.SpmdError, match="no field 'text'"):
        list(tdata.iter_documents(str(saved), "text"))


def test_stdlib_corpus_exists():
    files = tdata.stdlib_files()
    assert len(files) > 100 and any(f.name == "os.py" for f in files)


def test_packing_labels_and_split():
    tokens = np.arange(0, 41, dtype=np.uint16)
    train, held = tdata.split(tokens, 4, 0.2)
    assert len(train) + len(held) == 10 and len(held) == 2
    x, y = train[3]
    assert x.tolist() == [12, 13, 14, 15] and y.tolist() == [13, 14, 15, 16]
    hx, _ = held[0]
    assert hx.tolist() == [32, 33, 34, 35]


def test_sampler_is_deterministic_and_resumable():
    a = tdata.ResumableBatchSampler(10, 3, seed=7)
    first = [b for _, b in zip(range(8), a)]
    resumed = [b for _, b in zip(range(5), tdata.ResumableBatchSampler(10, 3, seed=7, start=3))]
    assert first[3:] == resumed
    assert all(len(b) == 3 for b in first)
    assert len(set(sum(first[:3], []))) == 9  # one epoch: no sample twice


def test_byte_and_local_tokenizers(tmp_path):
    tok = tdata.ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.eos_id == 256
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["def f(x): return x + 1"] * 50,
                          trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    path = tmp_path / "tokenizer.json"
    t.save(str(path))
    hf = tdata.make_tokenizer(str(path))
    assert hf.eos_id == t.token_to_id("</s>") and hf.vocab_size == t.get_vocab_size()
    assert hf.decode(hf.encode("return x")).replace(" ", "") == "returnx"


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _legacy_checkpoint(directory):
    """A checkpoint in the layout before the optimizer's groups were one value (DCP had
    flattened the list of groups into a key per entry) still loads."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from _helpers import dcp_keys

    from torchspmd import checkpoint as ckpt
    from torchspmd.checkpoint import optimizer_state

    def make():
        torch.manual_seed(0)
        model = ts.FSDPv2(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)),
                          ts.Mesh(np.arange(2), (2,), ("fsdp",)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    model, opt = make()
    F.mse_loss(model(torch.randn(4, 5)), torch.zeros(4, 3)).backward()
    opt.step()
    old = optimizer_state.optim_state(model, opt)
    old["param_groups"] = pickle.loads(old["param_groups"])  # the former layout: a list of dicts
    path = f"{directory}/step-00000001"
    dcp.save({"model": model.state_dict(), "optim": old}, checkpoint_id=path)
    if torch.distributed.get_rank() == 0:
        torch.save({"step": 1}, f"{path}/state.pt")
    torch.distributed.barrier()
    flat = dcp_keys(path)
    fresh, fresh_opt = make()
    fresh_opt.param_groups[0]["lr"] = 0.5
    ckpt.load(path, fresh, fresh_opt)
    same = all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(model.parameters(), fresh.parameters()))
    moments = all(opt.state[p].keys() == fresh_opt.state[q].keys()  # AdamW's whole state: step, both moments
                  and all(torch.equal(_whole(v), _whole(fresh_opt.state[q][k]))
                          for k, v in sorted(opt.state[p].items()))
                  for p, q in zip(model.parameters(), fresh.parameters()))
    return "optim.param_groups.0.lr" in flat, same, moments, fresh_opt.param_groups[0]["lr"]


def _fused_resumes_plain(directory):
    """A checkpoint of a per-parameter-loop AdamW resumed by a fused one (and back): the
    loading optimizer keeps its own implementation; the state and the steps after it are
    the same up to rounding."""
    from torchspmd import checkpoint as ckpt

    def make(fused):
        torch.manual_seed(0)
        model = ts.FSDPv2(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)),
                          ts.Mesh(np.arange(2), (2,), ("fsdp",)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=fused)

    torch.manual_seed(1)
    batches = [(torch.randn(4, 5), torch.randn(4, 3)) for _ in range(3)]

    def train(model, opt, steps):
        for x, y in steps:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    out = []
    for saved_fused in (False, True):
        model, opt = make(saved_fused)
        train(model, opt, batches[:2])
        path = f"{directory}/{saved_fused}"
        ckpt.save(path, 2, model, opt, {"step": 2}, "")
        fresh, fresh_opt = make(not saved_fused)
        ckpt.load(f"{path}/step-00000002", fresh, fresh_opt)
        kept = [g["fused"] for g in fresh_opt.param_groups]
        train(model, opt, batches[2:])
        train(fresh, fresh_opt, batches[2:])  # fails if the loaded groups asked for the other kernel's state
        diff = max((p.full_tensor() - q.full_tensor()).abs().max().item()
                   for p, q in zip(model.parameters(), fresh.parameters()))
        # AdamW's state after it (step, both moments): relative to each tensor's largest value
        state = max(((_whole(v) - _whole(fresh_opt.state[q][k])).abs().max() / _whole(v).abs().max()).item()
                    for p, q in zip(model.parameters(), fresh.parameters()) for k, v in sorted(opt.state[p].items()))
        out.append((kept, not saved_fused, diff, state))
    return out


def test_optimizer_keeps_its_own_implementation_when_resuming(dist, tmp_path):
    for rank in dist(2).run(_fused_resumes_plain, str(tmp_path)):
        for kept, want, diff, state in rank:
            assert kept == [want] and diff < 1e-6 and state < 1e-5, (kept, want, diff, state)


def test_checkpoint_of_the_former_layout_loads(dist, tmp_path):
    for flattened, same, moments, lr in dist(2).run(_legacy_checkpoint, str(tmp_path)):
        assert flattened and same and moments and lr == 0.01


def test_the_models_code_is_imported_before_the_workers_are_forked(tmp_path):
    # run() imports the model class's transformers modules in the launching process (nothing
    # built), so the forked workers share them; the seed decoder needs none; a bad name is left
    # to build_model's error.
    import subprocess
    import sys

    from _helpers import clean_env, tiny_llama_config

    tiny_llama_config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      max_position_embeddings=2048).save_pretrained(tmp_path)
    # one process, the cases in an order where each shows something new
    code = ("import sys\nfrom torchspmd.train.config import ModelConfig\n"
            "from torchspmd.train.models import import_model_code\n"
            "for name, pretrained in [('seed', ''), ('notamodel', ''), ('gpt2', ''), ('seed', sys.argv[1])]:\n"
            "    import_model_code(ModelConfig(name=name, pretrained=pretrained))\n"
            "    print(sorted(m for m in sys.modules if m.endswith(('modeling_llama', 'modeling_gpt2')))"
            " or 'transformers' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=clean_env(),
                       timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["False", "True", "['transformers.models.gpt2.modeling_gpt2']",
                                     "['transformers.models.gpt2.modeling_gpt2', "
                                     "'transformers.models.llama.modeling_llama']"], r.stdout


# -- the token cache, the config file's preset and paths, bad data, tokenizers without an end-of-text --------


def _bpe(path, texts, special_tokens, vocab_size=60):
    """A small BPE tokenizer.json trained on ``texts``; its special tokens come first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens))
    t.save(str(path))
    return t


def test_the_token_cache_follows_edits_of_the_corpus_and_of_the_tokenizer(tmp_path):
    # The cache key was the paths and settings only: an edited corpus (or tokenizer) in the same
    # out_dir trained on the old tokens.
    import os

    from tokenizers import Tokenizer

    from torchspmd.train.config import DataConfig

    cache = tmp_path / "cache"
    corpus = tmp_path / "c.txt"
    cfg = DataConfig(path=str(corpus), max_bytes=0)
    byte = tdata.ByteTokenizer()
    for text in ("first text", "second, longer text", "second, longer TEXT"):  # the last: the same size
        corpus.write_text(text)
        os.utime(corpus, ns=(os.stat(corpus).st_atime_ns, os.stat(corpus).st_mtime_ns + len(text) * 10**9))
        assert tdata.load_tokens(cfg, byte, cache).tolist() == list(text.encode()) + [256]
    folder = tmp_path / "docs"  # a directory: a file added to it
    folder.mkdir()
    (folder / "a.txt").write_text("alpha")
    dcfg = DataConfig(path=str(folder), max_bytes=0)
    assert tdata.load_tokens(dcfg, byte, cache).tolist() == list(b"alpha") + [256]
    (folder / "b.txt").write_text("beta")
    assert tdata.load_tokens(dcfg, byte, cache).tolist() == list(b"alpha") + [256] + list(b"beta") + [256]
    # a tokenizer.json retrained in place
    corpus.write_text("def f(x): return x + 1")
    tok_path = tmp_path / "tokenizer.json"
    for texts in (["def f(x): return x + 1"] * 50, ["return x"] * 50):
        _bpe(tok_path, texts, ["<unk>", "</s>"])
        want = Tokenizer.from_file(str(tok_path))
        expected = want.encode("def f(x): return x + 1").ids + [want.token_to_id("</s>")]
        got = tdata.load_tokens(cfg, tdata.make_tokenizer(str(tok_path)), cache).tolist()
        assert got == expected


def test_max_bytes_counts_utf8_bytes_and_cuts_the_last_document(tmp_path):
    # data.max_bytes counted characters (a text of 3-byte characters read 3x the bytes asked
    # for) and took the document crossing the limit whole.
    from torchspmd.train.config import DataConfig

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("h\u00e9llo", encoding="utf-8")  # 6 bytes, 5 characters
    (folder / "b.txt").write_text("\u20ac\u20ac\u20ac\u20ac", encoding="utf-8")  # 12 bytes, 4 characters
    (folder / "c.txt").write_text("never read", encoding="utf-8")
    byte = tdata.ByteTokenizer()
    eos = [byte.eos_id]
    for cap, text in ((6, ["h\u00e9llo"]), (7, ["h\u00e9llo"]),  # 1 byte left: no room for a euro sign
                      (13, ["h\u00e9llo", "\u20ac\u20ac"]), (18, ["h\u00e9llo", "\u20ac" * 4]),
                      (0, ["h\u00e9llo", "\u20ac" * 4, "never read"])):
        got = tdata.load_tokens(DataConfig(path=str(folder), max_bytes=cap), byte, tmp_path / "cache").tolist()
        assert got == sum((list(t.encode()) + eos for t in text), []), cap
        if cap:
            assert sum(len(t.encode()) for t in text) <= cap
    with pytest.raises(ts.SpmdError, match="data.max_bytes = 1"):
        tdata.tokenize_corpus(str(folder / "b.txt"), "text", byte, 1)


def _from_args(*argv):
    from torchspmd.train.config import from_args

    return from_args([*map(str, argv), "--print-config"])[0]  # (--print-config: no preflight)


def test_a_preset_in_the_config_file_is_the_starting_point(tmp_path):
    # `preset = "small"` in a --config file only relabelled the tiny defaults
    from torchspmd.train.config import PRESETS

    small = PRESETS["small"]["model"]
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "small"\n')
    cfg = _from_args("--config", toml)
    assert (cfg.preset, cfg.model.dim, cfg.model.num_layers, cfg.data.seq_len) == (
        "small", small["dim"], small["num_layers"], PRESETS["small"]["data"]["seq_len"])
    toml.write_text('preset = "small"\n[model]\ndim = 256\n')  # the file's settings over its preset
    cfg = _from_args("--config", toml)
    assert (cfg.preset, cfg.model.dim, cfg.model.num_layers) == ("small", 256, small["num_layers"])
    cfg = _from_args("--config", toml, "--preset", "tiny")  # a --preset flag wins over the file's
    assert (cfg.preset, cfg.model.dim, cfg.model.num_layers) == ("tiny", 256, 4)
    toml.write_text('preset = "huge"\n')
    with pytest.raises(ts.SpmdError, match=rf"^--config {toml}: preset = 'huge': unknown preset"):
        _from_args("--config", toml)


def test_the_saved_config_holds_absolute_input_paths(tmp_path, monkeypatch):
    # config.toml (saved with every checkpoint, read by export / generate) held the paths as
    # typed: relative ones failed from another directory (model.pretrained was tried on the Hub)
    import tomllib

    from torchspmd.train.export import load_plain_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("some text")
    _bpe(tmp_path / "tok.json", ["some text"] * 5, ["<unk>", "</s>"])
    (tmp_path / "pre").mkdir()
    cfg = _from_args("--data.path", "corpus.txt", "--data.tokenizer", "tok.json", "--model.pretrained", "pre")
    saved = tomllib.loads(cfg.to_toml())
    here = tmp_path.resolve()
    assert (saved["data"]["path"], saved["data"]["tokenizer"], saved["model"]["pretrained"]) == (
        str(here / "corpus.txt"), str(here / "tok.json"), str(here / "pre"))
    # a config.toml of an older run, read from elsewhere: an error naming the file, no Hub look-up
    old = tmp_path / "old" / "step-00000001"
    old.mkdir(parents=True)
    (old / "state.pt").write_bytes(b"")
    (old / "config.toml").write_text('[model]\npretrained = "pre"\n')
    monkeypatch.chdir(tmp_path / "old")
    with pytest.raises(ts.SpmdError, match=r"config.toml: model.pretrained = 'pre': no such directory"):
        load_plain_model(str(old))


def _dataset_dict(path):
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(path))


def _dataset_numbers(path):
    import datasets

    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(path))


def _parquet(table):
    def write(path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(table), path)
    return write


GOOD = json.dumps({"text": "fine"}) + "\n"
BAD_DATA = {  # name: (file name, writer, the error)
    "malformed JSON": ("d.jsonl", lambda p: p.write_text(GOOD + '{"text": "cut\n'),
                       r"d.jsonl:2: not a JSON record \(Invalid control character, column 14\); a .jsonl file "
                       r"holds one JSON object per line"),
    "a record that is a string": ("d.jsonl", lambda p: p.write_text(GOOD + '"just text"\n'),
                                  r"d.jsonl:2: a JSON str, not an object"),
    "a numeric text field": ("d.jsonl", lambda p: p.write_text(GOOD + '{"text": 12}\n'),
                             r"d.jsonl:2: field 'text' holds a JSON int \(12\), not text; set data.text_field"),
    "parquet without the field": ("d.parquet", _parquet({"content": ["a"]}),
                                  r"d.parquet: the table has no field 'text' \(fields: \['content'\]\); "
                                  r"set data.text_field"),
    "parquet with a numeric field": ("d.parquet", _parquet({"text": [1, 2]}),
                                     r"d.parquet: the table's field 'text' holds int64, not text"),
    "not parquet": ("d.parquet", lambda p: p.write_text("not a table"), r"d.parquet: not a readable parquet file"),
    "DatasetDict without train": ("saved", _dataset_dict,
                                  r"data.path = '.*saved': the data set has no 'train' split \(splits: validation\)"),
    "datasets numeric field": ("saved", _dataset_numbers, r"the data set's field 'text' holds .*int64.*, not text"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_one_error_naming_the_file_and_line_or_the_setting(tmp_path, case):
    name, write, message = BAD_DATA[case]
    write(tmp_path / name)
    with pytest.raises(ts.SpmdError, match=message):
        list(tdata.iter_documents(str(tmp_path / name), "text"))


def test_jsonl_bytes_that_are_not_utf8_are_replaced_as_in_text_files(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (tmp_path / "d.txt").write_bytes(b"caf\xe9")
    assert list(tdata.iter_documents(str(tmp_path), "text")) == ["caf\ufffd", "caf\ufffd"]


def test_a_tokenizer_without_an_end_of_text_token_is_refused(tmp_path):
    # it took the vocabulary's last entry for the end of text
    from transformers import PreTrainedTokenizerFast

    texts = ["def f(x): return x + 1"] * 50
    t = _bpe(tmp_path / "none.json", texts, ["<unk>"])
    with pytest.raises(ts.SpmdError, match=r"data.tokenizer = '.*none.json' has no end-of-text token"):
        tdata.make_tokenizer(str(tmp_path / "none.json"))
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>").save_pretrained(tmp_path / "dir")
    with pytest.raises(ts.SpmdError, match=r"data.tokenizer = '.*dir' has no eos_token"):
        tdata.make_tokenizer(str(tmp_path / "dir"))
    t = _bpe(tmp_path / "llama3.json", texts, ["<|end_of_text|>", "<unk>"])  # Llama 3's name for it
    assert tdata.make_tokenizer(str(tmp_path / "llama3.json")).eos_id == t.token_to_id("<|end_of_text|>") == 0


def test_the_accelerators_random_state_is_saved_under_its_device_type_and_old_checkpoints_read():
    from torchspmd.train.loop import device_rng_of

    state = torch.randint(0, 255, (16,), dtype=torch.uint8)
    assert device_rng_of({"device_rng": ("xpu", state)}) == ("xpu", state)
    assert device_rng_of({"device_rng": None}) is None
    # a checkpoint written before the key was device-neutral: CUDA's state under "cuda_rng"
    assert device_rng_of({"cuda_rng": state}) == ("cuda", state)
    assert device_rng_of({"cuda_rng": None}) is None
