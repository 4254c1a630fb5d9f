"""torchspmd.hf.Trainer / SFTTrainer: transformers' and trl's trainers on FSDPv2.

The oracle is the stock trainer in one process (a world of 1) on the same data: the
sharded runs must reproduce its losses, gradient norms and evaluation loss."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

RTOL = 1e-5  # fp32
WORDS = "the cat sat on a mat dog ran far big red sun".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                eos_token="<eos>")


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=32, intermediate_size=40,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, pad_token_id=0, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def _token_rows(n, seed):
    """Rows of 3..14 tokens: padded unevenly in every batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 15, (n,), generator=g).tolist()
    return datasets.Dataset.from_list(
        [{"input_ids": torch.randint(3, len(WORDS) + 3, (k,), generator=g).tolist()} for k in lengths])


def _texts(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(3, 12, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    return datasets.Dataset.from_dict({"text": out})


def _args(out, sharded, model, **extra):
    from torchspmd.hf import fsdp_v2

    kw = dict(output_dir=out, per_device_train_batch_size=7, per_device_eval_batch_size=7, max_steps=3,
              learning_rate=1e-2, weight_decay=0.1, logging_steps=1, report_to=[], save_strategy="no",
              gradient_accumulation_steps=2, use_cpu=True, seed=0, disable_tqdm=True)
    kw.update(extra)
    if sharded:
        kw.update(fsdp_v2.get_fsdp_training_args(model))
    return transformers.TrainingArguments(**kw)


def _history(trainer):
    h = trainer.state.log_history
    return {"loss": [r["loss"] for r in h if "loss" in r], "grad_norm": [r["grad_norm"] for r in h if "grad_norm" in r]}


def _train_lm(out, sharded):
    """Train the tiny Llama 3 steps (2 epochs, accumulation 2, uneven padding); return
    the losses, gradient norms, eval loss and how the parameters are laid out."""
    from torch.distributed.tensor import DTensor

    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    cls = SpmdTrainer if sharded else transformers.Trainer
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    trainer = cls(model=model, args=_args(out, sharded, model), train_dataset=_token_rows(21, 1),
                  eval_dataset=_token_rows(14, 2), data_collator=collator)
    trainer.train()
    result = _history(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    pred = trainer.predict(_token_rows(14, 2))
    result["predictions"] = torch.as_tensor(pred.predictions)
    params = list(trainer.model.parameters())
    result["dtensor"] = all(isinstance(p, DTensor) for p in params)
    result["placements"] = sorted({str(p.placements) for p in params if isinstance(p, DTensor)})
    result["mesh_dims"] = sorted({str(p.device_mesh.mesh_dim_names) for p in params if isinstance(p, DTensor)})
    result["local_numel"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    result["numel"] = sum(p.numel() for p in params)
    result["wrapped"] = type(trainer.model_wrapped).__name__
    result["use_cache"] = trainer.model.config.use_cache
    result["checkpointed"] = sum(getattr(m, "_torchspmd_checkpointed", False) for m in trainer.model.modules())
    return result


@pytest.fixture(scope="module")
def lm_oracle(dist, tmp_path_factory):
    return dist(1).run(_train_lm, str(tmp_path_factory.mktemp("oracle")), False)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_trainer_shards_and_matches_one_process(dist, tmp_path, lm_oracle, world):
    results = dist(world).run(_train_lm, str(tmp_path), True)
    for r in results:
        assert r["wrapped"] == "SpmdFullyShardedDataParallel"
        assert r["dtensor"] and r["placements"] == ["(Shard(dim=0),)"] and r["mesh_dims"] == ["('fsdp',)"]
        assert r["numel"] == lm_oracle["numel"]
        # Each process holds about 1/world of the parameters (uneven splits round up).
        assert r["local_numel"] <= r["numel"] / world * 1.1
        assert r["use_cache"] is False and r["checkpointed"] == 2  # xla_fsdp_grad_ckpt: each decoder layer
        assert len(r["loss"]) == 3
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(lm_oracle[key]), rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(r["eval_loss"], lm_oracle["eval_loss"], rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(r["predictions"], lm_oracle["predictions"], rtol=RTOL, atol=1e-5)
    assert sum(r["local_numel"] for r in results) == lm_oracle["numel"]


def _save_and_compare(out):
    import torch.distributed as dist

    from torchspmd import full_state_dict
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    trainer = SpmdTrainer(model=model, args=_args(out, True, model, max_steps=2), train_dataset=_token_rows(21, 1),
                          data_collator=collator, processing_class=_tokenizer())
    trainer.train()
    trainer.save_model(out + "/saved")
    trained = full_state_dict(trainer.model_wrapped)
    if dist.get_rank() != 0:
        return None
    files = sorted(os.listdir(out + "/saved"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(out + "/saved").state_dict()
    assert sorted(loaded) == sorted(trained), "keys differ"
    return files, max((loaded[k] - trained[k]).abs().max().item() for k in trained)


def test_save_model_writes_a_plain_hf_directory(dist, tmp_path):
    files, diff = dist(2).run(_save_and_compare, str(tmp_path))[0]
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert diff == 0.0


def _train_with_checkpoints(out, resume=None, steps=4):
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    args = _args(out, True, model, max_steps=steps, save_strategy="steps", save_steps=2)
    trainer = SpmdTrainer(model=model, args=args, train_dataset=_token_rows(21, 1), data_collator=collator)
    trainer.train(resume_from_checkpoint=resume)
    return _history(trainer)


def test_resume_from_a_trainer_checkpoint_on_another_device_count(dist, tmp_path):
    first = dist(2).run(_train_with_checkpoints, str(tmp_path / "a"))[0]
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "optimizer" / ".metadata").is_file() and (ckpt / "model.safetensors").is_file()
    # Steps 3 and 4 again, from the checkpoint of step 2, on 4 devices.
    resumed = dist(4).run(_train_with_checkpoints, str(tmp_path / "a"), str(ckpt))[0]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(resumed[key]), torch.tensor(first[key]), rtol=RTOL, atol=1e-6)


def _sft(out, sharded):
    import torch.distributed as dist
    from peft import LoraConfig, PeftModel
    from trl import SFTConfig
    from trl import SFTTrainer as PlainSFTTrainer

    from torchspmd.hf import SFTTrainer, fsdp_v2

    model = _model()
    kw = dict(output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2, logging_steps=1,
              report_to=[], save_strategy="no", use_cpu=True, seed=0, max_length=32, bf16=False,
              disable_tqdm=True)
    if sharded:
        kw.update(fsdp_v2.get_fsdp_training_args(model))
    cls = SFTTrainer if sharded else PlainSFTTrainer
    trainer = cls(model=model, args=SFTConfig(**kw), train_dataset=_texts(24, 3), processing_class=_tokenizer(),
                  peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer.train()
    result = _history(trainer)
    if not sharded:
        return result
    trainer.save_model(out + "/adapter")
    from torchspmd import full_state_dict

    trained = full_state_dict(trainer.model_wrapped)
    if dist.get_rank() != 0:
        return result
    with open(out + "/adapter/adapter_config.json") as f:
        result["adapter_config"] = json.load(f)["peft_type"]
    result["files"] = sorted(os.listdir(out + "/adapter"))
    loaded = PeftModel.from_pretrained(_model(), out + "/adapter").state_dict()
    lora = [k for k in trained if "lora_" in k]
    result["lora_keys"] = len(lora)
    result["lora_diff"] = max((loaded[k] - trained[k]).abs().max().item() for k in lora)
    return result


def test_sft_trainer_lora_trains_like_one_process_and_saves_an_adapter(dist, tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    oracle = dist(1).run(_sft, str(tmp_path / "one"), False)[0]
    got = dist(2).run(_sft, str(tmp_path / "two"), True)[0]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(oracle[key]), rtol=RTOL, atol=1e-6)
    assert got["adapter_config"] == "LORA"
    assert "adapter_model.safetensors" in got["files"] and "model.safetensors" not in got["files"]
    assert got["lora_keys"] == 8 and got["lora_diff"] == 0.0


def _bad_batch(out):
    from torchspmd import SpmdError
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    try:
        SpmdTrainer(model=model, args=_args(out, True, model, per_device_train_batch_size=3),
                    train_dataset=_token_rows(8, 1))
    except SpmdError as e:
        return str(e)
    return None


def test_a_batch_that_cannot_be_split_names_the_argument(dist, tmp_path):
    msg = dist(4).run(_bad_batch, str(tmp_path))[0]
    assert msg is not None and "per_device_train_batch_size=3" in msg and "4 devices" in msg


def _mixed_precision(out):
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    trainer = SpmdTrainer(model=model, args=_args(out, True, model, bf16=True), train_dataset=_token_rows(8, 1))
    units = [m for m in trainer.model.modules() if hasattr(m, "_get_fsdp_state")]
    return sorted({str(m._get_fsdp_state()._mp_policy.param_dtype) for m in units}), len(units)


def test_bf16_arguments_map_to_mixed_precision(dist, tmp_path):
    dtypes, units = dist(2).run(_mixed_precision, str(tmp_path))[0]
    assert dtypes == ["torch.bfloat16"] and units == 3  # two decoder layers and the root


def test_fsdp_arguments_need_spmd_mode(tmp_path):
    import torchspmd as ts
    from torchspmd.hf import Trainer as SpmdTrainer

    if ts.is_spmd():
        pytest.skip("SPMD mode is on in this process")
    model = _model()
    with pytest.raises(ts.SpmdError, match="use_fsdp_v2"):
        SpmdTrainer(model=model, args=_args(str(tmp_path), True, model), train_dataset=_token_rows(8, 1))


def _optimizer_given(out):
    from torchspmd import SpmdError
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    try:
        SpmdTrainer(model=model, args=_args(out, True, model), train_dataset=_token_rows(8, 1),
                    optimizers=(opt, None))
    except SpmdError as e:
        return str(e)
    return None


def test_an_optimizer_made_before_sharding_is_refused(dist, tmp_path):
    msg = dist(2).run(_optimizer_given, str(tmp_path))[0]
    assert msg is not None and "optimizer_cls_and_kwargs" in msg
