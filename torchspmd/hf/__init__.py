"""Hugging Face integration: optimum-tpu's ``fsdp_v2`` conveniences and transformers'
``Trainer`` / trl's ``SFTTrainer`` on torchspmd FSDPv2, for every model.

``from torchspmd.hf import Trainer, SFTTrainer`` (transformers, and trl for
``SFTTrainer``, are imported on first use)."""

__all__ = ["Trainer", "SFTTrainer", "fsdp_v2"]


def __getattr__(name: str):
    if name in ("Trainer", "SFTTrainer"):
        from torchspmd.hf import trainer

        return getattr(trainer, name)
    if name == "fsdp_v2":
        import importlib

        return importlib.import_module("torchspmd.hf.fsdp_v2")
    raise AttributeError(f"module 'torchspmd.hf' has no attribute {name!r}")
