"""Models, batches and the one-device oracle of tests/test_pattern1_2d.py. Plain PyTorch only:
this module never imports torchspmd (the oracle runs it in a clean process; see _clean.py).

A model is described by a ``cfg`` dict (sizes, the norm, attention or not, tied embeddings),
built after ``torch.manual_seed(SEED)``: the same model on one device and on every process."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 0
STEPS = 3
LR = {"sgd": 0.1, "adam": 1e-2}
# Adam's eps. Attention's key bias has a zero gradient (softmax ignores a shift shared by every
# key), so its computed gradient is rounding noise (1e-9) that differs with the summation order of
# sharded reductions; Adam with its default eps (1e-8) turns that noise into steps of about lr
# (measured: 2.4e-3 apart from one device after 3 steps). eps = 1e-3 bounds Adam's slope by 10: a
# wrong layout still differs at O(1), last-bit noise no longer does (as tests/_tp_models.py's EPS).
ADAM_EPS = 1e-3


class RMSNorm(nn.Module):
    """The seed document's RMSNorm."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(variance + self.eps)


def _norm(kind: str, dim: int) -> nn.Module:
    return RMSNorm(dim) if kind == "rms" else nn.LayerNorm(dim)


class DecoderLayer(nn.Module):
    """The seed document's decoder layer (nn.MultiheadAttention, batch first; an MLP of two
    linears in an nn.Sequential), with the norm, the attention and the MLP's biases to choose."""

    def __init__(self, cfg):
        super().__init__()
        dim, bias = cfg["dim"], cfg.get("bias", False)
        self.input_layernorm = _norm(cfg["norm"], dim)
        self.self_attn = nn.MultiheadAttention(dim, cfg["heads"], batch_first=True) if cfg.get("attn", True) else None
        self.post_attention_layernorm = _norm(cfg["norm"], dim)
        self.mlp = nn.Sequential(nn.Linear(dim, cfg["inter"], bias=bias), nn.GELU(),
                                 nn.Linear(cfg["inter"], dim, bias=bias))

    def forward(self, x):
        if self.self_attn is not None:
            residual = x
            x = self.input_layernorm(x)
            x, _ = self.self_attn(x, x, x)
            x = residual + x
        residual = x
        x = self.post_attention_layernorm(x)
        x = self.mlp(x)
        return residual + x


class DecoderModel(nn.Module):
    """The seed document's DecoderModel; ``tied``: the LM head is the embedding's weight."""

    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["dim"])
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg["layers"])])
        self.norm = _norm(cfg["norm"], cfg["dim"])
        self.lm_head = nn.Linear(cfg["dim"], cfg["vocab"], bias=False)
        if cfg.get("tied"):
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.lm_head(x)


def build(cfg) -> DecoderModel:
    torch.manual_seed(SEED)
    return DecoderModel(cfg)


def batches(cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches (token ids, next-token targets) of random tokens."""
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, cfg["vocab"], (cfg["rows"], cfg["seq"] + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def optimizer(cfg, model: nn.Module) -> torch.optim.Optimizer:
    name = cfg.get("opt", "adam")
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR[name])
    return torch.optim.Adam(model.parameters(), lr=LR[name], eps=ADAM_EPS)


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.view(-1, output.size(-1)), target.view(-1))


def oracle(cfg) -> dict:
    """One device, plain PyTorch: the losses, every parameter's gradient at every step, and the
    parameters after the last step."""
    model = build(cfg)
    opt = optimizer(cfg, model)
    losses, grads = [], []
    for data, target in batches(cfg):
        opt.zero_grad()
        loss = loss_of(model(data), target)
        loss.backward()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, grads=grads, params={k: p.detach().clone() for k, p in model.named_parameters()})
