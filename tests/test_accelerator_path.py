"""``TORCHSPMD_ACCELERATOR_PATH=1`` turns every CPU-only shortcut off at once (the code path
a GPU or TPU takes, on gloo): FSDPv2's ``'auto'`` collectives become FSDP2's own, replicated
parameters' gradients and the small sums go through the backend's all-reduce, the loader
makes batches in its background thread, replica digests are computed by tensor kernels. CI
runs the oracle subset (``-m smoke``) again with it, exact against one device; here each
shortcut's choice is read with the switch off and on, on every process of a real gloo group."""

import torch
import torch.distributed as tdist


def _choices(switch: str):
    import os
    from types import SimpleNamespace

    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    from torchspmd.engines.native import data
    from torchspmd.engines.native.communication import collectives, gradient_sums, replicas, shared_sums

    os.environ["TORCHSPMD_ACCELERATOR_PATH"] = switch  # (the pool undoes it after the task)
    group = SimpleNamespace(mesh_info=SimpleNamespace(shard_process_group=tdist.group.WORLD),
                            device=torch.device("cpu"))
    unit = SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(_fsdp_param_groups=[group]))
    params = [nn.Parameter(torch.zeros(7))]
    ddp = DistributedDataParallel(nn.ParameterList(params), init_sync=False)
    total = torch.tensor([float(tdist.get_rank() + 1)])
    work = shared_sums.all_reduce(total)
    work.wait()
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    kernel_digest = replicas._weighted_byte_sum(t.view(torch.uint8)) % (1 << 62)
    return dict(auto=collectives.choose("auto", unit), shm=collectives.choose("shm", unit),
                gradients=gradient_sums.register(ddp, tdist.group.WORLD, params),
                sums=type(work).__module__.startswith("torchspmd"), total=total.item(),
                thread=data.background_thread(torch.device("cpu")),
                digest="kernel" if replicas.digest(t) == kernel_digest else "host")


def test_the_switch_turns_every_cpu_shortcut_off(dist):
    shortcuts = dict(auto="shm", shm="shm", gradients="shared memory", sums=True, total=3.0, thread=False,
                     digest="host")
    assert dist(2).run(_choices, "0") == [shortcuts] * 2
    # the program's explicit collectives='shm' is its own choice and stays
    accelerator = dict(auto="native", shm="shm", gradients="backend", sums=False, total=3.0, thread=True,
                       digest="kernel")
    assert dist(2).run(_choices, "1") == [accelerator] * 2
