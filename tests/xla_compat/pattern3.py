"""The seed's Pattern 3 (FSDPv2 with gradient checkpointing), run by tests/test_xla_compat.py under `torchspmd run --xla-compat`.

Lines between the VERBATIM markers are copied unchanged from the seed document
(../shared/seeds/000_90f455e51b6f5900.txt); what they leave to the reader is defined above
them (tests/xla_compat/_setup.py), and the lines after them report the losses."""

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
from torch_xla import runtime as xr
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

import _setup

torch.manual_seed(_setup.SEED)
xr.use_spmd()
n = xr.global_runtime_device_count()
mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
my_module = _setup.TinyLM()

# ---- VERBATIM: Pattern 3 ----
from torch_xla.distributed.fsdp import checkpoint_module

# checkpoint_module goes BEFORE FSDPv2
model = FSDPv2(checkpoint_module(my_module), mesh=mesh)
# ---- END VERBATIM ----

optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
loader = pl.MpDeviceLoader(_setup.token_batches(vocab=37), torch_xla.device(),
                           input_sharding=xs.ShardingSpec(mesh, ("fsdp", None)))
losses = []
for data, target in loader:
    with torch_xla.step():
        loss = _setup.lm_loss(model(data), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss)
_setup.report([l.item() for l in losses], model)
