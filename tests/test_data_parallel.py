"""Pattern 1 (SPMD data parallelism, no wrapper) and ts.replicate against one device."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchspmd as ts

STEPS = 5
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.fc1 = nn.Linear(5 * 4 * 4, 13)  # sizes not divisible by the device count
        self.fc2 = nn.Linear(13, 3)

    def forward(self, x):
        x = F.relu(self.conv(x))
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def _setup(batch_size, opt_name):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    ds = TensorDataset(torch.randn(60, 3, 4, 4, generator=g), torch.randint(0, 3, (60,), generator=g))
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True)
    model = Net()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if opt_name == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    return loader, model, opt


def _train(model, opt, batches, loss_fn):
    losses = []
    for step, (data, target) in enumerate(batches):
        if step == STEPS:
            break
        opt.zero_grad()
        loss = loss_fn(model(data), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


LOSS_FNS = {"ce": nn.CrossEntropyLoss(), "mse": lambda out, t: F.mse_loss(out, F.one_hot(t, 3).float())}


def _oracle(batch_size, opt_name, loss_name):
    loader, model, opt = _setup(batch_size, opt_name)
    losses = _train(model, opt, loader, LOSS_FNS[loss_name])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _spmd(batch_size, opt_name, loss_name, wrap):
    loader, model, opt = _setup(batch_size, opt_name)
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    model = model.to(ts.device())
    if wrap:
        model = ts.replicate(model, mesh)
    batches = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None, None, None)))
    losses = []
    for step, (data, target) in enumerate(batches):
        if step == STEPS:
            break
        with ts.step():
            opt.zero_grad()
            out = model(data)
            loss = LOSS_FNS[loss_name](out, target)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    grads_plain = all(type(p.grad) is torch.Tensor for p in model.parameters())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads_plain


@pytest.mark.parametrize("world,batch", [(2, 8), (2, 7), (4, 8), (4, 10)])
@pytest.mark.parametrize("opt_name,loss_name", [("sgd", "ce"), ("adam", "mse")])
@pytest.mark.parametrize("wrap", [False, True], ids=["pattern1", "replicate"])
def test_matches_single_process(dist, world, batch, opt_name, loss_name, wrap):
    ref_losses, ref_state = _oracle(batch, opt_name, loss_name)
    results = dist(world).run(_spmd, batch, opt_name, loss_name, wrap)
    for losses, state, grads_plain in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
        assert losses == results[0][0]  # loss.item() is the same global value on every rank
        assert grads_plain  # the optimizer works on plain tensors
        assert state.keys() == ref_state.keys()  # no wrapper prefixes
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=ATOL)


def _decoder_run(batch, spmd):
    from torchspmd.models import DecoderModel

    torch.manual_seed(0)
    model = DecoderModel(vocab_size=29, dim=16, num_layers=2, num_heads=2, intermediate_size=24, max_seq_len=8)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 29, (batch * 3, 9), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loader = DataLoader(data, batch_size=batch)
    if spmd:
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        loader = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in loader:
        out = model(x)  # attention, norms, embeddings: all through DTensor
        loss = F.cross_entropy(out.reshape(-1, 29), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world,batch", [(2, 4), (2, 5)])
def test_pattern1_decoder_with_attention(dist, world, batch):
    ref_losses, ref_state = _decoder_run(batch, False)
    for losses, state in dist(world).run(_decoder_run, batch, True):
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=ATOL)
