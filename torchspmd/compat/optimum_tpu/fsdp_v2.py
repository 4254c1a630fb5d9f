"""``optimum.tpu.fsdp_v2`` under ``--xla-compat``: torchspmd's (``torchspmd.hf.fsdp_v2``),
for every architecture. Stock ``transformers.Trainer`` / ``trl.SFTTrainer`` given
``TrainingArguments(**get_fsdp_training_args(model))`` train sharded, as
``torchspmd.hf.Trainer`` does."""

from torchspmd.compat.stand_ins import not_provided
from torchspmd.hf.fsdp_v2 import get_fsdp_config, get_fsdp_training_args, use_fsdp_v2  # noqa: F401

__getattr__ = not_provided("optimum.tpu.fsdp_v2")
