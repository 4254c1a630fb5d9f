"""transformers' Trainer on the XLA backend through torchspmd.hf (transformers' own torch_xla
FSDPv2 path with torchspmd's wrapping): evaluation before and after training, sharded
parameters, and a saved model that loads back."""

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("transformers")


def test_trainer_evaluates_trains_and_saves_on_xla(ts, tmp_path):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from torchspmd.hf import Trainer, fsdp_v2

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    g = np.random.default_rng(0)
    ids = g.integers(0, 64, size=(16, 12)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8,
                             per_device_eval_batch_size=8, max_steps=3, learning_rate=1e-2, report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                             **fsdp_v2.get_fsdp_training_args(model))
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    before = trainer.evaluate()["eval_loss"]  # before training: the model is not wrapped yet
    trainer.train()
    assert isinstance(trainer.model, ts.FSDPv2)
    layer = trainer.model.module.model.layers[0]
    assert isinstance(layer, ts.FSDPv2)  # one unit per decoder layer
    weight = layer.module.self_attn.q_proj.weight
    assert torch_xla._XLAC._get_xla_sharding_spec(weight) == "{devices=[4,1]0,1,2,3}"
    after = trainer.evaluate()["eval_loss"]
    assert np.isfinite(before) and after < before
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    full = ts.full_state_dict(trainer.model)
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, full[name], rtol=0, atol=0)
