"""torchspmd.hf.fsdp_v2: optimum-tpu's helpers for every architecture."""

import peft
import pytest
import torch.nn as nn
import transformers

import torchspmd as ts
from torchspmd.hf import fsdp_v2

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=48, max_position_embeddings=32)
ARCHS = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "gemma": "GemmaDecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "phi3": "Phi3DecoderLayer",
    "gpt2": "GPT2Block",
    "gpt_neox": "GPTNeoXLayer",
    "falcon": "FalconDecoderLayer",
    "opt": "OPTDecoderLayer",
    "bloom": "BloomBlock",
}


def _model(kind):
    extra = {"num_local_experts": 2, "num_experts_per_tok": 1} if kind == "mixtral" else {}
    if kind in ("gemma", "gemma2"):
        extra["head_dim"] = 8
    if kind == "phi3":
        extra["pad_token_id"] = 0
    config = transformers.AutoConfig.for_model(kind, **TINY, **extra)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", sorted(ARCHS))
def test_layer_class_for_each_architecture(kind):
    args = fsdp_v2.get_fsdp_training_args(_model(kind))
    assert args == {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": [ARCHS[kind]], "xla": True,
                                                          "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True}}


def test_without_no_split_modules_the_repeated_blocks_are_found():
    model = _model("llama")
    model._no_split_modules = None
    assert fsdp_v2.find_layer_classes(model) == ["LlamaDecoderLayer"]


def test_peft_model_is_unwrapped():
    model = peft.get_peft_model(_model("qwen2"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert fsdp_v2.find_layer_classes(model) == ["Qwen2DecoderLayer"]
    # the tuner inside (a LoraModel: no get_base_model, its model under .model), recognised by type
    base = model.get_base_model()
    assert type(model.base_model).__name__ == "LoraModel" and fsdp_v2.unwrap_peft(model.base_model) is base
    assert fsdp_v2.unwrap_peft(model) is base


def test_a_class_named_like_a_peft_wrapper_is_not_unwrapped():
    class LoraModel(nn.Module):  # the program's own class of that name: its .model is a part, not a base model
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(2, 2)

    own = LoraModel()
    assert fsdp_v2.unwrap_peft(own) is own


def test_explicit_layer_cls_to_wrap():
    args = fsdp_v2.get_fsdp_training_args(_model("llama"), layer_cls_to_wrap=["LlamaDecoderLayer"])
    assert args["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    with pytest.raises(ts.SpmdError, match="'Nope' is not a module class"):
        fsdp_v2.get_fsdp_training_args(_model("llama"), layer_cls_to_wrap="Nope")


def test_no_layer_found_names_layer_cls_to_wrap():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)

    with pytest.raises(ts.SpmdError, match="layer_cls_to_wrap"):
        fsdp_v2.get_fsdp_training_args(Flat())


def test_get_fsdp_config_shape():
    assert fsdp_v2.get_fsdp_config("A", "B") == {"transformer_layer_cls_to_wrap": ["A", "B"], "xla": True,
                                                 "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True}


def test_training_arguments_take_them_without_a_warning(tmp_path):
    # optimum-tpu's 'fsdp': 'full_shard' makes transformers (>= 5.20) log a deprecation warning
    from transformers.testing_utils import CaptureLogger

    logger = transformers.utils.logging.get_logger("transformers.training_args")
    with CaptureLogger(logger) as captured:
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                              **fsdp_v2.get_fsdp_training_args(_model("llama")))
    assert captured.out == ""
    assert args.fsdp is True and args.fsdp_config["xla_fsdp_v2"] is True
