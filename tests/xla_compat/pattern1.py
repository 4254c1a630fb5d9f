"""The seed's Pattern 1 (SPMD data parallelism), run by tests/test_xla_compat.py under `torchspmd run --xla-compat`.

Lines between the VERBATIM markers are copied unchanged from the seed document
(../shared/seeds/000_90f455e51b6f5900.txt); what they leave to the reader is defined above
them (tests/xla_compat/_setup.py), and the lines after them report the losses."""

import torch

import _setup

torch.manual_seed(_setup.SEED)
MyModel = _setup.MyModel
loss_fn = _setup.RecordingCrossEntropy()
train_loader = _setup.image_batches()

# ---- VERBATIM: Pattern 1 ----
import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.distributed.parallel_loader as pl
from torch_xla import runtime as xr

# Enable SPMD
xr.use_spmd()

num_devices = xr.global_runtime_device_count()
mesh = xs.Mesh(np.arange(num_devices), (num_devices,), ('data',))

# Scale batch — one process handles all devices
batch_size = 128 * num_devices

# DataLoader with SPMD input sharding
train_loader = pl.MpDeviceLoader(
    train_loader,
    torch_xla.device(),
    input_sharding=xs.ShardingSpec(mesh, ('data', None, None, None))
)

model = MyModel().to('xla')
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

for data, target in train_loader:
    with torch_xla.step():
        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
# ---- END VERBATIM ----

_setup.report([l.item() for l in loss_fn.seen])
