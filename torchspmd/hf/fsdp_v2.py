"""optimum-tpu's ``fsdp_v2`` helpers, for every decoder architecture transformers ships.

    from torchspmd.hf import fsdp_v2
    fsdp_v2.use_fsdp_v2()
    args = fsdp_v2.get_fsdp_training_args(model)
    # {'fsdp': True, 'fsdp_config': {'transformer_layer_cls_to_wrap': ['LlamaDecoderLayer'],
    #   'xla': True, 'xla_fsdp_v2': True, 'xla_fsdp_grad_ckpt': True}}

optimum-tpu gives ``'fsdp': 'full_shard'``; transformers 5.20 and later log a deprecation
warning for a string there (on every process) and take ``fsdp=True`` for the same thing.

The layer class to wrap comes from ``layer_cls_to_wrap`` if given, else from the model:
its ``_no_split_modules`` (a set in transformers 5, a list in 4), else the class of the
repeated blocks in its largest ``nn.ModuleList``. PEFT (LoRA) models are unwrapped first.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch.nn as nn

from torchspmd.errors import SpmdError
from torchspmd.runtime import use_spmd
from torchspmd.sharding import mark_sharding

__all__ = ["use_fsdp_v2", "get_fsdp_config", "get_fsdp_training_args", "find_layer_classes", "tp_plan",
           "shard_by_tp_plan"]


def use_fsdp_v2(**use_spmd_kwargs: Any) -> None:
    """Turn SPMD mode on (``torchspmd.use_spmd(**use_spmd_kwargs)``), as optimum-tpu's does
    on TPU. Call it first: on the native engine with several devices the program is started
    again, once per device, from the top (as ``use_spmd`` does); on the XLA backend
    (``PJRT_DEVICE`` set) one process drives every device."""
    use_spmd(**use_spmd_kwargs)


def get_fsdp_config(*cls_to_wrap: str, model_axis: int = 1, context_axis: int = 1) -> dict[str, Any]:
    """The ``fsdp_config`` of transformers' FSDPv2 path, wrapping the named layer classes.
    ``model_axis`` > 1 (torchspmd only): the trainer's mesh is ``(devices // model_axis,
    model_axis)`` over ``('fsdp', 'model')`` and the model computes tensor-parallel over
    ``'model'`` as its transformers plan says (``shard_by_tp_plan``). ``context_axis`` > 1
    (torchspmd only): the mesh is ``(devices // context_axis, context_axis)`` over ``('fsdp',
    'context')`` and each sequence of a batch is split over ``'context'``."""
    names = []
    for c in cls_to_wrap:
        names.extend([c] if isinstance(c, str) else [x if isinstance(x, str) else x.__name__ for x in c])
    if type(model_axis) is not int or model_axis < 1:
        raise SpmdError(f"model_axis = {model_axis!r}: give the size of the 'model' mesh axis, an int >= 1 "
                        f"(1: FSDP alone)")
    if type(context_axis) is not int or context_axis < 1:
        raise SpmdError(f"context_axis = {context_axis!r}: give the size of the 'context' mesh axis, an int >= 1 "
                        f"(1: no sequence split)")
    if context_axis > 1 and model_axis > 1:
        raise SpmdError(f"model_axis = {model_axis} with context_axis = {context_axis}: a sequence split over "
                        f"'context' does not combine with tensor parallelism yet; set one of them to 1")
    config = {
        "transformer_layer_cls_to_wrap": names,
        "xla": True,
        "xla_fsdp_v2": True,
        "xla_fsdp_grad_ckpt": True,
    }
    if model_axis > 1:
        config["model_axis"] = model_axis
    if context_axis > 1:
        config["context_axis"] = context_axis
    return config


def _is_peft_wrapper(model: nn.Module) -> bool:
    """Whether ``model`` is one of PEFT's wrappers (``PeftModel``, a tuner such as ``LoraModel``),
    recognised by type. A program whose model is one has imported peft: nothing is imported here."""
    peft, tuners = sys.modules.get("peft"), sys.modules.get("peft.tuners.tuners_utils")
    kinds = tuple(c for c in (getattr(peft, "PeftModel", None), getattr(tuners, "BaseTuner", None)) if c is not None)
    return bool(kinds) and isinstance(model, kinds)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel``, ``LoraModel``)."""
    seen = 0
    while seen < 4:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif _is_peft_wrapper(model) and hasattr(model, "model"):
            inner = model.model
        else:
            return model
        if inner is model:
            return model
        model, seen = inner, seen + 1
    return model


def find_layer_classes(model: nn.Module) -> list[str]:
    """Class names of the repeated decoder blocks of ``model``."""
    model = unwrap_peft(model)
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


def get_fsdp_training_args(model: nn.Module, layer_cls_to_wrap: Iterable[str] | str | None = None,
                           model_axis: int = 1, context_axis: int = 1) -> dict[str, Any]:
    """``TrainingArguments`` keyword arguments for FSDPv2: ``fsdp`` and ``fsdp_config``.
    ``model_axis`` > 1 adds tensor parallelism over a ``'model'`` mesh axis of that size,
    from the model's transformers tensor-parallel plan (``tp_plan(model)``); ``context_axis``
    > 1 splits each sequence over a ``'context'`` mesh axis of that size."""
    if model_axis != 1 and isinstance(model_axis, int) and model_axis > 1 and not tp_plan(model):
        raise SpmdError(f"get_fsdp_training_args(model_axis={model_axis}): {type(unwrap_peft(model)).__name__} declares "
                        f"no tensor-parallel plan (config.base_model_tp_plan); use model_axis=1, or annotate "
                        f"its weights with mark_sharding and wrap it with FSDPv2 yourself")
    if layer_cls_to_wrap is None:
        names = find_layer_classes(model)
    else:
        names = [layer_cls_to_wrap] if isinstance(layer_cls_to_wrap, str) else list(layer_cls_to_wrap)
        present = {type(m).__name__ for m in unwrap_peft(model).modules()}
        missing = [n for n in names if (n if isinstance(n, str) else n.__name__) not in present]
        if missing:
            raise SpmdError(f"layer_cls_to_wrap={names!r}: {missing[0]!r} is not a module class of this model")
    # (True, not optimum-tpu's 'full_shard': transformers >= 5.20 warns that a string is deprecated)
    return {"fsdp": True, "fsdp_config": get_fsdp_config(*names, model_axis=model_axis, context_axis=context_axis)}


# transformers' tensor-parallel styles, as sharding annotations of the module's weight (and
# bias) over the model axis; "gather" styles gather the output of a column-parallel linear.
_COL = {"colwise": False, "colwise_rep": True, "colwise_gather_output": True}
_ROW = ("rowwise", "rowwise_rep", "rowwise_split_input")
_EMBED = {"embedding_rowwise": 0, "embedding_colwise": 1}


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan transformers declares for ``model`` (module-name patterns,
    ``*`` for a layer index, to styles): the model's ``_tp_plan``, else its config's
    ``base_model_tp_plan`` under the base model's prefix. Empty when it declares none."""
    model = unwrap_peft(model)
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def _adapter_linears(module: nn.Module, name: str) -> list[nn.Module]:
    adapters = getattr(module, name, None)
    if isinstance(adapters, nn.ModuleDict):
        return [m for m in adapters.values() if isinstance(m, nn.Linear)]
    return []


def shard_by_tp_plan(model: nn.Module, mesh, axis: str = "model") -> list[str]:
    """Annotate ``model``'s weights over ``axis`` of ``mesh`` as its transformers
    tensor-parallel plan says (``mark_sharding`` in place), for FSDPv2 to compute them
    tensor-parallel: 'colwise' -> weight (axis, None) and bias (axis,), 'rowwise' -> weight
    (None, axis), 'embedding_rowwise' -> (axis, None), 'embedding_colwise' -> (None, axis);
    'colwise_rep'/'colwise_gather_output' gather the output. Under PEFT the frozen base
    layer of an adapted module is annotated (the adapters stay whole, sharded by FSDP).
    Styles with no annotation equivalent (packed, sequence-parallel, expert-parallel) are
    left to FSDP, with a warning naming them. Returns the annotated parameter names."""
    import re
    import warnings

    if mesh.axis_names is None or axis not in mesh.axis_names:
        raise SpmdError(f"shard_by_tp_plan(axis={axis!r}): the mesh has axes {mesh.axis_names}; build it with a "
                        f"{axis!r} axis, e.g. Mesh(ids, (n // m, m), ('fsdp', {axis!r}))")
    inner = unwrap_peft(model)
    plan = tp_plan(inner)
    if not plan:
        raise SpmdError(f"{type(inner).__name__} declares no tensor-parallel plan (no _tp_plan, no "
                        f"config.base_model_tp_plan): annotate its weights with mark_sharding instead")
    rules = [(re.compile(re.escape(k).replace(r"\*", r"[^.]+") + "$"), k, v) for k, v in plan.items()]
    done: list[str] = []
    skipped: set[str] = set()
    for name, module in inner.named_modules():
        rule = next((r for r in rules if r[0].match(name)), None)
        if rule is None:
            continue
        style = rule[2]
        target = module
        while not isinstance(target, (nn.Linear, nn.Embedding)) and isinstance(
                getattr(target, "base_layer", None), nn.Module):
            target = target.base_layer  # PEFT: the adapted layer
        specs = {}
        # Under LoRA the adapter's path must come out split as the base layer's does: a
        # column-parallel layer's lora_B splits its outputs; a row-parallel one's lora_A
        # takes the split input.
        adapters = []
        if style in _COL and isinstance(target, nn.Linear):
            specs = {"weight": (axis, None), "bias": (axis,)}
            adapters = [(m, {"weight": (axis, None), "bias": (axis,)}) for m in _adapter_linears(module, "lora_B")]
            for m in (target, *(a for a, _ in adapters)):
                m._torchspmd_tp_gather = _COL[style]
        elif style in _ROW and isinstance(target, nn.Linear):
            specs = {"weight": (None, axis)}
            adapters = [(m, {"weight": (None, axis)}) for m in _adapter_linears(module, "lora_A")]
        elif style in _EMBED and isinstance(target, nn.Embedding):
            specs = {"weight": (axis, None) if _EMBED[style] == 0 else (None, axis)}
        else:
            skipped.add(f"{rule[1]}: {style!r}")
            continue
        for layer, layer_specs in [(target, specs), *adapters]:
            for pname, spec in layer_specs.items():
                p = getattr(layer, pname, None)
                if p is not None:
                    mark_sharding(p, mesh, spec)
                    done.append(f"{name}.{pname}")
    if skipped:
        warnings.warn(f"shard_by_tp_plan: {sorted(skipped)} have no tensor-parallel annotation here; those "
                      f"modules stay sharded by FSDP only", stacklevel=2)
    return done
