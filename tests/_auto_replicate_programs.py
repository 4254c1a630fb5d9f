"""The programs of tests/test_auto_replicate.py: Pattern 1 (a plain model, batches split by
``MpDeviceLoader``) with ``spmd``, and the same program on one device without it, the oracle.
This module never imports torchspmd at import time, and without ``spmd`` not at all: the
oracle runs in a clean process (tests/_clean.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

RTOL, ATOL = 1e-5, 1e-6
VOCAB, SEQ = 29, 8


class Net(nn.Module):
    """Sizes not divisible by the device count; an unused parameter when ``unused``; a
    row-mixing BatchNorm when ``norm`` (with ``norm="eval"``: its running statistics, each
    row on its own); rows mixed one way (a cumulative sum over the batch) when ``cumsum``;
    the loss inside forward when ``inner_loss``."""

    def __init__(self, unused=False, norm=False, inner_loss=False, cumsum=False):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 3)
        self.norm = nn.BatchNorm1d(13) if norm else None
        if norm == "eval":
            with torch.no_grad():
                self.norm.running_mean.uniform_(-0.5, 0.5)
                self.norm.running_var.uniform_(0.5, 2.0)
        self.eval_norm = norm == "eval"
        self.spare = nn.Linear(3, 3) if unused else None
        self.inner_loss = inner_loss
        self.cumsum = cumsum

    def forward(self, x, target=None):
        h = torch.tanh(self.fc1(x))
        if self.norm is not None:
            self.norm.train(self.training and not self.eval_norm)
            h = self.norm(h)
        if self.cumsum:
            h = h.cumsum(0) / 4
        out = self.fc2(h)
        if self.inner_loss:
            return F.cross_entropy(out, target)
        return out


def decoder():
    return _decoder_module().DecoderModel(vocab_size=VOCAB, dim=16, num_layers=2, num_heads=2, intermediate_size=24,
                                          max_seq_len=SEQ)


def _decoder_module():
    """torchspmd/models/decoder.py (plain PyTorch), loaded from its file: the oracle's process
    never imports the torchspmd package."""
    module = sys.modules.get("_torchspmd_decoder_file")
    if module is None:
        path = Path(__file__).resolve().parent.parent / "torchspmd" / "models" / "decoder.py"
        spec = importlib.util.spec_from_file_location("_torchspmd_decoder_file", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def _seed_decoder():
    """The seed document's decoder layers (nn.MultiheadAttention returning its attention
    weights, RMSNorm, a GELU MLP): DTensor regathers the batch inside the attention."""
    from _pattern1_models import DecoderModel

    return DecoderModel(dict(vocab=VOCAB, dim=16, layers=2, heads=2, inter=24, norm="rms"))


class Recurrent(nn.Module):
    """A language model of two LSTM layers (batch first) and a GRU."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 10)
        self.lstm = nn.LSTM(10, 9, num_layers=2, batch_first=True)
        self.gru = nn.GRU(9, 11, batch_first=True)
        self.head = nn.Linear(11, VOCAB)

    def forward(self, ids):
        return self.head(self.gru(self.lstm(self.embed(ids))[0])[0])


def data(kind: str, rows: int):
    g = torch.Generator().manual_seed(5)
    if kind in ("decoder", "seed-decoder", "recurrent"):
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(rows, 7, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _loss(kind, model, x, y):
    if kind in ("decoder", "seed-decoder", "recurrent"):
        return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    if getattr(model, "inner_loss", False):
        return model(x, target=y)
    return F.cross_entropy(model(x), y)


def run(kind: str, rows: int, batch: int, accumulate: int = 1, spmd: bool = False, wrap: bool = False,
         annotate: bool = False, net_kwargs=None, eval_first=False, raise_first=False):
    """Train for len(batches) / accumulate steps; return (losses, grads per step, state, decisions)."""
    torch.manual_seed(0)
    models = {"decoder": decoder, "seed-decoder": _seed_decoder, "recurrent": Recurrent}
    model = models.get(kind, lambda: Net(**(net_kwargs or {})))()
    x_all, y_all = data(kind, rows)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=batch)
    if spmd:
        import torchspmd as ts

        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        if annotate:  # one parameter split over the devices: the sharded path
            ts.mark_sharding(model.fc1.weight, mesh, ("data", None))
        if wrap:
            model = ts.replicate(model, mesh)
        spec = ("data", None)
        loader = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, spec))
    # (The attention's key bias has a zero gradient, computed as rounding noise that Adam's
    # default eps turns into full steps: see _pattern1_models.ADAM_EPS.)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **({"eps": 1e-3} if kind == "seed-decoder" else {}))
    if eval_first:  # an evaluation (no gradients) before training: a kind of call of its own
        model.eval()
        with torch.no_grad():
            x0, y0 = next(iter(loader))
            _loss(kind, model, x0, y0)
        model.train()
    if raise_first:  # a call that raises (a batch of the wrong width), caught by the program
        import warnings

        x0, y0 = next(iter(loader))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model(torch.cat([x0, x0], dim=1))
            except RuntimeError:
                pass
            else:
                raise AssertionError("the bad call did not raise")
        assert not caught, [str(w.message) for w in caught]
    losses, grads = [], []
    for i, (x, y) in enumerate(loader):
        loss = _loss(kind, model, x, y) / accumulate
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            grads.append({k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for k, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}
    decided = list(__import__("torchspmd").auto_path(model).values()) if spmd else None
    return losses, grads, state, decided


def ignored_targets(spmd: bool, rows: int, batch: int, ignore_index: int = -100, change_in_place: bool = False,
                     item_first: bool = False, whole: bool = False, host_group: bool = True):
    """Pattern 1 on a decoder whose targets hold ``ignore_index`` unevenly (most of them in
    the first rows of each batch, so on the first process). Returns the losses, the
    gradients and the parameters after each step, and with ``spmd`` the number of blocking
    all-reduces made by each step's loss and ``loss.item()``."""
    torch.manual_seed(0)
    model = decoder()
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    x_all, y_all = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    first_rows = (torch.arange(rows) % batch < 3)[:, None]
    y_all[(torch.rand(y_all.shape, generator=g) < 0.5) & first_rows] = ignore_index
    y_all[(torch.rand(y_all.shape, generator=g) < 0.05) & ~first_rows] = ignore_index
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=batch)
    if spmd:
        import torchspmd as ts

        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        if whole:  # a list: every process reads each whole batch (no per-process reading)
            loader = list(loader)
        loader = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if not spmd or host_group:
        return _ignored_steps(model, loader, opt, ignore_index, change_in_place, item_first)
    from torchspmd.engines.native.global_view import early_reductions as _early

    host_collectives = _early._host_collectives
    _early._host_collectives = lambda: False  # as with a default group of NCCL alone: no sums on the host
    try:
        return _ignored_steps(model, loader, opt, ignore_index, change_in_place, item_first)
    finally:
        _early._host_collectives = host_collectives


def _ignored_steps(model, loader, opt, ignore_index, change_in_place, item_first):
    import torch.distributed as tdist

    blocking = [0]
    original = tdist.all_reduce

    def counting(*args, **kwargs):
        if not kwargs.get("async_op", False):
            blocking[0] += 1
        return original(*args, **kwargs)

    losses, grads, blocked = [], [], []
    for i, (x, y) in enumerate(loader):
        if change_in_place:  # after the loader counted the targets
            y.masked_fill_(y == 5, ignore_index)
        logits = model(x).reshape(-1, VOCAB)
        tdist.all_reduce, blocking[0] = counting, 0
        try:
            loss = F.cross_entropy(logits, y.reshape(-1), ignore_index=ignore_index)
            if item_first:
                losses.append(loss.item())
            tdist.all_reduce = original
            loss.backward()
            tdist.all_reduce = counting
            if not item_first:
                losses.append(loss.item())
        finally:
            tdist.all_reduce = original
        blocked.append(blocking[0])
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, grads, state, blocked


def optimizer_steps_reference():
    """``test_auto_replicate._optimizer_steps``'s program on one device: an Adam step, a step
    with a closure, an SGD step that raises; the losses and the parameters after."""
    torch.manual_seed(0)
    model = Net()
    x, y = data("net", 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    F.cross_entropy(model(x), y).backward()
    opt.step()

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure).item()
    loss_after = F.cross_entropy(model(x), y).item()
    return [loss, loss_after], {k: v.detach().clone() for k, v in model.state_dict().items()}
