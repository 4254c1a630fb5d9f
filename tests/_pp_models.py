"""The model, batches and one-device oracle of the pipeline tests. Plain PyTorch only: this
module never imports torchspmd (the oracle runs it in a clean process; see _clean.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from _tp_models import RMSNorm

VOCAB, DIM, INTER, SEQ = 37, 16, 24, 6
LAYERS = 5  # uneven over 2 and 4 stages
STEPS = 3
LR = 1e-2
MAX_NORM = 0.5  # below the gradients' global norm: every step is clipped


class Layer(nn.Module):
    """Causal attention (4 heads, computed by hand) and a GELU MLP, pre-norm; dropout after the
    MLP with ``DROPOUT`` (0 but in the dropout test)."""

    DROPOUT = 0.0

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(self.DROPOUT)
        self.norm1, self.norm2 = RMSNorm(DIM), RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.fc1, self.fc2 = nn.Linear(DIM, INTER), nn.Linear(INTER, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, DIM // 4).transpose(1, 2) for z in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.o(a)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class LM(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(tied: bool = False) -> LM:
    torch.manual_seed(0)
    return LM(tied)


class BatchCentred(Layer):
    """A layer that subtracts the batch's mean first: it mixes the rows, which pipeline stages
    (each micro-batch computed on its own) cannot reproduce."""

    def forward(self, x):
        return super().forward(x - x.mean(0, keepdim=True))


def build_mixing() -> LM:
    model = build()
    model.layers[2] = BatchCentred()
    return model


def build_head_first() -> LM:
    """The LM, its head registered before its layers (the forward uses it last)."""
    model = build()
    model._modules = {"lm_head": model._modules.pop("lm_head"), **model._modules}
    return model


def build_llama() -> nn.Module:
    """A tiny transformers Llama (4 decoder layers, grouped-query attention, its embedding tied
    to the LM head), without a KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=INTER, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True, use_cache=False)
    return LlamaForCausalLM(config)


def llama_layer():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(rows: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))
            for _ in range(STEPS)]


def held_out(rows: int):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g)


#: AdamW's eps with the 'model' axis inside the stages. Torch's default turns last-bit noise
#: of near-zero gradients (the split weights' sums run in another order) into parameter
#: differences beyond the tolerance after 3 steps (measured: 3e-6 with eps 1e-8, 1.8e-5 on one
#: embedding element with 1e-6, atol 1e-6), as in the tensor-parallel tests (_tp_models.EPS):
#: 1e-3 bounds Adam's slope; a wrong layout still differs at O(1).
TP_EPS = 1e-3


def oracle(kind: str, rows: int, eps: float = 1e-8):
    """One device: the losses, every step's gradients (after clipping), the final parameters
    and the final model's loss on ``held_out(rows)``.
    ``kind``: 'plain', 'tied' or 'llama'."""
    model = build_llama() if kind == "llama" else build(kind == "tied")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    losses, grads = [], []
    for x, y in batches(rows):
        loss = loss_fn(logits_of(model(x)), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    x, y = held_out(rows)
    with torch.no_grad():
        held = loss_fn(logits_of(model(x)), y).item()
    return losses, grads, {k: p.detach().clone() for k, p in model.named_parameters()}, held
