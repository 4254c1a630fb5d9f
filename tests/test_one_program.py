"""N processes are one program: one random state, replicas that agree, and random
operations on sharded values that draw a stream per shard."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _helpers import ROOT, clean_env

import torchspmd as ts

# A Pattern 1 program as torch_xla programs are written: no seed unless --seed is given,
# the model built after use_spmd(), the data made with torch.randn, a shuffling loader.
PROGRAM = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch, torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset
    import torchspmd as ts
    import torch.distributed as dist

    ts.use_spmd()
    out, seed = sys.argv[1], sys.argv[2]
    if seed != "none":
        torch.manual_seed(int(seed))
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    data = TensorDataset(torch.randn(40, 6), torch.randn(40, 3))
    loader = ts.MpDeviceLoader(DataLoader(data, batch_size=10, shuffle=True), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in loader:
        with ts.step():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    extra = {"numpy": np.random.rand(3).tolist(), "torch": torch.rand(3).tolist()}
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"losses": losses, "state": state, "data": data.tensors[0].sum().item(), **extra}, f)
    """
)

# The same program for one device, in plain PyTorch: the oracle.
ORACLE = textwrap.dedent(
    """
    import json, sys
    import torch, torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(int(sys.argv[2]))
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    data = TensorDataset(torch.randn(40, 6), torch.randn(40, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in DataLoader(data, batch_size=10, shuffle=True):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    with open(sys.argv[1] + "/oracle.json", "w") as f:
        json.dump({"losses": losses, "state": state}, f)
    """
)


def _run_program(tmp_path, world, seed):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", str(world), str(prog),
                        str(tmp_path), seed], capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_unseeded_program_is_one_program(tmp_path, world):
    ranks = _run_program(tmp_path, world, "none")
    for r in ranks[1:]:
        assert r["data"] == ranks[0]["data"]  # torch.randn made one data set, not one per process
        assert r["state"] == ranks[0]["state"]  # the replicas agree bit for bit after training
        assert r["losses"] == ranks[0]["losses"]
        assert r["numpy"] == ranks[0]["numpy"] and r["torch"] == ranks[0]["torch"]  # still one state


def test_seeded_program_reproduces_one_device(tmp_path):
    ranks = _run_program(tmp_path, 2, "3")
    r = subprocess.run([sys.executable, "-c", ORACLE, str(tmp_path), "3"], capture_output=True, text=True,
                       env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    oracle = json.loads((tmp_path / "oracle.json").read_text())
    # fp32, the same global batches: only the summation order of the gradient differs
    np.testing.assert_allclose(ranks[0]["losses"], oracle["losses"], rtol=1e-5, atol=1e-7)
    for k, v in oracle["state"].items():
        np.testing.assert_allclose(ranks[0]["state"][k], v, rtol=1e-5, atol=1e-6)


# --- random operations on sharded values ---------------------------------------------------


def _state_digest():
    from torchspmd.engines.native.communication.replicas import digest

    return digest(torch.get_rng_state())


def _dropout_pattern1(rows):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    torch.manual_seed(0)
    x = ts.mark_sharding(torch.ones(rows, 64), mesh, ("data", None))
    y = F.dropout(x, p=0.5)
    full = y.full_tensor()
    replicated = F.dropout(torch.ones(rows, 64), p=0.5)  # a plain value is one value everywhere
    others = [torch.rand_like(x).full_tensor(), x.clone().uniform_().full_tensor(),
              torch.randn_like(x).full_tensor(), torch.bernoulli(torch.full_like(x, 0.5)).full_tensor()]
    return full, replicated, others, _state_digest()


def _check_masks(results, rows, world):
    fulls = [r[0] for r in results]
    for f in fulls[1:]:
        torch.testing.assert_close(f, fulls[0], rtol=0, atol=0)  # one global result
    mask = fulls[0] != 0
    # each process's rows got their own draws: no two shards repeat a mask
    shards = torch.tensor_split(mask, world)
    for i in range(world):
        for j in range(i + 1, world):
            k = min(len(shards[i]), len(shards[j]))
            assert not torch.equal(shards[i][:k], shards[j][:k])
    assert 0.4 < mask.float().mean() < 0.6
    torch.testing.assert_close(fulls[0][mask], torch.full_like(fulls[0][mask], 2.0))
    assert len({r[-1] for r in results}) == 1  # the shared stream advanced alike everywhere


@pytest.mark.parametrize("world,rows", [(2, 7), (4, 9)])
def test_dropout_on_a_sharded_dtensor_draws_per_shard(dist, world, rows):
    results = dist(world).run(_dropout_pattern1, rows)
    _check_masks(results, rows, world)
    for r in results[1:]:
        torch.testing.assert_close(r[1], results[0][1], rtol=0, atol=0)
        for mine, first in zip(r[2], results[0][2]):
            torch.testing.assert_close(mine, first, rtol=0, atol=0)
    for drawn in results[0][2]:  # the other random operations: a stream per shard too
        shards = torch.tensor_split(drawn, world)
        assert all(not torch.equal(shards[i][:1], shards[j][:1]) for i in range(world) for j in range(i + 1, world))


class _Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return F.dropout(torch.ones_like(x), p=0.5) + 0 * self.lin(x).sum()


def _dropout_wrapped(kind, rows):
    n = ts.global_runtime_device_count()
    torch.manual_seed(0)
    if kind == "fsdpv2":
        mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
        model = ts.FSDPv2(_Dropper(), mesh=mesh)
        spec = ("fsdp", None)
    else:
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        model = ts.replicate(_Dropper(), mesh)
        spec = ("data", None)
    x = ts.mark_sharding(torch.randn(rows, 64), mesh, spec)
    return model(x).full_tensor().detach(), None, _state_digest()


@pytest.mark.parametrize("kind", ["fsdpv2", "replicate"])
@pytest.mark.parametrize("world,rows", [(2, 7), (4, 9)])
def test_dropout_in_local_compute_draws_per_process(dist, kind, world, rows):
    _check_masks(dist(world).run(_dropout_wrapped, kind, rows), rows, world)


# --- replicas that agree --------------------------------------------------------------------


def _diverged_pattern1():
    import torch.distributed as tdist

    rank = tdist.get_rank()
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    torch.manual_seed(100 + rank)  # a program that seeds each process differently
    model = nn.Linear(5, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = ts.mark_sharding(torch.randn(6, 5), mesh, ("data", None))
    model(x).sum().backward()
    return before, {k: v.clone() for k, v in model.state_dict().items()}


def test_pattern1_parameters_start_as_rank0s(dist):
    results = dist(2).run(_diverged_pattern1)
    (before0, after0), (before1, after1) = results
    assert not torch.equal(before0["weight"], before1["weight"])
    for k in before0:
        torch.testing.assert_close(after0[k], before0[k], rtol=0, atol=0)
        torch.testing.assert_close(after1[k], before0[k], rtol=0, atol=0)


def _diverged_fsdpv2():
    import torch.distributed as tdist

    rank = tdist.get_rank()
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    torch.manual_seed(200 + rank)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = ts.FSDPv2(model, mesh=mesh)
    return before, ts.full_state_dict(wrapped, rank0_only=False)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdpv2_shards_rank0s_values(dist, world):
    results = dist(world).run(_diverged_fsdpv2)
    before0 = results[0][0]
    assert not torch.equal(results[1][0]["0.weight"], before0["0.weight"])
    for _, full in results:
        assert full.keys() == before0.keys()
        for k in before0:
            torch.testing.assert_close(full[k], before0[k], rtol=0, atol=0)


def test_digest_sees_every_bit():
    from torchspmd.engines.native.communication.replicas import digest

    t = torch.randn(1000)
    u = t.clone()
    u[517] = torch.nextafter(u[517], torch.tensor(10.0))  # one ulp
    assert digest(t) == digest(t.clone()) and digest(t) != digest(u)
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    assert digest(torch.tensor([float("nan")])) == digest(torch.tensor([float("nan")]))


# --- no warnings from a 2D layout ------------------------------------------------------------

TWO_D = textwrap.dedent(
    """
    import sys
    import numpy as np, torch, torch.nn as nn, torchspmd as ts
    ts.use_spmd()
    n = ts.global_runtime_device_count()
    # each process reports to a file of its own: the processes' prints would interleave
    sys.stdout = open(f"{sys.argv[1]}/rank{ts.global_ordinal()}.txt", "w")
    torch.manual_seed(0)
    # FSDPv2 over ('data', 'fsdp'): its output is sharded over both axes; gather it whole
    mesh = ts.Mesh(np.arange(n), (2, n // 2), ("data", "fsdp"))
    m = ts.FSDPv2(nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3)), mesh=mesh, extra_data_axis="data")
    out = m(ts.mark_sharding(torch.randn(8, 8), mesh, (("data", "fsdp"), None)))
    out.pow(2).mean().backward()
    print("gathered", tuple(out.full_tensor().shape), ts.full_state_dict(m, rank0_only=False)["0.weight"].shape)
    # uneven over both axes (9 rows: 3, 2, 2, 2): gathered per axis, exactly (torch's merged gather is wrong there)
    odd = torch.randn(9, 4)
    print("uneven", torch.equal(ts.mark_sharding(odd, mesh, (("data", "fsdp"), None)).full_tensor(), odd))
    # Pattern 1 with the batch over both axes of a 2D mesh: pending sums over both
    mesh2 = ts.Mesh(np.arange(n), (n // 2, 2), ("data", "model"))
    lin = nn.Linear(8, 3)
    loss = nn.functional.mse_loss(lin(ts.mark_sharding(torch.randn(8, 8), mesh2, (("data", "model"), None))),
                                  torch.zeros(8, 3))
    loss.backward()
    print("loss", loss.item())
    """
)


def test_a_2d_layout_is_moved_without_warnings(tmp_path):
    prog = tmp_path / "two_d.py"
    prog.write_text(TWO_D)
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--nproc", "4", str(prog), str(tmp_path)],
                       capture_output=True, text=True, env=clean_env(TORCHSPMD_ALL_RANKS_OUTPUT=1), timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(4):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert "gathered (8, 3)" in report and "uneven True" in report and "loss" in report, report
    assert "warn" not in r.stderr.lower() and "W1" not in r.stderr, r.stderr[-3000:]
