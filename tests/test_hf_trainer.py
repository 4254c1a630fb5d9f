"""torchspmd.hf.Trainer / SFTTrainer: transformers' and trl's trainers on FSDPv2.

The oracle is the stock trainer in one clean process (spawned, torchspmd never imported:
``_clean.run_clean``) on the same data: the sharded runs must reproduce its losses,
gradient norms and evaluation loss. This module imports torchspmd only inside the sharded
code paths, so that the oracle's process stays clean."""

import json
import os

import datasets
import pytest
import torch
import transformers
from _clean import run_clean
from _helpers import tiny_llama, tiny_llama_config

RTOL = 1e-5  # fp32
WORDS = "the cat sat on a mat dog ran far big red sun".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                eos_token="<eos>")


# the tiny Llama (_helpers.TINY_LLAMA) with the word tokenizer's vocabulary and special tokens
LLAMA = dict(vocab_size=len(WORDS) + 3, intermediate_size=40, max_position_embeddings=64, pad_token_id=0,
             eos_token_id=2)


def _llama_config(**extra):
    return tiny_llama_config(**LLAMA, **extra)


def _model():
    return tiny_llama(seed=0, **LLAMA)


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


def _args(out, sharded, model, model_axis=1, context_axis=1, **extra):
    kw = dict(output_dir=out, per_device_train_batch_size=7, per_device_eval_batch_size=7, max_steps=3,
              learning_rate=1e-2, weight_decay=0.1, logging_steps=1, report_to=[], save_strategy="no",
              gradient_accumulation_steps=2, use_cpu=True, seed=0, disable_tqdm=True)
    kw.update(extra)
    if sharded:
        from torchspmd.hf import fsdp_v2

        kw.update(fsdp_v2.get_fsdp_training_args(model, model_axis=model_axis, context_axis=context_axis))
    return transformers.TrainingArguments(**kw)


def _history(trainer):
    h = trainer.state.log_history
    return {"loss": [r["loss"] for r in h if "loss" in r], "grad_norm": [r["grad_norm"] for r in h if "grad_norm" in r]}


def _train_lm(out, sharded, model_axis=1, context_axis=1, **extra):
    """Train the tiny Llama 3 steps (2 epochs, accumulation 2, uneven padding); return
    the losses, gradient norms, eval loss, predictions (with a short last batch) and how the
    parameters are laid out."""
    from torch.distributed.tensor import DTensor

    if sharded:
        from torchspmd.hf import Trainer as cls
    else:
        cls = transformers.Trainer
    model = _model()
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    trainer = cls(model=model, args=_args(out, sharded, model, model_axis, context_axis, **extra),
                  train_dataset=_token_rows(21, 1),
                  eval_dataset=_token_rows(12, 2), data_collator=collator)
    trainer.train()
    result = _history(trainer)
    # 12 rows, batches of 7: the last batch of 5 rows weighs 5/12 in the evaluation loss; on 4
    # devices it can't be split (2, 2, 1, 0): it is made up to 7 rows, the 2 added ones taken out
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    pred = trainer.predict(_token_rows(12, 2))
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
    result["param_dtypes"] = sorted({str(p.dtype) for p in params})
    q = trainer.model.model.layers[0].self_attn.q_proj.weight
    result["q_proj"] = (q.to_local().numel() if isinstance(q, DTensor) else q.numel(), q.numel())
    return result


@pytest.fixture(scope="module")
def lm_oracle(tmp_path_factory):
    return run_clean(_train_lm, str(tmp_path_factory.mktemp("oracle")), False)


@pytest.mark.smoke
@pytest.mark.parametrize("world", [2])  # (4 processes: the token classifier's and SFT's tests)
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


def test_trainer_with_a_model_axis_computes_tensor_parallel_and_matches_one_process(dist, tmp_path, lm_oracle):
    # fsdp_config['model_axis'] = 2 on 4 devices: a (2, 2) ('fsdp', 'model') mesh, Llama's
    # transformers plan (q/k/v, gate/up column-parallel; o, down row-parallel; the embedding
    # split over the vocabulary; the LM head's output gathered) with FSDP over 'fsdp'.
    results = dist(4).run(_train_lm, str(tmp_path), True, 2)
    for r in results:
        assert r["mesh_dims"] == ["('fsdp', 'model')", "('fsdp',)"]
        assert r["q_proj"][0] == r["q_proj"][1] // 4  # split over both axes
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(lm_oracle[key]), rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(r["eval_loss"], lm_oracle["eval_loss"], rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(r["predictions"], lm_oracle["predictions"], rtol=RTOL, atol=1e-5)


def test_trainer_with_a_context_axis_matches_one_process(dist, tmp_path, lm_oracle):
    # fsdp_config['context_axis'] = 2 on 4 devices: a (2, 2) ('fsdp', 'context') mesh, each
    # sequence of a batch split over 'context' (padded batches, training, evaluation, predictions)
    results = dist(4).run(_train_lm, str(tmp_path), True, 1, 2)
    # FSDP shards over 'fsdp' x 'context' flattened: each process holds a quarter, none twice
    assert sum(r["local_numel"] for r in results) == lm_oracle["numel"]
    for r in results:
        assert r["mesh_dims"] == ["('fsdp_context',)"]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(lm_oracle[key]), rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(r["eval_loss"], lm_oracle["eval_loss"], rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(r["predictions"], lm_oracle["predictions"], rtol=RTOL, atol=1e-5)


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


def _final_state(trainer):
    """The weights and AdamW's state at the end of training, whole, by parameter name (every
    process gathers them; process 0 returns them)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchspmd import full_state_dict

    def whole(v):
        return v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()

    optim = {f"{name}.{k}": whole(v) for name, p in trainer.model.named_parameters()
             for k, v in sorted(trainer.optimizer.state.get(p, {}).items())}
    model = full_state_dict(trainer.model_wrapped)
    return {"model": model, "optim": optim} if dist.get_rank() == 0 else None


def _train_with_checkpoints(out, resume=None, steps=4, model_axis=1, unused=False):
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    if unused:  # a layer the forward never calls: no gradient, so AdamW keeps no state for it
        model.unused = torch.nn.Linear(3, 3)
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    args = _args(out, True, model, model_axis, max_steps=steps, save_strategy="steps", save_steps=2)
    trainer = SpmdTrainer(model=model, args=args, train_dataset=_token_rows(21, 1), data_collator=collator)
    trainer.train(resume_from_checkpoint=resume)
    return {**_history(trainer), "state": _final_state(trainer)}


def _same_as_uninterrupted(resumed, first):
    """The resumed run's losses and gradient norms after the checkpoint, and its weights and
    AdamW state at the end, are the uninterrupted run's."""
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(resumed[key]), torch.tensor(first[key]), rtol=RTOL, atol=1e-6)
    for part in ("model", "optim"):
        got, want = resumed["state"][part], first["state"][part]
        assert got.keys() == want.keys() and want, part
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_resume_from_a_trainer_checkpoint_on_another_device_count(dist, tmp_path):
    first = dist(2).run(_train_with_checkpoints, str(tmp_path / "a"))[0]
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "optimizer" / ".metadata").is_file() and (ckpt / "model.safetensors").is_file()
    # Steps 3 and 4 again, from the checkpoint of step 2, on 4 devices.
    resumed = dist(4).run(_train_with_checkpoints, str(tmp_path / "a"), str(ckpt))[0]
    _same_as_uninterrupted(resumed, first)


def test_resume_with_a_parameter_the_optimizer_keeps_no_state_for(dist, tmp_path):
    # the checkpoint has no AdamW state for a parameter that never got a gradient; loading
    # made state for every parameter and asked the checkpoint for it (a missing-key error)
    first = dist(2).run(_train_with_checkpoints, str(tmp_path / "a"), None, 4, 1, True)[0]
    resumed = dist(2).run(_train_with_checkpoints, str(tmp_path / "a"), str(tmp_path / "a" / "checkpoint-2"), 4, 1,
                          True)[0]
    _same_as_uninterrupted(resumed, first)


def test_a_checkpoint_of_a_2d_mesh_resumes_on_a_1d_one(dist, tmp_path):
    first = dist(4).run(_train_with_checkpoints, str(tmp_path / "a"), None, 4, 2)[0]
    ckpt = tmp_path / "a" / "checkpoint-2"
    # Steps 3 and 4 again from the (2, 2) checkpoint of step 2, on a (4, 1) mesh.
    resumed = dist(4).run(_train_with_checkpoints, str(tmp_path / "a"), str(ckpt), 4, 1)[0]
    _same_as_uninterrupted(resumed, first)


def _train_with_a_failing_save(out, where):
    """Train 4 steps, saving every 2, with the save of step 4 failing: ``"rng"`` on process
    1 alone (its RNG file), ``"model"`` on process 0 (the weights, which it alone writes)."""
    import torch.distributed as dist
    from transformers.trainer_utils import get_last_checkpoint

    from torchspmd import SpmdError
    from torchspmd.hf import Trainer as SpmdTrainer

    def full_disk(step, rank):
        if step == 4 and dist.get_rank() == rank:
            raise OSError(28, "No space left on device")

    class Failing(SpmdTrainer):
        def _save_rng_state(self, output_dir):
            if where == "rng":
                full_disk(self.state.global_step, 1)
            return super()._save_rng_state(output_dir)

        def _save(self, output_dir=None, state_dict=None):
            if where == "model":
                full_disk(self.state.global_step, 0)
            return super()._save(output_dir, state_dict)

    model = _model()
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    args = _args(out, True, model, max_steps=4, save_strategy="steps", save_steps=2)
    trainer = Failing(model=model, args=args, train_dataset=_token_rows(21, 1), data_collator=collator)
    try:
        trainer.train()
    except SpmdError as e:
        return str(e), sorted(os.listdir(out)), os.path.basename(get_last_checkpoint(out))
    return None


@pytest.mark.parametrize("where,rank", [("rng", 1), ("model", 0)])
def test_a_failed_checkpoint_save_fails_everywhere_and_leaves_no_partial_checkpoint(dist, tmp_path, where, rank):
    out = str(tmp_path / "a")
    got = dist(2).run(_train_with_a_failing_save, out, where)
    assert all(g is not None for g in got), got
    messages = {g[0] for g in got}
    assert len(messages) == 1, messages  # the same error on every process
    msg = messages.pop()
    assert f"checkpoint {out}/checkpoint-4 was not saved" in msg and f"process {rank}" in msg, msg
    assert "No space left on device" in msg and "the checkpoints saved before it are unchanged" in msg, msg
    files, last = got[0][1], got[0][2]  # (process 0 removed the unfinished checkpoint before raising)
    assert files == ["checkpoint-2"] and last == "checkpoint-2", files
    # resume_from_checkpoint=True takes the last complete checkpoint and goes on exactly
    whole = dist(2).run(_train_with_checkpoints, str(tmp_path / "b"))[0]
    resumed = dist(2).run(_train_with_checkpoints, out, True)[0]
    _same_as_uninterrupted(resumed, whole)


def _best_checkpoint(out):
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    args = _args(out, True, model, max_steps=6, save_strategy="steps", save_steps=2, eval_strategy="steps",
                 eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss", save_total_limit=1)
    trainer = SpmdTrainer(model=model, args=args, train_dataset=_token_rows(21, 1), eval_dataset=_token_rows(7, 2),
                          data_collator=collator)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    with open(os.path.join(best, "trainer_state.json")) as f:
        recorded = json.load(f)["best_model_checkpoint"]
    evals = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
    return best, recorded, sorted(os.listdir(out)), evals


def test_the_best_checkpoint_is_recorded_where_it_ends_up(dist, tmp_path):
    out = str(tmp_path / "a")
    best, recorded, files, evals = dist(2).run(_best_checkpoint, out)[0]
    step = 2 * (1 + min(range(len(evals)), key=evals.__getitem__))
    assert best == recorded == os.path.join(out, f"checkpoint-{step}"), (best, recorded, evals)
    # save_total_limit=1 with load_best_model_at_end: transformers keeps the best one alone at the end
    assert files == [f"checkpoint-{step}"], files


def _sft(out, sharded, model_axis=1):
    from peft import LoraConfig, PeftModel
    from trl import SFTConfig

    model = _model()
    kw = dict(output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2, logging_steps=1,
              report_to=[], save_strategy="no", use_cpu=True, seed=0, max_length=32, bf16=False,
              disable_tqdm=True)
    if sharded:
        from torchspmd.hf import SFTTrainer as cls
        from torchspmd.hf import fsdp_v2

        kw.update(fsdp_v2.get_fsdp_training_args(model, model_axis=model_axis))
    else:
        from trl import SFTTrainer as cls
    trainer = cls(model=model, args=SFTConfig(**kw), train_dataset=_texts(24, 3), processing_class=_tokenizer(),
                  peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer.train()
    result = _history(trainer)
    if not sharded:
        return result
    trainer.save_model(out + "/adapter")
    import torch.distributed as dist

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


@pytest.mark.parametrize("world,model_axis", [(2, 1), (4, 2)])
def test_sft_trainer_lora_trains_like_one_process_and_saves_an_adapter(dist, tmp_path, world, model_axis):
    oracle = run_clean(_sft, str(tmp_path / "one"), False)
    got = dist(world).run(_sft, str(tmp_path / "two"), True, model_axis)[0]
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


# bf16=True against the stock trainer's bf16=True (accelerate's autocast over fp32 weights), on
# 2 devices. The sharded run's weight gradients are rounded to bf16 per device before their fp32
# sum, the stock run's once over the whole batch. The first step agrees to 1e-7 (loss) and 3e-6
# (gradient norm); Adam's first update is about lr * sign(gradient), so a weight whose two
# per-device partial gradients nearly cancel can move the other way, and the later steps
# differ more: measured up to 1.5e-4 (losses) and 1.6e-3 (gradient norms) with transformers
# 5.24 / accelerate 1.15 (3e-5 and 9e-5 with the packages of an earlier session). Without bf16
# (fp32) the differences from the stock bf16 run reach 3.5e-4 (losses) and 4.7e-3 (gradient
# norms), measured with the same packages: these tolerances still tell the two apart.
BF16_LOSS_RTOL, BF16_GRAD_NORM_RTOL = 2.5e-4, 3e-3
BF16_PREDICTION_ATOL = 1e-2  # logits of about 4: bf16's spacing there is 1.6e-2; measured 4e-3


def test_bf16_trains_like_the_stock_trainer_with_bf16(dist, tmp_path):
    oracle = run_clean(_train_lm, str(tmp_path / "one"), False, bf16=True)
    got = dist(2).run(_train_lm, str(tmp_path / "two"), True, bf16=True)[0]
    assert got["param_dtypes"] == oracle["param_dtypes"] == ["torch.float32"]  # fp32 master weights
    assert got["predictions"].dtype == oracle["predictions"].dtype == torch.float32
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(oracle["loss"]), rtol=BF16_LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(oracle["grad_norm"]),
                               rtol=BF16_GRAD_NORM_RTOL, atol=0)
    torch.testing.assert_close(got["eval_loss"], oracle["eval_loss"], rtol=BF16_LOSS_RTOL, atol=0)
    torch.testing.assert_close(got["predictions"], oracle["predictions"], rtol=0, atol=BF16_PREDICTION_ATOL)


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


def _split_model_given(out):
    import numpy as np

    import torchspmd as ts
    from torchspmd.hf import Trainer as SpmdTrainer

    model = _model()
    layer = type(model.model.layers[0])
    n = ts.global_runtime_device_count()
    ts.pipeline(model, ts.Mesh(np.arange(n), (n,), ("pipeline",)), split=layer, microbatches=2)
    try:
        SpmdTrainer(model=model, args=_args(out, True, model), train_dataset=_token_rows(8, 1))
    except ts.SpmdError as e:
        return str(e)
    return None


def test_a_model_split_into_pipeline_stages_is_refused_with_what_to_use(dist, tmp_path):
    """The Trainer runs each batch's forward and backward itself: a pipeline schedule cannot run
    under it. The error, on every process, says what to use."""
    msgs = dist(2).run(_split_model_given, str(tmp_path))
    assert msgs[0] == msgs[1] and "split into pipeline stages" in msgs[0] and "runner.step" in msgs[0], msgs


# -- label smoothing, short last batches (evaluation, prediction, an IterableDataset) ---------
def _row_count_metrics(pred):
    """What compute_metrics sees: the rows and a sum over their labelled positions."""
    import numpy as np

    labels, logits = pred.label_ids, pred.predictions
    if not isinstance(labels, list):  # (eval_do_concat_batches=False: a list of batches)
        labels, logits = [labels], [logits]
    rows = sum(np.asarray(b).shape[0] for b in labels)
    total = sum(float(np.asarray(p)[np.asarray(b) != -100].sum()) for p, b in zip(logits, labels))
    return {"rows": float(rows), "logit_sum": total}


def _edges(out, sharded):
    """label_smoothing_factor=0.1; training on an IterableDataset of 15 rows (batch 7 on 2
    devices: the last 1-row batch of each pass is left out by torchspmd, so the stock run,
    the oracle, reads the first 14 rows); evaluation and prediction of 15 rows (the last
    batch of 1 row can't be split: it is made up to 2 rows and the added row taken out again)
    and of 16 (a last batch of 2 rows), with compute_metrics, without labels, per batch
    (eval_do_concat_batches=False) and from an IterableDataset."""
    import warnings

    import numpy as np

    if sharded:
        from torchspmd.hf import Trainer as cls
    else:
        cls = transformers.Trainer
    model = _model()
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    train = _token_rows(15, 1)
    train = (train if sharded else train.select(range(14))).to_iterable_dataset()
    trainer = cls(model=model, args=_args(out, sharded, model, label_smoothing_factor=0.1), train_dataset=train,
                  data_collator=collator, compute_metrics=_row_count_metrics)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    result = _history(trainer)
    result["left_out"] = sum("the last batch of 1 rows" in str(w.message) for w in caught)
    for n in (15, 16):
        metrics = trainer.evaluate(_token_rows(n, 2))
        result[f"eval{n}"] = {k: metrics[f"eval_{k}"] for k in ("loss", "rows", "logit_sum")}
    pred = trainer.predict(_token_rows(15, 2))
    result["predictions"] = torch.as_tensor(pred.predictions)
    result["label_ids"] = torch.as_tensor(pred.label_ids)
    result["iterable_predictions"] = torch.as_tensor(trainer.predict(_token_rows(15, 2).to_iterable_dataset())
                                                     .predictions)
    trainer.args.eval_do_concat_batches = False
    batches = trainer.predict(_token_rows(15, 2)).predictions
    result["batch_shapes"] = [tuple(np.asarray(b).shape) for b in batches]
    trainer.args.eval_do_concat_batches = True
    trainer.data_collator = transformers.DataCollatorWithPadding(_tokenizer())  # no labels
    unlabelled = trainer.predict(_token_rows(15, 2))
    result["unlabelled"] = (torch.as_tensor(unlabelled.predictions), unlabelled.label_ids)
    return result


def test_label_smoothing_and_short_last_batches_match_the_stock_trainer(dist, tmp_path):
    oracle = run_clean(_edges, str(tmp_path / "one"), False)
    got = dist(2).run(_edges, str(tmp_path / "two"), True)
    for r in got:  # every process holds the global results
        assert len(r["loss"]) == 3 and r["left_out"] >= 1
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(oracle[key]), rtol=RTOL, atol=1e-6)
        for n in (15, 16):
            assert r[f"eval{n}"]["rows"] == oracle[f"eval{n}"]["rows"] == n
            for key in ("loss", "logit_sum"):
                torch.testing.assert_close(r[f"eval{n}"][key], oracle[f"eval{n}"][key], rtol=RTOL, atol=1e-5)
        assert r["predictions"].shape[0] == r["label_ids"].shape[0] == 15
        torch.testing.assert_close(r["predictions"], oracle["predictions"], rtol=RTOL, atol=1e-5)
        assert torch.equal(r["label_ids"], oracle["label_ids"])
        torch.testing.assert_close(r["iterable_predictions"], oracle["iterable_predictions"], rtol=RTOL, atol=1e-5)
        assert r["batch_shapes"] == oracle["batch_shapes"] and r["batch_shapes"][-1][0] == 1
        assert r["unlabelled"][1] is None and oracle["unlabelled"][1] is None
        torch.testing.assert_close(r["unlabelled"][0], oracle["unlabelled"][0], rtol=RTOL, atol=1e-5)


# -- a model that computes its own loss: sequence classification -----------------------------------
def _classify(out, sharded, labels):
    """A Llama sequence classifier (integer labels: cross-entropy; or float labels with one
    output: regression) evaluated on 13 rows in batches of 8: the last batch of 5 rows can't
    give each of 4 devices a row (2, 2, 1, 0) and is made up to 7 rows by repeating its last."""
    if sharded:
        from torchspmd.hf import Trainer as cls
    else:
        cls = transformers.Trainer
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(_llama_config(num_labels=3 if labels == "int" else 1))
    rows = _token_rows(13, 3)
    g = torch.Generator().manual_seed(4)
    values = (torch.randint(0, 3, (13,), generator=g).tolist() if labels == "int"
              else torch.randn(13, generator=g).tolist())
    rows = rows.add_column("labels", values)
    collator = transformers.DataCollatorWithPadding(_tokenizer())
    trainer = cls(model=model, args=_args(out, sharded, model, per_device_eval_batch_size=8), data_collator=collator)
    pred = trainer.predict(rows)
    return {"loss": trainer.evaluate(rows)["eval_loss"], "predictions": torch.as_tensor(pred.predictions),
            "label_ids": torch.as_tensor(pred.label_ids)}


@pytest.mark.parametrize("labels", ["float"])  # (integer labels: the token classifier's test)
def test_a_short_last_evaluation_batch_leaves_a_models_own_loss_as_the_stock_trainers(dist, tmp_path, labels):
    """A model computing its own loss (a mean over its rows, made global as the row-weighted
    mean): the rows repeated to make up the last batch weighed in its evaluation loss (on 4
    devices a last batch of 5 rows became 7, its last row counted three times). It is now run
    as 4 rows and 1 row repeated 4 times; the loss and the predictions are the stock
    trainer's in one process."""
    oracle = run_clean(_classify, str(tmp_path / "one"), False, labels)
    for got in dist(4).run(_classify, str(tmp_path / "four"), True, labels):
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(oracle["loss"]), rtol=RTOL, atol=1e-6)
        assert got["predictions"].shape == oracle["predictions"].shape == (13, 3 if labels == "int" else 1)
        torch.testing.assert_close(got["predictions"], oracle["predictions"], rtol=RTOL, atol=1e-5)
        assert torch.equal(got["label_ids"], oracle["label_ids"])


def _tag(out, sharded):
    """A Llama token classifier trained 3 steps and evaluated: its labels are -100 on each
    row's first token and on the padding (DataCollatorForTokenClassification), so the
    labelled tokens fall unevenly on the devices."""
    if sharded:
        from torchspmd.hf import Trainer as cls
    else:
        cls = transformers.Trainer
    torch.manual_seed(0)
    # (classifier_dropout: its default, 0.1, draws masks no two runs share)
    model = transformers.LlamaForTokenClassification(_llama_config(num_labels=5, classifier_dropout=0.0))

    def tagged(n, seed):
        rows = _token_rows(n, seed)
        g = torch.Generator().manual_seed(seed + 10)
        return rows.add_column("labels", [[-100] + torch.randint(0, 5, (len(r) - 1,), generator=g).tolist()
                                          for r in rows["input_ids"]])

    collator = transformers.DataCollatorForTokenClassification(_tokenizer())
    trainer = cls(model=model, args=_args(out, sharded, model, gradient_accumulation_steps=1),
                  train_dataset=tagged(21, 1), eval_dataset=tagged(13, 2), data_collator=collator)
    trainer.train()
    result = _history(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_a_token_classifier_trains_like_one_process(dist, tmp_path, world):
    """A model whose own loss is a mean over labelled tokens (token classification, masked
    LM): each process's mean over its rows, made global as the row-weighted mean, was not the
    mean over the batch's labelled tokens when they fall unevenly on the processes. Its loss
    is now computed from the global logits, as a causal LM's."""
    oracle = run_clean(_tag, str(tmp_path / "one"), False)
    for got in dist(world).run(_tag, str(tmp_path / "many"), True):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(oracle[key]), rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["eval_loss"]), torch.tensor(oracle["eval_loss"]),
                                   rtol=RTOL, atol=1e-6)


# -- an MoE model's router load-balancing loss --------------------------------------------------
def _train_moe(out, sharded):
    if sharded:
        from torchspmd.hf import Trainer as cls
    else:
        cls = transformers.Trainer
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=len(WORDS) + 3, hidden_size=32, intermediate_size=40,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                        router_aux_loss_coef=0.5, max_position_embeddings=64, pad_token_id=0,
                                        eos_token_id=2)
    model = transformers.MixtralForCausalLM(config)
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    trainer = cls(model=model, args=_args(out, sharded, model), train_dataset=_token_rows(21, 1),
                  eval_dataset=_token_rows(15, 2), data_collator=collator)
    trainer.train()
    result = _history(trainer)
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    return result


def test_an_moe_models_router_aux_loss_is_the_one_of_the_whole_batch(dist, tmp_path):
    # Mixtral with output_router_logits: the stock model adds router_aux_loss_coef times its
    # load-balancing loss (over the whole batch, padding masked out) to the loss
    oracle = run_clean(_train_moe, str(tmp_path / "one"), False)
    got = dist(2).run(_train_moe, str(tmp_path / "two"), True)[0]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(oracle[key]), rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(got["eval_loss"], oracle["eval_loss"], rtol=RTOL, atol=1e-6)


# -- SFTTrainer: padding-free packing ------------------------------------------------------------
def _sft_packing(out):
    from trl import SFTConfig

    from torchspmd import SpmdError
    from torchspmd.hf import SFTTrainer, fsdp_v2

    model = _model()
    messages = []
    # (padding_free without packing: trl wants max_length=None)
    for extra in (dict(packing=True, max_length=32), dict(padding_free=True, max_length=None)):
        args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                         bf16=False, **extra, **fsdp_v2.get_fsdp_training_args(model))
        try:
            SFTTrainer(model=model, args=args, train_dataset=_texts(8, 3), processing_class=_tokenizer())
        except SpmdError as e:
            messages.append(str(e))
        else:
            messages.append(None)
    return messages


def test_sft_padding_free_packing_is_refused_naming_the_setting(dist, tmp_path):
    for messages in dist(2).run(_sft_packing, str(tmp_path)):
        for msg in messages:
            assert msg is not None and "packing_strategy='wrapped'" in msg and "padding_free=True" in msg, msg
