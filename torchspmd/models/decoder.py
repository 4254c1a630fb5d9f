"""The seed decoder: a small Llama-style causal language model.

Embedding, then ``num_layers`` pre-norm blocks (RMSNorm, causal
``nn.MultiheadAttention(batch_first=True)``, RMSNorm, GELU MLP), a final RMSNorm and
an LM head. No distributed code: torchspmd wraps it from outside.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, intermediate_size: int, dropout: float = 0.0):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads, dropout=dropout, batch_first=True, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.up = nn.Linear(dim, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        h = self.attn_norm(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = x + a
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class DecoderModel(nn.Module):
    """``DecoderModel(vocab_size=3200, dim=1024, num_layers=8, num_heads=8,
    intermediate_size=4096)`` maps token ids ``(batch, seq)`` to logits
    ``(batch, seq, vocab_size)``."""

    def __init__(
        self,
        vocab_size: int = 3200,
        dim: int = 1024,
        num_layers: int = 8,
        num_heads: int = 8,
        intermediate_size: int = 4096,
        max_seq_len: int = 2048,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(
            DecoderLayer(dim, num_heads, intermediate_size, dropout) for _ in range(num_layers)
        )
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
