"""Models for the train job: the seed decoder, or any transformers causal LM built from
a config (or loaded from a local pretrained directory), and the layer class to wrap."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from torchspmd.errors import SpmdError
from torchspmd.models import DecoderLayer, DecoderModel, RMSNorm


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device (no memory); buffers stay real."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _hf_config(cfg, vocab_size: int):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise SpmdError(f"model.name = {cfg.name!r} needs transformers: pip install 'torchspmd[train]'") from None
    kwargs = dict(vocab_size=vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                  max_position_embeddings=cfg.max_seq_len, use_cache=False, tie_word_embeddings=False)
    kwargs["num_key_value_heads"] = cfg.num_kv_heads or cfg.num_heads
    try:
        config = AutoConfig.for_model(cfg.name, **kwargs)
    except ValueError:
        from transformers import CONFIG_MAPPING

        raise SpmdError(f"model.name = {cfg.name!r} is not a model type transformers knows "
                        f"(e.g. {', '.join(sorted(CONFIG_MAPPING.keys())[:12])}, ...; or 'seed')") from None
    for key, value in list(config.to_dict().items()):  # every dropout of the architecture
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, cfg.dropout)
    if hasattr(config, "n_inner"):  # GPT-2 family names its MLP size differently
        config.n_inner = cfg.intermediate_size
    if hasattr(config, "head_dim") and cfg.name not in ("gpt2",):
        config.head_dim = cfg.dim // cfg.num_heads
    return config


def pretrained_config(path: str):
    """The transformers config of a local pretrained directory (``model.pretrained``)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise SpmdError("model.pretrained needs transformers: pip install 'torchspmd[train]'") from None
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpmdError(f"model.pretrained = {path!r}: not a transformers model directory ({first}); give a "
                        f"directory written by save_pretrained (config.json and the weights)") from None


def model_vocab(cfg, tokenizer) -> int:
    """The embedding rows of a model built from settings: ``model.vocab_size``, or the
    tokenizer's vocabulary when it is 0."""
    if cfg.vocab_size and cfg.vocab_size < tokenizer.vocab_size:
        raise SpmdError(f"model.vocab_size = {cfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} "
                        f"tokens: ids from {cfg.vocab_size} up would have no embedding; raise it to at least "
                        f"{tokenizer.vocab_size} or set 0 (the tokenizer's size)")
    return cfg.vocab_size or tokenizer.vocab_size


def import_model_code(cfg) -> None:
    """Import the transformers modules that define ``cfg``'s model class, nothing built (the
    launcher does it before it forks the workers, which then find them loaded, their pages
    shared, instead of each importing them). Anything that goes wrong is left to
    ``build_model``, which reports it."""
    if cfg.name == "seed" and not cfg.pretrained:
        return
    try:
        import transformers
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        )

        model_type = pretrained_config(cfg.pretrained).model_type if cfg.pretrained else cfg.name
        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    except Exception:  # noqa: BLE001 - build_model raises the error the job reports
        pass


def build_model(cfg, vocab_size: int) -> tuple[nn.Module, dict]:
    """The model (parameters on meta if ``cfg.meta_init``) and a description: kind,
    max positions, the hf config (or None)."""
    ctx = params_on_meta() if cfg.meta_init else contextlib.nullcontext()
    if cfg.pretrained:
        from transformers import AutoModelForCausalLM

        if cfg.meta_init:  # its architecture on meta; the job loads the weights into the shards (load_pretrained)
            config = pretrained_config(cfg.pretrained)
            config.use_cache = False
            with ctx:
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            return model, {"kind": "hf", "positions": getattr(config, "max_position_embeddings", None),
                           "config": model.config}
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.pretrained, dtype=torch.float32)
        except OSError as e:
            raise SpmdError(f"model.pretrained = {cfg.pretrained!r}: not a transformers model directory ({e})") from None
        model.config.use_cache = False
        return model, {"kind": "hf", "positions": getattr(model.config, "max_position_embeddings", None),
                       "config": model.config}
    if cfg.name == "seed":
        with ctx:
            model = DecoderModel(vocab_size=vocab_size, dim=cfg.dim, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                                 intermediate_size=cfg.intermediate_size, max_seq_len=cfg.max_seq_len,
                                 dropout=cfg.dropout)
        return model, {"kind": "seed", "positions": cfg.max_seq_len, "config": None}
    config = _hf_config(cfg, vocab_size)
    from transformers import AutoModelForCausalLM

    with ctx:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, {"kind": "hf", "positions": cfg.max_seq_len, "config": config}


def load_pretrained(model: nn.Module, path: str, device) -> None:
    """Give a model built on the meta device from a pretrained directory's config (and then
    sharded by FSDPv2) that directory's weights: every process allocates its own shards on
    ``device``; process 0 alone reads the whole model (on the CPU) and sends it to the
    others one parameter at a time, each keeping its part."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # (real: see params_on_meta)
    model.to_empty(device=device)
    first = dist.get_rank() == 0
    full = {}
    keys = [".".join(part for part in name.split(".") if part != "_orig_module")  # FSDPv2's wrappers
            for name, _ in model.named_parameters()]
    error: list = [None]
    if first:  # (a failure here is every process's error: the others would wait in the broadcasts)
        from transformers import AutoModelForCausalLM

        try:
            full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
            missing = [k for k in keys if k not in full]
            if missing:
                error = [f"it has no weight {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"]
        except Exception as e:
            error = [f"its weights cannot be read ({type(e).__name__}: {str(e).strip()[:200]})"]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise SpmdError(f"model.pretrained = {path!r}: {error[0]} (on process 0)")
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
        for key, (_, p) in zip(keys, model.named_parameters()):
            whole = (full.pop(key).to(device=device, dtype=p.dtype) if first else
                     torch.empty(p.shape, dtype=p.dtype, device=device))
            dist.broadcast(whole, src=0)  # (then cut here: DTensor's scatter fails on 2-D meshes' _StridedShard)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(whole)


def layer_classes(model: nn.Module) -> set[type]:
    """The repeated block to wrap: from ``_no_split_modules`` (transformers), else the class
    of the children of the largest ``nn.ModuleList``."""
    if isinstance(model, DecoderModel):
        return {DecoderLayer}
    names = getattr(model, "_no_split_modules", None) or []
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    found = {by_name[n] for n in names if n in by_name}
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise SpmdError(f"cannot find the repeated layers of {type(model).__name__} to wrap")
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return {type(biggest[0])}


@torch.no_grad()
def init_weights(model: nn.Module, kind: str) -> None:
    """Initialise parameters in place (after a meta-device build, on each shard)."""
    if kind == "seed":
        for m in model.modules():
            if isinstance(m, nn.MultiheadAttention):
                m._reset_parameters()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        return
    std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
        elif "norm" in type(m).__name__.lower():
            for name, p in m.named_parameters(recurse=False):
                (p.fill_(1.0) if name == "weight" else p.zero_())


def logits_of(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def count_params(model: nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    return sum(p.numel() for p in model.parameters()) if not any(
        isinstance(p, DTensor) for p in model.parameters()) else sum(
        int(torch.Size(p.shape).numel()) for p in model.parameters())
