"""What torch_xla reports of unannotated device data, its sharding tables, and its save
planner's shard index: run under torch_xla itself (one process, CPU devices) and under
``torchspmd run --xla-compat`` (one process per device); prints one ``RESULT`` line of JSON."""

import json

import numpy as np
import rich.console
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.distributed.spmd.debugging import visualize_sharding
from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

xr.use_spmd()
n = xr.global_runtime_device_count()
text = torch_xla._XLAC._get_xla_sharding_spec
out = {}

batch = next(iter(pl.MpDeviceLoader([{"x": torch.randn(4, 3)}], torch_xla.device(), input_sharding=None)))
out["loader_batch"] = text(batch["x"])
a = torch.randn(4, 3).to("xla")
out["placed"] = text(a)
out["op_result"] = text(a * 2)
xm.mark_step()
out["placed_then_synced"] = text(a)
mesh = xs.Mesh(np.arange(n), (n,), ("x",))
xs.mark_sharding(a, mesh, ("x", None))
out["placed_then_marked"] = text(a)

for sharding in ["{devices=[2,8]0,4,8,12,2,6,10,14,1,5,9,13,3,7,11,15}",
                 "{devices=[8,1,2]0,1,4,5,8,9,12,13,2,3,6,7,10,11,14,15 last_tile_dim_replicate}",
                 "{devices=[1,2]1,0}", "{replicated}"]:
    console = rich.console.Console()
    with console.capture() as capture:
        console.print(visualize_sharding(sharding, use_color=False))
    out[f"table {sharding}"] = capture.get()

model = torch.nn.Linear(6, 2 * n).to("xla")
xs.mark_sharding(model.weight, mesh, ("x", None))
planner = SPMDSavePlanner()
planner.set_up_planner(model.state_dict(), is_coordinator=True)
shards = xs.wrap_if_sharded(model.weight).local_shards
items = [i for i in planner.create_local_plan().items if i.index.fqn == "weight"]
out["write_items_resolve_to_their_local_shard"] = bool(items) and all(
    torch.equal(shards[i.index.index].data.cpu(), planner.resolve_data(i).cpu()) for i in items)

if xr.process_index() == 0:
    print("RESULT " + json.dumps(out, sort_keys=True))
