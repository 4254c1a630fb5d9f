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


def _legacy_checkpoint(directory):
    """A checkpoint in the layout before the optimizer's groups were one value (DCP had
    flattened the list of groups into a key per entry) still loads."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from torchspmd import checkpoint as ckpt

    def make():
        torch.manual_seed(0)
        model = ts.FSDPv2(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)),
                          ts.Mesh(np.arange(2), (2,), ("fsdp",)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    model, opt = make()
    F.mse_loss(model(torch.randn(4, 5)), torch.zeros(4, 3)).backward()
    opt.step()
    old = ckpt._optim_state(model, opt)
    old["param_groups"] = pickle.loads(old["param_groups"])  # the former layout: a list of dicts
    path = f"{directory}/step-00000001"
    dcp.save({"model": model.state_dict(), "optim": old}, checkpoint_id=path)
    if torch.distributed.get_rank() == 0:
        torch.save({"step": 1}, f"{path}/state.pt")
    torch.distributed.barrier()
    flat = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    fresh, fresh_opt = make()
    fresh_opt.param_groups[0]["lr"] = 0.5
    ckpt.load(path, fresh, fresh_opt)
    same = all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(model.parameters(), fresh.parameters()))
    moments = all(torch.equal(opt.state[p]["exp_avg"].full_tensor(), fresh_opt.state[q]["exp_avg"].full_tensor())
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
        out.append((kept, not saved_fused, diff))
    return out


def test_optimizer_keeps_its_own_implementation_when_resuming(dist, tmp_path):
    for rank in dist(2).run(_fused_resumes_plain, str(tmp_path)):
        for kept, want, diff in rank:
            assert kept == [want] and diff < 1e-6, (kept, want, diff)


def test_checkpoint_of_the_former_layout_loads(dist, tmp_path):
    for flattened, same, moments, lr in dist(2).run(_legacy_checkpoint, str(tmp_path)):
        assert flattened and same and moments and lr == 0.01


def test_the_models_code_is_imported_before_the_workers_are_forked(tmp_path):
    # run() imports the model class's transformers modules in the launching process (nothing
    # built), so the forked workers share them; the seed decoder needs none; a bad name is left
    # to build_model's error.
    import subprocess
    import sys

    from _helpers import clean_env

    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32).save_pretrained(tmp_path)
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
