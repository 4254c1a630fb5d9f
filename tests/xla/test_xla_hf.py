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
    from _helpers import tiny_llama
    from transformers import LlamaForCausalLM, TrainingArguments

    from torchspmd.hf import Trainer, fsdp_v2

    model = tiny_llama(seed=0)  # vocabulary 64, hidden 32, 2 layers, 4 heads (2 key/value), 32 positions
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


def test_trainer_on_xla_with_hub_kernels(ts, tmp_path):
    """transformers 5.25 with kernels >= 0.19.1 kernelizes a model at from_pretrained and again at
    every train()/eval(); kernels refuses the 'xla' device type, so the trainer's model.train()
    on the XLA device failed. The trainer undoes the kernelization before moving the model."""
    from importlib.metadata import version

    from datasets import Dataset
    from _helpers import tiny_llama
    from packaging.version import Version
    from transformers import LlamaForCausalLM, TrainingArguments

    from torchspmd.hf import Trainer, fsdp_v2

    assert Version(version("kernels")) >= Version("0.19.1"), "the environment must have the kernels release at issue"
    tiny_llama(seed=None).save_pretrained(tmp_path / "base")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    assert model.use_kernels  # transformers turned kernels on: the failure's precondition
    ids = np.random.default_rng(0).integers(0, 64, size=(8, 12)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, max_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True,
                             **fsdp_v2.get_fsdp_training_args(model))
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))
    assert not model.use_kernels
    assert np.isfinite(trainer.train().training_loss)  # (wraps the model, moves it to the XLA device, train())
    assert next(trainer.model.parameters()).device.type == "xla"
    trainer.model.eval()
    trainer.model.train()
