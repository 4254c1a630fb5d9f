"""Pattern 1, Pattern 2 (FSDPv2, nested) and a checkpoint round trip, written for one device,
run by torchspmd on whatever accelerator PyTorch finds: the test runs it with the simdev
plugin installed, so that is a PrivateUse1 device torchspmd was never told about.

    python program.py OUT   (under TORCHSPMD_NUM_DEVICES=N or a launcher)

Rank 0 writes OUT/result.pt: the losses, the final whole parameters, and what ran where."""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchspmd as ts
from torchspmd import checkpoint

ROWS, IN, HIDDEN, WIDE, OUT, STEPS = 12, 13, 7, 11, 5, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(),
                         nn.Sequential(nn.Linear(HIDDEN, WIDE), nn.GELU(), nn.Linear(WIDE, OUT)))


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)


def whole(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to("cpu").clone()
            for k, v in model.state_dict().items()}


def train(model, optimizer, mesh, axis, steps):
    losses = []
    for step in steps:
        x, y = batch(step)
        x = ts.mark_sharding(x.to(ts.device()), mesh, (axis, None))
        y = ts.mark_sharding(y.to(ts.device()), mesh, (axis, None))
        with ts.step():
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(out: Path):
    ts.use_spmd()
    device = ts.device()
    n = ts.global_runtime_device_count()
    result = {"device": str(device), "devices": n, "process_group": dist.get_backend()}

    # Pattern 1: data parallelism by annotating the batch
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result["pattern1"] = {"losses": train(model, optimizer, mesh, "data", range(STEPS)), "params": whole(model),
                          "param_device": str(next(model.parameters()).device)}

    # Pattern 2: FSDPv2, the inner block wrapped first
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    ts.set_global_mesh(mesh)

    def fsdp_model():
        model = make_model().to(device)
        model[2] = ts.FSDPv2(model[2])
        return ts.FSDPv2(model)

    model = fsdp_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    first = train(model, optimizer, mesh, "fsdp", range(STEPS))
    weight = next(p for name, p in model.named_parameters() if name.endswith("0.weight"))
    local = weight.to_local()
    before = torch.accelerator.memory_allocated(device)
    saved = checkpoint.save(out / "ckpt", STEPS, model, optimizer, {"step": STEPS}, "")
    last = train(model, optimizer, mesh, "fsdp", [STEPS])
    result["pattern2"] = {"losses": first + last, "params": whole(model), "shard_rows": local.shape[0],
                          "shard_device": str(local.device), "placements": str(weight.placements),
                          "allocated": before}

    # the round trip: a fresh model and optimizer, loaded, take the same last step
    model = fsdp_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = checkpoint.load(saved, model, optimizer)
    result["resumed"] = {"state": state, "losses": train(model, optimizer, mesh, "fsdp", [STEPS]),
                         "params": whole(model)}
    if dist.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
