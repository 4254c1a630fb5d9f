"""``torchspmd export`` and ``torchspmd generate``: from a sharded checkpoint, in one process."""

from __future__ import annotations

from pathlib import Path

import torch

from torchspmd import checkpoint as ckpt
from torchspmd._errors import SpmdError
from torchspmd.train import data as tdata
from torchspmd.train.config import TrainConfig, apply_overrides, load_toml
from torchspmd.train.models import build_model, logits_of


def _resolve(path: str) -> Path:
    p = Path(path)
    if (p / "checkpoints").is_dir():  # an output directory: its newest checkpoint
        latest = ckpt.latest_checkpoint(p / "checkpoints")
        if latest is None:
            raise SpmdError(f"{path}: the output directory holds no complete checkpoint")
        return latest
    if not (p / "state.pt").exists():
        raise SpmdError(f"{path}: not a torchspmd checkpoint (or an output directory holding one)")
    return p


def load_plain_model(path: str):
    """The checkpoint's model as a plain module on the CPU, its config and tokenizer."""
    ck = _resolve(path)
    cfg = TrainConfig()
    apply_overrides(cfg, load_toml(ck / "config.toml"), f"{ck}/config.toml")
    cfg.model.meta_init = False
    tokenizer = tdata.make_tokenizer(cfg.data.tokenizer)
    model, info = build_model(cfg.model, tokenizer.vocab_size)
    ckpt.load_full_model_state(ck, model)
    return model.eval(), cfg, tokenizer, info


def export(path: str, out: str) -> Path:
    model, cfg, tokenizer, info = load_plain_model(path)
    if info["kind"] != "hf":
        raise SpmdError("export writes a transformers directory; the seed decoder ('model.name = seed') is not a "
                        "transformers architecture: train a transformers model type (llama, gpt2, ...) to export")
    out_p = Path(out)
    model.save_pretrained(out_p, safe_serialization=True)
    if cfg.data.tokenizer != "byte":
        src = Path(cfg.data.tokenizer)
        if src.is_dir():
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(src)).save_pretrained(out_p)
    return out_p


@torch.no_grad()
def generate(path: str, prompt: str, tokens: int, temperature: float = 0.8, top_k: int = 10, seed: int = 0) -> str:
    model, cfg, tokenizer, _ = load_plain_model(path)
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    g = torch.Generator().manual_seed(seed)
    for _ in range(tokens):
        logits = logits_of(model(torch.tensor([ids[-cfg.data.seq_len:]])))[0, -1]
        top = torch.topk(logits / max(temperature, 1e-5), top_k)
        nxt = int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=g)])
        if nxt == tokenizer.eos_id:
            break
        ids.append(nxt)
    return tokenizer.decode(ids)
