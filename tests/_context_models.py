"""Models and batches for the 'context' axis tests (tests/test_context.py), plain PyTorch and
transformers (no torchspmd: the one-device oracle runs them in a clean process).

- ``mha``: the seed document's decoder (nn.MultiheadAttention with biases, RMSNorm), causal
  (a float mask and ``is_causal``) or not;
- ``sdpa``: a decoder whose attention is ``F.scaled_dot_product_attention`` with a mask built
  inside from the global positions: ``causal`` (``is_causal``), ``padding`` (a 4D boolean mask
  hiding each row's last keys), ``keys`` (the same as a (rows, 1, 1, seq) mask), ``documents`` (block-diagonal causal: documents of 4 tokens),
  ``float`` (an additive (seq, seq) mask), ``memory`` (cross-attention to learned memory tokens:
  keys and values not split); ``dropout``: attention dropout with that probability;
- ``llama``: a transformers Llama (RoPE, grouped-query attention, SDPA) taking ``labels`` (its
  loss computed inside, the labels shifted there).
"""

from __future__ import annotations

import _pattern1_models as P
import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = P.STEPS
LR = 1e-2


class CausalLayer(P.DecoderLayer):
    def forward(self, x):
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        residual = x
        h = self.input_layernorm(x)
        a, _ = self.self_attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = residual + a
        return x + self.mlp(self.post_attention_layernorm(x))


def _mask(kind: str, rows: int, t: int, device) -> dict:
    pos = torch.arange(t, device=device)
    if kind == "causal":
        return {"is_causal": True}
    if kind == "padding":  # row r sees keys up to t - 1 - (r % 3)
        valid = pos[None, :] < (t - torch.arange(rows, device=device) % 3)[:, None]
        return {"attn_mask": valid[:, None, None, :].expand(rows, 1, t, t)}
    if kind == "keys":  # a (rows, 1, 1, seq) mask over the keys alone (transformers' padding form)
        valid = pos[None, :] < (t - torch.arange(rows, device=device) % 3)[:, None]
        return {"attn_mask": valid[:, None, None, :]}
    if kind == "documents":  # documents of 4 tokens, causal inside each
        doc = pos // 4
        return {"attn_mask": (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])}
    if kind == "float":
        return {"attn_mask": -0.1 * (pos[:, None] - pos[None, :]).abs().float()}
    raise ValueError(kind)


class SdpaLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim = cfg["dim"]
        self.heads, self.kind, self.dropout = cfg["heads"], cfg["mask"], cfg.get("dropout", 0.0)
        # "memory": cross-attention to 5 learned memory tokens (keys and values not split)
        self.memory = nn.Parameter(torch.randn(5, dim) * 0.5) if self.kind == "memory" else None
        self.norm1, self.norm2 = P.RMSNorm(dim), P.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, cfg["inter"]), nn.GELU(), nn.Linear(cfg["inter"], dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        if self.memory is not None:
            _, k, v = self.qkv(self.memory.expand(b, -1, -1)).chunk(3, dim=-1)
            k, v = (z.reshape(b, -1, self.heads, d // self.heads).transpose(1, 2) for z in (k, v))
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (k, v))
            a = F.scaled_dot_product_attention(q, k, v, **_mask(self.kind, b, t, x.device),
                                               dropout_p=self.dropout if self.training else 0.0)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["dim"])
        self.layers = nn.ModuleList([layer(cfg) for _ in range(cfg["layers"])])
        self.norm = P.RMSNorm(cfg["dim"])
        self.lm_head = nn.Linear(cfg["dim"], cfg["vocab"], bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(cfg) -> nn.Module:
    torch.manual_seed(P.SEED)
    if cfg["model"] == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=cfg["inter"],
                             num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                             num_key_value_heads=cfg["heads"] // 2, max_position_embeddings=64,
                             attn_implementation="sdpa")
        return LlamaForCausalLM(config)
    if cfg["model"] == "mha":
        return P.DecoderModel(dict(cfg, norm="rms", bias=True)) if not cfg.get("causal") else \
            Decoder(dict(cfg, norm="rms"), CausalLayer)
    return Decoder(cfg, SdpaLayer)


def layer_class(cfg):
    if cfg["model"] == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer
    if cfg["model"] == "mha":
        return CausalLayer if cfg.get("causal") else P.DecoderLayer
    return SdpaLayer


#: STEPS global batches of random tokens and their next-token targets (the Pattern 1 tests')
batches = P.batches


def loss(cfg, model, data, target):
    """The global mean next-token loss (transformers': its labels shifted inside)."""
    if cfg["model"] == "llama":
        return model(input_ids=data, labels=data).loss
    logits = model(data)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def oracle(cfg) -> dict:
    model = build(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=P.ADAM_EPS)
    losses, grads = [], []
    for data, target in batches(cfg):
        opt.zero_grad()
        value = loss(cfg, model, data, target)
        value.backward()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
        losses.append(value.item())
    return dict(losses=losses, grads=grads, params={k: p.detach().clone() for k, p in model.named_parameters()})


def ring_inputs(seq: int, kv_heads: int, causal: bool) -> dict:
    """Random q, k, v (4 query heads, ``kv_heads`` key-value heads), the output's gradient and,
    when not ``causal``, a boolean mask per row (each row attends its own position): the same
    numbers wherever they are drawn."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, generator=g)
    k = torch.randn(2, kv_heads, seq, 8, generator=g)
    v = torch.randn(2, kv_heads, seq, 8, generator=g)
    grad = torch.randn(2, 4, seq, 8, generator=g)
    mask = None if causal else (torch.rand(2, 1, seq, seq, generator=g) < 0.5) | torch.eye(seq, dtype=torch.bool)
    return dict(q=q, k=k, v=v, grad=grad, mask=mask)


def sdpa_whole(seq: int, kv_heads: int, causal: bool) -> dict:
    """The oracle of the ring tests: torch's SDPA on the whole sequence, its output and the
    gradients of q, k and v."""
    x = ring_inputs(seq, kv_heads, causal)
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=x["mask"], is_causal=causal, enable_gqa=kv_heads != 4)
    out.backward(x["grad"])
    return dict(out=out.detach(), grads=[q.grad, k.grad, v.grad])
