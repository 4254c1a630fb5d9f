"""Checks of the --xla-compat layer's names, run by tests/test_xla_compat.py as a torch_xla
program (``python -m torchspmd.compat api_checks.py OUT_JSON``, 1 or 4 processes). Writes
what it saw as JSON; the test asserts on it."""

import importlib
import json
import os
import sys

import numpy as np
import sharding_cases
import torch
import torch.nn as nn
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)

out = {}
xr.use_spmd()
n = xr.global_runtime_device_count()
out["counts"] = dict(global_runtime=n, world_size=xr.world_size(), global_device_count=xr.global_device_count(),
                     process_count=xr.process_count(), device_type=xr.device_type(), is_spmd=xr.is_spmd(),
                     addressable_runtime=xr.addressable_runtime_device_count(),
                     addressable=xr.addressable_device_count(), real_devices=len(torch_xla.real_devices()))
out["device"] = str(torch_xla.device())

# The 'xla' device
lin = nn.Linear(3, 2).to("xla")
out["xla_device"] = [str(torch.zeros(2, device="xla").device), str(torch.ones(1).to("xla").device),
                     str(torch.randn(2, device=torch.device("xla")).device), str(lin.weight.device),
                     str(torch.zeros(1).new_zeros(2, device="xla").device), str(xm.xla_device())]
out["xla_device"].append(str(torch.tensor([1.0], device="xla").device))
with torch.device("meta"):  # torch's device context still reaches the (wrapped) factories
    out["meta_context"] = [str(torch.zeros(2).device), str(torch.tensor([1.0]).device), str(nn.Linear(2, 2).weight.device)]
with torch.autocast("xla", dtype=torch.bfloat16):
    out["autocast_dtype"] = str(lin(torch.randn(4, 3)).dtype)

# Steps and closures
order = []
with torch_xla.step():
    xm.add_step_closure(lambda v: order.append(("closure", v)), args=(1,))
    order.append(("in step", 0))
order.append(("after step", 0))
xm.add_step_closure(lambda: order.append(("mark_step", 2)))
xm.mark_step()
out["closures"] = order
# torch_xla.compile, sync, optimizer_step: steps end, the update is the optimizer's
lin2 = nn.Linear(3, 1)
opt2 = torch.optim.SGD(lin2.parameters(), lr=0.1)
before = lin2.weight.detach().clone()
step_fn = torch_xla.compile(lambda x: lin2(x).sum().backward())
step_fn(torch.ones(2, 3))
grad = lin2.weight.grad.detach().clone()
xm.optimizer_step(opt2, barrier=True)
torch_xla.sync()
out["optimizer_step_ok"] = bool(torch.allclose(lin2.weight, before - 0.1 * grad))
import torchspmd  # noqa: E402  (only to read the step counter the layer advances)

out["steps_after_compile_sync"] = torchspmd.current_step()
tracker = xm.RateTracker()
tracker.add(10)
out["rate"] = tracker.rate() > 0 and tracker.global_rate() > 0

from torch_xla.utils.utils import SampleGenerator  # noqa: E402

out["samples"] = len(list(SampleGenerator(torch.ones(2), 3)))
import torch_xla.debug.metrics as met  # noqa: E402

out["metrics"] = met.metrics_report()
out["counter_names"] = met.counter_names()

# Sharding strings: annotations and FSDPv2's parameters
plain = torch.randn(3)
out["plain_spec"] = torch_xla._XLAC._get_xla_sharding_spec(plain)
import torch_xla._XLAC  # noqa: E402  (the import forms programs use)
from torch_xla._XLAC import _get_xla_sharding_spec  # noqa: E402

out["imported_spec"] = _get_xla_sharding_spec(plain)
out["plain_type"] = torch_xla._XLAC._get_xla_sharding_type(plain)
strings, types = [], []
if n == 4:
    for shape, names, ids, tshape, spec in sharding_cases.CASES:
        mesh = xs.Mesh(np.array(ids), shape, names)
        t = xs.mark_sharding(torch.randn(*tshape), mesh, spec)
        strings.append(torch_xla._XLAC._get_xla_sharding_spec(t))
        types.append(int(torch_xla._XLAC._get_xla_sharding_type(t)))
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    fsdp = FSDPv2(nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4)), mesh)
    out["fsdp_param_specs"] = sorted({torch_xla._XLAC._get_xla_sharding_spec(p) for p in fsdp.parameters()})
    owner = nn.Linear(6, 8)
    xs.mark_sharding(owner.weight, xs.Mesh(np.arange(n), (2, 2), ("fsdp", "model")), ("model", None))
    out["in_place"] = torch_xla._XLAC._get_xla_sharding_spec(owner.weight)
out["strings"] = strings
out["types"] = types

# xs.mark_sharding_with_gradients: a sharded copy whose gradient reaches the input
leaf = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
marked = xs.mark_sharding_with_gradients(leaf, xs.Mesh(np.arange(n), (n,), ("data",)), ("data", None))
(marked * marked).sum().backward()
out["with_gradients"] = [torch_xla._XLAC._get_xla_sharding_spec(marked),
                         bool(torch.allclose(leaf.grad, 2 * leaf.detach()))]

# Checkpoints (torch_xla.experimental.distributed_checkpoint on DCP)
from torch_xla.experimental import distributed_checkpoint as xc  # noqa: E402

d = sys.argv[2]
model = nn.Linear(4, 3)
opt = torch.optim.Adam(model.parameters())
xc.prime_optimizer(opt)
mgr = xc.CheckpointManager(d, save_interval=2, max_to_keep=2)
saved = []
for step in range(1, 8):
    with torch.no_grad():
        model.weight.add_(1.0)
    saved.append(mgr.save(step, {"model": model.state_dict()}))
out["saved"] = saved
out["steps"] = mgr.all_steps()
restored = {"model": nn.Linear(4, 3).state_dict()}
mgr.restore(4, restored)
out["restored_ok"] = bool(torch.allclose(restored["model"]["weight"], model.weight - 3.0))
xm.save(model.state_dict(), os.path.join(d, "xm.pt"))
out["xm_save_ok"] = bool(torch.equal(torch.load(os.path.join(d, "xm.pt"))["weight"], model.weight.detach()))

# Profiler on torch.profiler
import torch_xla.debug.profiler as xp  # noqa: E402

server = xp.start_server(9012)
trace_dir = os.path.join(d, "trace")
xp.start_trace(trace_dir)
with xp.Trace("region"):
    torch.randn(4).sum()
xp.stop_trace()
out["trace_files"] = len(os.listdir(trace_dir)) if os.path.isdir(trace_dir) else 0

# Libraries that probe for torch_xla are not misled
import accelerate.utils  # noqa: E402
import transformers  # noqa: E402
import transformers.utils  # noqa: E402

import torchspmd.hf.trainer as hf_trainer  # noqa: E402

stock = getattr(importlib.import_module("transformers.trainer"), "Trainer")

out["transformers_probe"] = transformers.utils.is_torch_xla_available()
out["accelerate_probe"] = accelerate.utils.is_torch_xla_available()
out["trainer_is_ours"] = issubclass(stock, hf_trainer.Trainer) and issubclass(transformers.Trainer, hf_trainer.Trainer)
import trl  # noqa: E402

out["sft_is_ours"] = issubclass(trl.SFTTrainer, hf_trainer.Trainer)

# Smaller names programs use
import torch_xla.distributed.spmd.debugging as debugging  # noqa: E402
from torch_xla.distributed.spmd.xla_sharding import Mesh as ShardingMesh  # noqa: E402
from torch_xla.distributed.spmd.xla_sharding import mark_sharding as sharding_mark
from torch_xla.utils.checkpoint import checkpoint  # noqa: E402

rank = xr.process_index()
out["probes"] = [hasattr(xs, "shard_as"), hasattr(xs, "wrap_as_sharded_tensor"),
                 getattr(xr, "no_such_name", "default"), hasattr(torch_xla._XLAC, "_xla_no_such_function")]
out["initialize_cache"] = xr.initialize_cache(os.path.join(sys.argv[2], "xla_cache"), readonly=False)
out["device_count"] = [torch_xla.device_count(), torch_xla.real_devices()]
out["xla_sharding_names"] = [ShardingMesh is xs.Mesh, sharding_mark is xs.mark_sharding]
out["rendezvous"] = [payload.decode() for payload in xm.rendezvous("payloads", f"rank {rank}".encode())]
xm.rendezvous("barrier")
xm.master_print("MASTER_PRINT local", local=True, flush=True)
xm.master_print("MASTER_PRINT global")
lin3 = nn.Linear(3, 3)
xs.apply_backward_optimization_barrier(lin3)
x3 = torch.randn(2, 3, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
checkpoint(lin3, x3).pow(2).sum().backward()
grad_ckpt = lin3.weight.grad.clone()
lin3.weight.grad = None
xm.optimization_barrier_([x3])
lin3(x3).pow(2).sum().backward()
out["checkpoint_grad_equal"] = bool(torch.equal(grad_ckpt, lin3.weight.grad))
opt3 = torch.optim.SGD(lin3.parameters(), lr=0.1)
xm.optimizer_step(opt3, groups=None)
counted = torch_xla.compile(lambda: None, max_different_graphs=1)
counted()
if n == 4:
    mesh2 = xs.Mesh(np.arange(n), (2, 2), ("a", "b"))
    table = debugging.visualize_sharding(
        torch_xla._XLAC._get_xla_sharding_spec(xs.mark_sharding(torch.randn(4, 6), mesh2, ("b", None))),
        use_color=False)
    out["visualized"] = [table.row_count, len(table.columns)]

# APIs the layer does not provide: each imports, and fails when used, on every process


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__, isinstance(e, ImportError), isinstance(e, AttributeError), str(e)]
    return None


def imported(module, name=None):
    """``import module`` / ``from module import name`` (raises here if the import fails)."""
    mod = importlib.import_module(module)
    if name is None:
        return mod
    scope = {}
    exec(f"from {module} import {name} as value", scope)
    return scope["value"]


xmp = imported("torch_xla.distributed.xla_multiprocessing")
all_gather = imported("torch_xla.core.xla_model", "all_gather")
xla_backend = imported("torch_xla.distributed.xla_backend")
ParallelLoader = imported("torch_xla.distributed.parallel_loader", "ParallelLoader")
FSDPv1 = imported("torch_xla.distributed.fsdp", "XlaFullyShardedDataParallel")
syncfree = imported("torch_xla.amp.syncfree")
XLAShardedTensor = imported("torch_xla.distributed.spmd", "XLAShardedTensor")
errors = {
    "xmp.spawn": error_of(lambda: xmp.spawn(print)),
    "torch_xla.launch": error_of(lambda: torch_xla.launch(print)),
    "xm.all_reduce": error_of(lambda: xm.all_reduce("sum", [torch.ones(1)])),
    "from xm import all_gather": error_of(lambda: all_gather(torch.ones(1))),
    "xla_backend.ProcessGroupXla": error_of(lambda: xla_backend.ProcessGroupXla(None, 0, 1, None)),
    "ParallelLoader": error_of(lambda: ParallelLoader([], [torch_xla.device()])),
    "XlaFullyShardedDataParallel": error_of(lambda: FSDPv1(nn.Linear(2, 2))),
    "syncfree": error_of(lambda: syncfree.Adam(nn.Linear(2, 2).parameters())),
    "use_spmd(auto=True)": error_of(lambda: xr.use_spmd(auto=True)),
    "_XLAC._xla_get_default_device": error_of(lambda: torch_xla._XLAC._xla_get_default_device()),
    "profiler.trace": error_of(lambda: xp.trace("localhost:9012", d)),
    "xm.set_rng_state": error_of(lambda: xm.set_rng_state(0)),
    "a stand-in class's attribute": error_of(lambda: imported("torch_xla.distributed.fsdp.xla_fully_sharded_data_"
                                                              "parallel", "TrainingState").IDLE),
    "rendezvous of some": error_of(lambda: xm.rendezvous("some", replicas=[0])),
}
out["errors_by_rank"] = [json.loads(p) for p in xm.rendezvous("errors", json.dumps(errors).encode())]
out["private_is_attribute_error"] = not hasattr(xm, "_no_such_private_name")

# torch_xla's names for what it sets and asks (issue #44)
import torch.distributed as dist  # noqa: E402
import torch_xla.core.xla_env_vars as xenv  # noqa: E402
from torch_xla.distributed.spmd.debugging import construct_v1_sharding_str  # noqa: E402
from torch_xla.distributed.spmd.xla_sharding import MarkShardingFunction  # noqa: E402

out["xla_use_spmd"] = os.environ.get("XLA_USE_SPMD")
out["xenv"] = [xenv.PJRT_DEVICE, xenv.PJRT_LOCAL_PROCESS_COUNT]
out["topology_by_rank"] = [json.loads(p) for p in xm.rendezvous("topology", json.dumps([
    xm.xla_real_devices(), xm.xla_replication_devices(), xm.xla_replication_devices([xm.xla_device()]),
    xr.local_process_count(), xr.process_count(), xr.process_index(), xm.is_master_ordinal(),
    xm.is_master_ordinal(local=False), xm.get_ordinal(), xm.xla_device() == torch.device("xla", 0),
    torch.zeros(1, device="xla").device == xm.xla_device()]).encode())]
if n == 4:
    mesh4 = xs.Mesh(np.arange(n), (2, 2), ("a", "b"))
    sharded = xs.mark_sharding(torch.randn(4, 6), mesh4, ("a", None))
    leaf = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    through = MarkShardingFunction.apply(leaf, mesh4, ("b", "a"))
    (through * through).sum().backward()
    out["sharded_tensor"] = [isinstance(sharded, xs.XLAShardedTensor), isinstance(torch.ones(1), xs.XLAShardedTensor),
                             construct_v1_sharding_str(sharded), construct_v1_sharding_str(through),
                             bool(torch.allclose(leaf.grad, 2 * leaf.detach())), construct_v1_sharding_str(leaf)]
    # XLAShardedTensor(t, ...) and wrap_as_sharded_tensor: t laid out as told (torch_xla records it on a wrapper)
    from torch_xla.distributed.spmd.xla_sharding import wrap_as_sharded_tensor  # noqa: E402

    value = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    wrapped = XLAShardedTensor(value.clone(), requires_grad=True)
    wrapped.sum().backward()
    tiled = wrap_as_sharded_tensor(value.clone(), mesh_shape=(4,), partition_spec=(0, None))
    again = wrap_as_sharded_tensor(tiled, mesh_shape=(2, 2), partition_spec=(0, 1))
    out["constructed"] = [isinstance(wrapped, xs.XLAShardedTensor), wrapped.sharding_type.name,
                          wrapped.is_leaf and torch.equal(wrapped.grad.full_tensor(), torch.ones(6, 4)),
                          [tiled.mesh_shape, tiled.partition_spec, torch.equal(tiled.full_tensor(), value)],
                          [again.mesh_shape, again.partition_spec, torch.equal(again.full_tensor(), value),
                           wrap_as_sharded_tensor(again) is again]]
# the program's own init_process_group after use_spmd started the group: the same group
before = dist.group.WORLD
refused = error_of(lambda: dist.init_process_group("xla", init_method="xla://"))  # (torch_xla refuses it too)
dist.init_process_group("gloo", init_method="xla://")
out["process_group"] = [dist.group.WORLD is before, dist.get_world_size(), dist.get_backend(),
                        error_of(lambda: dist.init_process_group("gloo", world_size=n + 1)),
                        refused]

if xr.process_index() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
