"""Programs with code between a tensor-parallel pair's linears (``up`` column-parallel, ``down``
row-parallel over ``'model'``), for the pair proof (``torchspmd/engines/native/global_view/feature_flow.py``):
each trained a few steps with Adam on one plain process (the oracle; this module does not
import torchspmd at import time) and under FSDPv2 on ``('fsdp', 'model')``, where the pair's
activation must stay split exactly where the code between acts on each process's features
alone, and be gathered (exact) everywhere else."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

D, FEAT, HEADS = 6, 8, 4  # input features, the pair's features (4 heads of 2), heads
STEPS = 2


def _heads(h):  # (b, t, 8) -> (b, t, 4, 2), softmax within each head, back
    x = h.view(*h.shape[:-1], -1, FEAT // HEADS)
    return torch.softmax(x, dim=-1).flatten(-2)


def _heads_reshape(h):  # reshape (its -1 resolved before the view) and a per-head rms norm
    x = h.reshape(*h.shape[:-1], -1, FEAT // HEADS)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return x.transpose(-1, -2).transpose(-1, -2).reshape(*h.shape[:-1], -1)


def _heads_attention(h):  # (b, t, 8) -> (b, 4, t, 2): attention of each head over the tokens
    b, t = h.shape[:2]
    x = h.view(b, t, -1, FEAT // HEADS).transpose(1, 2)
    return F.scaled_dot_product_attention(x, x, x, is_causal=True).transpose(1, 2).reshape(b, t, -1)


def _eager_attention(h):  # the same with matmuls (4-D: batched over batch and heads)
    b, t = h.shape[:2]
    x = h.view(b, t, -1, FEAT // HEADS).transpose(1, 2)
    w = torch.softmax(x @ x.transpose(-1, -2) / 2, dim=-1)
    return (w @ x).transpose(1, 2).reshape(b, t, -1)


def _fixed_heads(h):  # a view into the model's 4 heads, written as a number
    return torch.softmax(h.view(h.shape[0], h.shape[1], HEADS, FEAT // HEADS), -1).view(h.shape)


def _interleaved(h):  # (b, t, 8) -> (b, t, 2, 4): "heads" taking features 0, 2, 4, 6 and 1, 3, 5, 7
    x = h.view(*h.shape[:-1], FEAT // HEADS, -1)
    return torch.softmax(x, dim=-1).flatten(-2)


#: name -> (code between the pair's linears, whether the activation may stay split)
BETWEEN = {
    "gelu": (F.gelu, True),
    "gated": (None, True),  # silu(gate(x)) * up(x): two columns into one row
    "dropout": (None, True),  # (in eval mode: the identity; training draws per split, test_tensor_parallel)
    "heads": (_heads, True),
    "heads-reshape": (_heads_reshape, True),
    "attention": (_heads_attention, True),
    "eager-attention": (_eager_attention, True),
    "softmax": (lambda h: torch.softmax(h, -1), False),
    "layernorm": (lambda h: F.layer_norm(h, h.shape[-1:]), False),
    "sum": (lambda h: h - h.sum(-1, keepdim=True) / 3, False),
    "fixed-heads": (_fixed_heads, False),
    "interleaved": (_interleaved, False),
    "bias": (None, False),  # a whole (8,) parameter added to the features
    "returned": (None, False),  # the activation is an output of the forward too
}


class Program(nn.Module):
    def __init__(self, between: str):
        super().__init__()
        self.between = between
        self.up = nn.Linear(D, FEAT)
        self.gate = nn.Linear(D, FEAT) if between == "gated" else None
        self.shift = nn.Parameter(torch.randn(FEAT)) if between == "bias" else None
        self.down = nn.Linear(FEAT, D)

    def forward(self, x):
        h = self.up(x)
        fn = BETWEEN[self.between][0]
        if fn is not None:
            h = fn(h)
        elif self.between == "gated":
            h = F.silu(self.gate(x)) * h
        elif self.between == "dropout":
            h = F.dropout(torch.tanh(h), 0.5, self.training)
        elif self.between == "bias":
            h = h + self.shift
        out = self.down(h) + x
        return (out, h) if self.between == "returned" else out


def batches(rows: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 3, D, generator=g), torch.randn(rows, 3, D, generator=g)) for _ in range(STEPS)]


def _loss(out, y):
    if isinstance(out, tuple):
        return F.mse_loss(out[0], y) + out[1].pow(2).mean()
    return F.mse_loss(out, y)


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(between: str, rows: int, shape=None):
    """(losses, last gradients, final parameters, pair decisions) of the program; ``shape``: the
    ('fsdp', 'model') mesh (None: one plain process)."""
    torch.manual_seed(0)
    model = Program(between)
    if between == "dropout":
        model.eval()
    data = batches(rows)
    paths = None
    if shape is not None:
        import torchspmd as ts

        mesh = ts.Mesh(np.arange(int(np.prod(shape))), shape, ("fsdp", "model"))
        for lin in (model.up, model.gate):
            if lin is not None:
                ts.mark_sharding(lin.weight, mesh, ("model", None))
        ts.mark_sharding(model.down.weight, mesh, (None, "model"))
        model = ts.FSDPv2(model, mesh)
        spec = ts.ShardingSpec(mesh, ("fsdp", None, None))
        data = [(ts.shard_batch(x, spec), ts.shard_batch(y, spec)) for x, y in data]
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses, grads = [], {}
    for x, y in data:
        loss = _loss(model(x), y)
        loss.backward()
        losses.append(_whole(loss).item())
        grads = {k: _whole(p.grad).clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    if shape is not None:
        paths = model.pair_paths()
    return losses, grads, {k: _whole(p).detach().clone() for k, p in model.named_parameters()}, paths


def train_all(names: list[str], rows: int, shape=None) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = train(name, rows, shape)
        except Exception as e:  # noqa: BLE001 - reported as the program's result
            out[name] = f"{type(e).__name__}: {e}"
    return out


def explained(between: str) -> str:
    """``ts.explain``'s text after one call of the program under FSDPv2 on ('fsdp', 'model') = (1, 2)."""
    import torchspmd as ts

    torch.manual_seed(0)
    model = Program(between)
    mesh = ts.Mesh(np.arange(2), (1, 2), ("fsdp", "model"))
    ts.mark_sharding(model.up.weight, mesh, ("model", None))
    ts.mark_sharding(model.down.weight, mesh, (None, "model"))
    model = ts.FSDPv2(model, mesh)
    model(ts.shard_batch(batches(2)[0][0], ts.ShardingSpec(mesh, ("fsdp", None, None))))
    return str(ts.explain(model))
