"""optimum-tpu's ``fsdp_v2`` helpers, for every decoder architecture transformers ships.

    from torchspmd.hf import fsdp_v2
    fsdp_v2.use_fsdp_v2()
    args = fsdp_v2.get_fsdp_training_args(model)
    # {'fsdp': 'full_shard', 'fsdp_config': {'transformer_layer_cls_to_wrap': ['LlamaDecoderLayer'],
    #   'xla': True, 'xla_fsdp_v2': True, 'xla_fsdp_grad_ckpt': True}}

The layer class to wrap comes from ``layer_cls_to_wrap`` if given, else from the model:
its ``_no_split_modules`` (a set in transformers 5, a list in 4), else the class of the
repeated blocks in its largest ``nn.ModuleList``. PEFT (LoRA) models are unwrapped first.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.nn as nn

from torchspmd._errors import SpmdError

__all__ = ["use_fsdp_v2", "get_fsdp_config", "get_fsdp_training_args", "find_layer_classes"]


def use_fsdp_v2(**use_spmd_kwargs: Any) -> None:
    """Turn SPMD mode on (``torchspmd.use_spmd(**use_spmd_kwargs)``), as optimum-tpu's does
    on TPU. Call it first: on the native engine with several devices the program is started
    again, once per device, from the top (as ``use_spmd`` does); on the XLA backend
    (``PJRT_DEVICE`` set) one process drives every device."""
    import torchspmd as ts

    ts.use_spmd(**use_spmd_kwargs)


def get_fsdp_config(*cls_to_wrap: str) -> dict[str, Any]:
    """The ``fsdp_config`` of transformers' FSDPv2 path, wrapping the named layer classes."""
    names = []
    for c in cls_to_wrap:
        names.extend([c] if isinstance(c, str) else [x if isinstance(x, str) else x.__name__ for x in c])
    return {
        "transformer_layer_cls_to_wrap": names,
        "xla": True,
        "xla_fsdp_v2": True,
        "xla_fsdp_grad_ckpt": True,
    }


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel``, ``LoraModel``)."""
    seen = 0
    while seen < 4:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif type(model).__name__ in ("LoraModel", "PeftModel") and hasattr(model, "model"):
            inner = model.model
        else:
            return model
        if inner is model:
            return model
        model, seen = inner, seen + 1
    return model


def find_layer_classes(model: nn.Module) -> list[str]:
    """Class names of the repeated decoder blocks of ``model``."""
    model = _unwrap(model)
    present = {type(m).__name__ for m in model.modules()}
    declared = getattr(model, "_no_split_modules", None) or []
    declared = list(declared) if isinstance(declared, (list, tuple)) else sorted(declared)
    found = [n for n in declared if n in present]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1
             and len({type(c) for c in m}) == 1 and any(True for _ in m[0].parameters())]
    if lists:
        biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        return [type(biggest[0]).__name__]
    raise SpmdError(
        f"cannot find the decoder layer class of {type(model).__name__}: it declares no _no_split_modules and "
        f"has no list of repeated blocks; pass layer_cls_to_wrap=['MyDecoderLayer']"
    )


def get_fsdp_training_args(model: nn.Module, layer_cls_to_wrap: Iterable[str] | str | None = None) -> dict[str, Any]:
    """``TrainingArguments`` keyword arguments for FSDPv2: ``fsdp`` and ``fsdp_config``."""
    if layer_cls_to_wrap is None:
        names = find_layer_classes(model)
    else:
        names = [layer_cls_to_wrap] if isinstance(layer_cls_to_wrap, str) else list(layer_cls_to_wrap)
        present = {type(m).__name__ for m in _unwrap(model).modules()}
        missing = [n for n in names if (n if isinstance(n, str) else n.__name__) not in present]
        if missing:
            raise SpmdError(f"layer_cls_to_wrap={names!r}: {missing[0]!r} is not a module class of this model")
    return {"fsdp": "full_shard", "fsdp_config": get_fsdp_config(*names)}
