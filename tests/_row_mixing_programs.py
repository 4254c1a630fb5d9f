"""Small models whose middle layer mixes the batch's rows (issue #57's table), trained with
SGD and MSE: on one plain process (the oracle; this module never imports torchspmd at import
time) and sharded, as the seed's Pattern 1 (no wrapper, a batch split over ``'data'``) or
wrapped whole in FSDPv2 on an ``('fsdp',)`` mesh. Values are drawn from a normal
distribution: no ties for the orders and extrema the layers take."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

WIDTH = 6
ROWS = 7  # per batch: not divisible by 2 or 4
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6


def _argsort_scale(h):
    n = h.shape[0]
    return h * (1 + h[:, 0].argsort().float()[:, None] / n)


#: name -> the middle layer (a function of the (rows, WIDTH) activation)
LAYERS = {
    "row-local": lambda h: torch.relu(h) * torch.sigmoid(h.amax(1, keepdim=True)),
    "amax0": lambda h: h + h.amax(0, keepdim=True),
    "amin0": lambda h: h - h.amin(0, keepdim=True),
    "abs-amax": lambda h: h / h.abs().amax(),
    "clamp-max": lambda h: torch.clamp(h, max=h.max() * 0.5),
    "topk0": lambda h: h - h.topk(2, dim=0).values.mean(0, keepdim=True),
    "median0": lambda h: h - h.median(dim=0, keepdim=True).values,
    "argsort": _argsort_scale,
    "softmax0": lambda h: torch.softmax(h, dim=0) * h.shape[0],
    "cummax0": lambda h: torch.cummax(h, dim=0).values,
    "cumsum0": lambda h: h.cumsum(0) / 4,
    "mean0": lambda h: h - h.mean(0, keepdim=True),
    "cumprod0": lambda h: torch.tanh(torch.cumprod(1 + 0.1 * torch.tanh(h), 0)),
    "argmax-gather": lambda h: h - h.gather(0, h.argmax(0, keepdim=True)),
    "nonzero": lambda h: h + torch.tanh(h[(h[:, 0] > 0).nonzero().squeeze(1)].sum(0, keepdim=True)),
    "masked-select": lambda h: h * torch.tanh(h.masked_select(h > 0).sum() / 8),
    "unique": lambda h: h * (1 + torch.unique((h[:, :2] > 0).long().sum(1)).numel() / 4),
    "batch-size": lambda h: h * h.shape[0] / 8,
    "arange-rows": lambda h: h + torch.arange(h.shape[0], dtype=h.dtype)[:, None] / 8,
}


class Model(nn.Module):
    def __init__(self, layer: str):
        super().__init__()
        self.fc1 = nn.Linear(5, WIDTH)
        self.fc2 = nn.Linear(WIDTH, 3)
        self.layer = layer

    def forward(self, x):
        return self.fc2(LAYERS[self.layer](self.fc1(x)))


def batches(rows: int = ROWS):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(STEPS)]


def train(layer: str, strategy: str = "plain", rows: int = ROWS):
    """Losses, the last step's gradients, the final parameters (whole values) and the
    automatic path's decisions (Pattern 1)."""
    torch.manual_seed(0)
    model = Model(layer)
    data = batches(rows)
    if strategy != "plain":
        import torchspmd as ts

        n = ts.global_runtime_device_count()
        if strategy == "pattern1":
            mesh = ts.Mesh(np.arange(n), (n,), ("data",))
            axis = "data"
        else:
            mesh = ts.Mesh(np.arange(n), (n,), ("fsdp",))
            axis = "fsdp"
            model = ts.FSDPv2(model, mesh)
        spec = ts.ShardingSpec(mesh, (axis, None))
        loader = ts.MpDeviceLoader(data, ts.device(), input_sharding=spec)
        data = list(loader)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    grads = {}
    for x, y in data:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        grads = {k: _whole(p.grad).clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    params = {k: _whole(p).detach().clone() for k, p in model.named_parameters()}
    decided = list(__import__("torchspmd").auto_path(model).values()) if strategy == "pattern1" else None
    return losses, grads, params, decided


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t
