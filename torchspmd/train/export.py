"""``torchspmd export`` and ``torchspmd generate``: from a sharded checkpoint, in one process."""

from __future__ import annotations

from pathlib import Path

import torch

from torchspmd import checkpoint as ckpt
from torchspmd.errors import SpmdError
from torchspmd.train import data as tdata
from torchspmd.train.config import TrainConfig, apply_overrides, load_toml
from torchspmd.train.models import build_model, logits_of, model_vocab


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
    # (older jobs saved the paths as typed, relative to where they ran; a missing directory
    # must not be taken for a Hub name and fetched)
    if cfg.model.pretrained and not Path(cfg.model.pretrained).is_dir():
        raise SpmdError(f"{ck}/config.toml: model.pretrained = {cfg.model.pretrained!r}: no such directory (seen from "
                        f"{Path.cwd()}); run this where the job ran, or set model.pretrained in that file to the "
                        f"directory's absolute path")
    tokenizer = tdata.make_tokenizer(cfg.data.tokenizer)
    model, info = build_model(cfg.model, model_vocab(cfg.model, tokenizer))
    ckpt.load_full_model_state(ck, model)
    return model.eval(), cfg, tokenizer, info


def export(path: str, out: str) -> Path:
    model, cfg, tokenizer, info = load_plain_model(path)
    if info["kind"] != "hf":
        raise SpmdError("export writes a transformers directory; the seed decoder ('model.name = seed') is not a "
                        "transformers architecture: train a transformers model type (llama, gpt2, ...) to export")
    out_p = Path(out)
    if not cfg.model.pretrained:  # a config built here: its end-of-text is the tokenizer's (llama's default is 2)
        for c in (model.config, model.generation_config):
            c.bos_token_id = c.eos_token_id = c.pad_token_id = tokenizer.eos_id
    model.save_pretrained(out_p, safe_serialization=True)
    if cfg.data.tokenizer != "byte":
        src = Path(cfg.data.tokenizer)
        if src.is_dir():
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(src)).save_pretrained(out_p)
    return out_p


@torch.no_grad()
def generate(path: str, prompt: str, tokens: int, temperature: float = 0.8, top_k: int = 10, seed: int = 0) -> str:
    """Continue ``prompt`` by up to ``tokens`` tokens (stopping at end of text): sampled from the
    ``top_k`` most likely at ``temperature``, or greedy (the most likely token, as transformers'
    ``generate(do_sample=False)``) when ``temperature`` is 0 or ``top_k`` is 1."""
    if tokens < 0:
        raise SpmdError(f"generate: --tokens {tokens}: give the number of tokens to add, 0 or more")
    if temperature < 0 or top_k < 1:
        raise SpmdError(f"generate: --temperature {temperature:g} --top-k {top_k}: give a temperature of 0 or more "
                        f"(0: greedy) and a top-k of 1 or more")
    model, cfg, tokenizer, _ = load_plain_model(path)
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    g = torch.Generator().manual_seed(seed)
    for _ in range(tokens):
        logits = logits_of(model(torch.tensor([ids[-cfg.data.seq_len:]])))[0, -1]
        if temperature == 0 or top_k == 1:
            nxt = int(torch.argmax(logits))
        else:
            top = torch.topk(logits / temperature, min(top_k, logits.numel()))
            nxt = int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=g)])
        if nxt == tokenizer.eos_id:
            break
        ids.append(nxt)
    return tokenizer.decode(ids)
