"""Pattern 1: SPMD data parallelism, ported from PyTorch/XLA by changing the imports.

    python examples/spmd_data_parallel.py                      # every local device
    CPU_NUM_DEVICES=2 python examples/spmd_data_parallel.py    # two CPU processes
    torchspmd run --nproc 4 examples/spmd_data_parallel.py     # explicit launcher

The program is written for one device; the batch of 128 x devices images is split over
the 'data' axis, and the printed loss is the global loss of each whole batch.
"""

import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchspmd as ts

ts.use_spmd()


class MyModel(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * 14 * 14, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def synthetic_digits(n: int, seed: int = 0):
    """Images with a learnable label: the class is the brightest of ten vertical bands."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 1, 28, 28, generator=g) * 0.5
    for i, c in enumerate(labels.tolist()):
        images[i, 0, :, 2 + 2 * c : 4 + 2 * c] += 1.0
    return TensorDataset(images, labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-device-batch", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(0)
    num_devices = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(num_devices), (num_devices,), ("data",))
    batch_size = args.per_device_batch * num_devices  # one program handles all devices
    train_loader = DataLoader(synthetic_digits(batch_size * args.steps), batch_size=batch_size, shuffle=True)
    train_loader = ts.MpDeviceLoader(
        train_loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None, None, None))
    )
    model = MyModel().to(ts.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    print(f"{num_devices} device(s), backend {ts.backend()}, global batch {batch_size}")
    for step, (data, target) in enumerate(train_loader):
        with ts.step():
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"Step {step}, Loss: {loss.item():.4f}")


if __name__ == "__main__":
    main()
