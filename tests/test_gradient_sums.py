"""The gradient sums of replicated parameters (torchspmd/engines/native/communication/gradient_sums.py):
DDP's buckets summed through shared memory on one machine, through gloo otherwise.

The hook is driven here with stand-in buckets (what DDP hands it: ``buffer()``, ``index()``,
``is_last()``): several buckets of several dtypes, sizes not divisible by the process count.
The reference is each bucket's inputs from every process, gathered, summed in float64. The
training runs (Pattern 1 and ``ts.replicate`` against one device) are in
test_data_parallel.py and test_auto_replicate.py, which take this hook by default."""

import numpy as np
import pytest
import torch
import torch.distributed as tdist

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class _Bucket:
    def __init__(self, tensor, index, count):
        self.tensor, self.i, self.count = tensor, index, count

    def buffer(self):
        return self.tensor

    def index(self):
        return self.i

    def is_last(self):
        return self.i == self.count - 1


def _inputs(step: int, sizes, dtypes):
    rank = tdist.get_rank()
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 5)
    return [torch.randn(n, generator=g, dtype=torch.float64).to(DTYPES[d]) for n, d in zip(sizes, dtypes)]


def _hook_sums(sizes, dtypes, steps: int, raise_first: bool):
    """Sum ``steps`` backward passes' buckets through the hook; return, per step, the
    results and every process's inputs (gathered), and which hook ``register`` chose."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    from torchspmd.engines.native.communication import gradient_sums

    group = tdist.group.WORLD
    params = [nn.Parameter(torch.zeros(n, dtype=DTYPES[d])) for n, d in zip(sizes, dtypes)]
    ddp = DistributedDataParallel(nn.ParameterList(params), process_group=group, init_sync=False)
    chosen = gradient_sums.register(ddp, group, params)
    summer = ddp._comm_hooks[0][0].__self__ if chosen == "shared memory" else None
    out = []
    if raise_first and summer is not None:
        # A backward pass that raised after DDP handed over some buckets: the next one starts afresh.
        for i, t in enumerate(_inputs(99, sizes, dtypes)[:-1]):
            summer.hook(None, _Bucket(t, i, len(sizes)))
    for step in range(steps):
        inputs = _inputs(step, sizes, dtypes)
        gathered = []
        for t in inputs:
            parts = [torch.empty_like(t) for _ in range(tdist.get_world_size())]
            tdist.all_gather(parts, t)
            gathered.append(torch.stack(parts))
        buffers = [t.clone() for t in inputs]
        futures = [summer.hook(None, _Bucket(b, i, len(buffers))) for i, b in enumerate(buffers)]
        results = [f.wait() for f in futures]
        assert all(r is b for r, b in zip(results, buffers))  # summed in place, as DDP expects
        out.append((buffers, gathered))
    return chosen, out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("raise_first", [False, True], ids=["", "after-a-failed-backward"])
def test_buckets_summed_through_shared_memory(dist, world, raise_first):
    sizes, dtypes = [1003, 5, 70001, 64], ["float32", "bfloat16", "float32", "float64"]
    results = dist(world).run(_hook_sums, sizes, dtypes, 3, raise_first)
    assert all(chosen == "shared memory" for chosen, _ in results)
    for step in range(3):
        for b, dtype in enumerate(dtypes):
            mine = [r[1][step][0][b] for r in results]
            for other in mine[1:]:  # every process holds the same bits
                assert torch.equal(other.view(torch.uint8), mine[0].view(torch.uint8)), (step, b)
            gathered = results[0][1][step][1][b]
            want = gathered.double().sum(0)
            tol = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 8e-3}[dtype]
            torch.testing.assert_close(mine[0].double(), want, rtol=tol, atol=tol)
            if dtype != "bfloat16":  # (bfloat16: summed in float32, rounded once)
                exact = gathered[0].clone()
                for r in range(1, world):
                    exact += gathered[r]  # rank order
                assert torch.equal(mine[0], exact)


def _switched_off():
    import os

    os.environ["TORCHSPMD_SHARED_GRADIENTS"] = "0"  # (the pool undoes it after the task)
    return _hook_chosen()


def _hook_chosen():
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    from torchspmd.engines.native.communication import gradient_sums

    params = [nn.Parameter(torch.zeros(7))]
    ddp = DistributedDataParallel(nn.ParameterList(params), init_sync=False)
    chosen = gradient_sums.register(ddp, tdist.group.WORLD, params)
    return chosen, ddp._comm_hooks[0][0] is gradient_sums.backend_sum


def test_backend_sum_when_switched_off(dist):
    assert dist(2).run(_hook_chosen) == [("shared memory", False)] * 2
    assert dist(2).run(_switched_off) == [("backend", True)] * 2


def _pattern1(shared: bool):
    """Pattern 1 (the automatic path) with the gradient sums through shared memory or gloo:
    the losses and the parameters after three steps, and the hook the path chose."""
    import os

    import torchspmd as ts
    from torchspmd.engines.native.wrappers import data_parallel

    os.environ["TORCHSPMD_SHARED_GRADIENTS"] = "1" if shared else "0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    g = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(torch.randn(24, 7, generator=g), torch.randint(0, 3, (24,), generator=g))
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=8), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, data_parallel._STATES[model].gradient_sums


@pytest.mark.parametrize("world", [2, 4])
def test_pattern1_same_steps_with_either_sum(dist, world):
    # gloo sums in ring order, shared memory in rank order: the same values up to rounding.
    shared = dist(world).run(_pattern1, True)
    backend = dist(world).run(_pattern1, False)
    assert [r[2] for r in shared] == ["shared memory"] * world and [r[2] for r in backend] == ["backend"] * world
    for (losses, state, _), (ref_losses, ref_state, _) in zip(shared, backend):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-6, atol=1e-7)
