"""PyTorch's DTensor API on a mesh of the 'xla' device type, as torch_xla's SPMD guide uses it
(init_device_mesh('xla', ...), distribute_tensor, distribute_module), under --xla-compat.
Writes one file per process (rank{R}.json in the directory given as its argument): what the program sees, with the values plain PyTorch gives
for the same tensors (computed before anything is distributed)."""

import json
import os
import sys

import torch
import torch.nn as nn
import torch_xla.runtime as xr
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh

xr.use_spmd()
world = xr.global_runtime_device_count()
rank = int(os.environ["RANK"])
torch.manual_seed(0)
out = {"world": world}

mesh = init_device_mesh("xla", mesh_shape=(world,))
big = torch.randn(13, 6)  # 13 rows: not divisible by 2 or 4
dt = distribute_tensor(big, mesh, [Shard(0)])
out["type"] = type(dt).__name__
out["placements"] = [repr(p) for p in dt.placements]
chunks = big.chunk(world)  # DTensor's Shard splits as torch.chunk does
out["local_equal"] = torch.equal(dt.to_local(), chunks[rank] if rank < len(chunks) else big[:0])
out["full_equal"] = torch.equal(dt.full_tensor(), big)
rep = distribute_tensor(big, mesh)  # no placements: replicated
out["replicated"] = [repr(p) for p in rep.placements] == [repr(Replicate())] and torch.equal(rep.to_local(), big)

mesh2 = init_device_mesh("xla", mesh_shape=(2, world // 2), mesh_dim_names=("a", "b"))
dt2 = distribute_tensor(big, mesh2, [Shard(1), Shard(0)])
out["mesh2_names"] = list(dt2.device_mesh.mesh_dim_names)
out["mesh2_full_equal"] = torch.equal(dt2.full_tensor(), big)

# torch_xla's XLAShardedTensor.redistribute takes its Mesh; the attributes torch_xla's tests read
import numpy as np  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

xs_mesh = xs.Mesh(np.arange(world), (world,))
st = xs.mark_sharding(big.clone(), xs_mesh, (0, None))
moved = st.redistribute(xs_mesh, [Shard(1)])
out["redistributed"] = [moved.partition_spec, list(moved.mesh_shape), torch.equal(moved.full_tensor(), big),
                        st.partition_spec]
refused = []  # XLAShardedTensor.redistribute's own argument checks, with its exception types
for placements in ([Shard(2)], [Shard(0), Shard(1)], [torch.distributed.tensor.Partial()]):
    try:
        st.redistribute(xs_mesh, placements)
        refused.append("no error")
    except Exception as e:  # noqa: BLE001 (the type is what is checked)
        refused.append(type(e).__name__)
out["redistribute_refused"] = refused

# torch_xla's flash_attention kernel (as SDPA) against attention written out in plain PyTorch
import torch_xla.core.xla_model as xm  # noqa: E402
from torch_xla.experimental.custom_kernel import flash_attention  # noqa: E402

q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
scores = q @ k.transpose(-1, -2) * 0.7
plain = torch.softmax(scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf")), -1) @ v
bias = torch.randn(2, 3, 5, 5)
out["flash_attention"] = [torch.allclose(flash_attention(q, k, v, causal=True, sm_scale=0.7), plain, atol=1e-6),
                          torch.allclose(flash_attention(q, k, v, sm_scale=0.7, ab=bias),
                                         torch.softmax(scores + bias, -1) @ v, atol=1e-6)]
sent = xm.send_cpu_data_to_device(big.clone(), xm.xla_device(), input_sharding=xs.ShardingSpec(xs_mesh, (0, None)))
out["sent"] = [len(sent), sent[0].partition_spec, torch.equal(sent[0].full_tensor(), big)]

# torch_xla's gradient_accumulation (XLA's While loop there, a Python loop here) against plain PyTorch's loop
import copy  # noqa: E402

from torch_xla.experimental.gradient_accumulation import gradient_accumulation  # noqa: E402

lin = nn.Linear(6, 3)
ref = copy.deepcopy(lin)
micro, target = torch.randn(3, 4, 6), torch.randn(3, 4, 3)
ref_loss = 0.0
for i in range(3):
    step_loss = nn.functional.mse_loss(ref(micro[i]), target[i]) / 3
    step_loss.backward()
    ref_loss += step_loss.item()


def train_step(x, y, carried):
    return nn.functional.mse_loss(lin(x), y), carried + 10


acc_loss, carried = gradient_accumulation(train_step, (xs.mark_sharding(micro.clone(), xs_mesh, (None, 0, None)),
                                                       xs.mark_sharding(target.clone(), xs_mesh, (None, 0, None))),
                                          lin, torch.tensor(0.0))


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


out["gradient_accumulation"] = [abs(float(_whole(acc_loss)) - ref_loss) < 1e-5, float(_whole(carried)),
                                torch.allclose(_whole(lin.weight.grad), ref.weight.grad, rtol=1e-5, atol=1e-6),
                                torch.allclose(_whole(lin.bias.grad), ref.bias.grad, rtol=1e-5, atol=1e-6)]

# torch_xla's einsum linear: PyTorch's linear here, on a sharded input, with its gradients
from torch_xla.distributed.spmd.xla_sharding import (  # noqa: E402
    EinsumLinear,
    XLAPatchedLinear,
    apply_xla_patch_to_nn_linear,
)

xw, ww, bw = torch.randn(5, 6), torch.randn(4, 6), torch.randn(4)
xg = xw.clone().requires_grad_(True)
plain_y = nn.functional.linear(xg, ww, bw)
plain_y.sum().backward()
xp = xw.clone().requires_grad_(True)
patched_y = XLAPatchedLinear.apply(xs.mark_sharding_with_gradients(xp, xs_mesh, (0, None)), ww, bw)
patched_y.sum().backward()
patched = apply_xla_patch_to_nn_linear(nn.Sequential(nn.Linear(6, 4), nn.ReLU()))
out["patched_linear"] = [torch.allclose(_whole(patched_y), plain_y, rtol=1e-5, atol=1e-6),
                         torch.allclose(xp.grad, xg.grad, rtol=1e-5, atol=1e-6), type(patched[0]) is EinsumLinear]

# a tensor moved to the device as xm.xla_device() names it is annotated in place, as one moved to 'xla'
moved_in = torch.randn(8, 3).to(xm.xla_device())
xs.mark_sharding(moved_in, xs_mesh, (0, None))
cpu_copy = torch.randn(2).to("cpu") if xm.xla_device().type == "cpu" else None
as_parameter = nn.Parameter(torch.ones(3, device="xla"))  # model code: a parameter of a tensor put on 'xla'
out["moved_in_place"] = [isinstance(moved_in, DTensor), moved_in.partition_spec,
                         cpu_copy is None or type(cpu_copy).__name__ == "OnXlaDevice",
                         type(as_parameter) is nn.Parameter and as_parameter.is_leaf and as_parameter.requires_grad]

# an op's results on the device are device tensors: annotated in place (torch_xla's
# test_mark_sharding_ir_with_multiple_output), with autograd through them; a factory given the device
# object xm.xla_device() returned makes one (test_shard_device_data_ir); after a sync an op's
# unannotated result is device data, '{replicated}' (test_propagate_replicated_sharding)
import torch_xla  # noqa: E402

spec_of = torch_xla._XLAC._get_xla_sharding_spec
on_device = torch.randn(8, 8).to("xla")
values, indices = torch.max(on_device, 1)
xs.mark_sharding(values, xs_mesh, (0,))
leaf = torch.randn(8, 8, device=xm.xla_device()).requires_grad_()
hidden = on_device @ leaf
xs.mark_sharding(hidden, xs_mesh, (0, None))
(hidden * hidden).sum().backward()
pending = on_device @ on_device
before_sync = [spec_of(indices), spec_of(pending)]
torch_xla.sync()
out["op_results_in_place"] = [isinstance(values, DTensor), before_sync[0], type(leaf).__name__,
                              isinstance(hidden, DTensor),
                              torch.allclose(leaf.grad, 2 * on_device.T @ (on_device @ leaf.detach()), rtol=1e-5,
                                             atol=1e-5),
                              before_sync[1], spec_of(pending)]

# torch_xla's checkpoint planners: which entries of the state dict are split over devices
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner  # noqa: E402

planned = nn.Linear(4, 2 * world)
xs.mark_sharding(planned.weight, xs_mesh, (0, None))
save_planner, load_planner = SPMDSavePlanner(), SPMDLoadPlanner()
save_planner.set_up_planner(planned.state_dict(), is_coordinator=True)
load_planner.set_up_planner(planned.state_dict(), None, True)
out["planners"] = [[sorted(p.sharded_state_dict), sorted(p.unsharded_state_dict)]
                   for p in (save_planner, load_planner)]

model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
x = torch.randn(5, 6)
expected = model(x).detach().clone()


def partition(name, module, device_mesh):
    if isinstance(module, nn.Linear):
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)]))


seen = {}


def input_fn(module, inputs, device_mesh):
    seen["input"] = True  # (returns None: the inputs stay as they are)


def output_fn(module, outputs, device_mesh):
    seen["output"] = True
    return outputs


sharded = distribute_module(model, mesh, partition, input_fn=input_fn, output_fn=output_fn)
y = sharded(x)
out["module_weight_types"] = [type(m.weight).__name__ for m in sharded if isinstance(m, nn.Linear)]
out["module_output_close"] = torch.allclose(y.full_tensor() if isinstance(y, DTensor) else y, expected, rtol=1e-5,
                                            atol=1e-6)
out["hooks"] = sorted(seen)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
