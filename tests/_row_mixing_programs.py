"""Small models whose middle layer mixes the batch's rows (issue #57's table), trained with
SGD and MSE: on one plain process (the oracle; this module never imports torchspmd at import
time) and sharded, as the seed's Pattern 1 (no wrapper, a batch split over ``'data'``) or
wrapped whole in FSDPv2 on an ``('fsdp',)`` mesh. Values are drawn from a normal
distribution: no ties for the orders and extrema the layers take."""

from __future__ import annotations

import functools

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
    if strategy in ("pattern1", "fsdpv2", "fsdpv2-nested"):
        import torchspmd as ts

        n = ts.global_runtime_device_count()
        if strategy == "pattern1":
            mesh = ts.Mesh(np.arange(n), (n,), ("data",))
            axis = "data"
        else:
            mesh = ts.Mesh(np.arange(n), (n,), ("fsdp",))
            axis = "fsdp"
            # "fsdpv2-nested": the two linear layers are units of their own inside the root
            policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear}) \
                if strategy == "fsdpv2-nested" else None
            model = ts.FSDPv2(model, mesh, auto_wrap_policy=policy)
        spec = ts.ShardingSpec(mesh, (axis, None))
        loader = ts.MpDeviceLoader(data, ts.device(), input_sharding=spec)
        data = list(loader)
    if strategy.startswith("blocks:"):
        # FSDP2's and DDP's semantics, in plain PyTorch: the model computes each process's rows
        # on their own (the shares of an FSDPv2(per_process=True) run over that many processes)
        blocks = int(strategy.split(":")[1])
        one = model

        def model(x):
            return torch.cat([one(part) for part in torch.tensor_split(x, blocks)])

        model.named_parameters = one.named_parameters
        model.parameters = one.parameters
    if strategy == "fsdpv2-per-process":
        import torchspmd as ts

        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("fsdp",))
        model = ts.FSDPv2(model, mesh, per_process=True)
        data = list(ts.MpDeviceLoader(data, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("fsdp", None))))
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
    if strategy == "pattern1":
        decided = list(__import__("torchspmd").auto_path(model).values())
    elif strategy.startswith("fsdpv2"):
        # (None: this process's rows, proven; per_process: none decided), as ts.explain lists them
        decided = [why for _, why in __import__("torchspmd").explain(model).row_paths]
    else:
        decided = None
    return losses, grads, params, decided


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_each(layers: list[str], strategy: str = "plain", rows: int = ROWS) -> dict:
    """``train`` for each layer, in one process (one start for many programs)."""
    return {layer: train(layer, strategy, rows) for layer in layers}
