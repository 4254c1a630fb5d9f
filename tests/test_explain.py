"""ts.explain: parameter layouts, and the collectives of one step as CommDebugMode counts them."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _helpers import same_on_every_rank

import torchspmd as ts
from torchspmd.explain import explain

ROWS = 6  # global batch: 3 rows per 'fsdp' shard


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 16)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _tp_fsdp_step():
    mesh = ts.Mesh(np.arange(4), (2, 2), ("fsdp", "model"))
    torch.manual_seed(0)
    m = MLP()
    ts.mark_sharding(m.fc1.weight, mesh, ("model", None))  # column-parallel
    ts.mark_sharding(m.fc2.weight, mesh, (None, "model"))  # row-parallel: the pair
    model = ts.FSDPv2(m, mesh=mesh, collectives="native")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = ts.shard_batch((torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 16, generator=g)),
                          ts.ShardingSpec(mesh, ("fsdp", None)))

    def step():
        with ts.step():
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()

    # (the first call of a kind of call decides where FSDPv2's model computes, agreed with one
    # all-reduce per mesh axis: the step explained is the one after)
    step()
    r = explain(model, step)
    layouts = [(p.name, p.shape, p.axes, p.local_numel, p.numel, p.compute) for p in r.layouts]
    calls = sorted((c.kind, c.phase, c.axis, c.group_size, c.count, c.bytes) for c in r.collectives)
    return layouts, r.comm_counts, r.total, calls, r.gathered_whole, str(r), r.row_paths


def test_fsdp_tensor_parallel_step(dist):
    results = dist(4).run(_tp_fsdp_step)
    print(results[0][-1])  # the report, as rank 0 printed it
    layouts, counts, total, calls, whole, report, paths = results[0]
    assert whole == []
    # proven row-local (the tensor-parallel pair traced as its whole weights compute): this process's rows
    assert paths == [(f"inputs ({ROWS}, 16) float32, ({ROWS}, 16) float32 (training)", None)] or \
        paths == [(f"inputs ({ROWS}, 16) float32 (training)", None)], paths
    assert "this process's rows (proven)" in report
    by_name = {name: rest for name, *rest in layouts}
    assert list(by_name) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    # Each weight: split over 'model' by the annotation, over 'fsdp' by FSDP2 (on dim 0; for
    # the column-parallel weight a _StridedShard inside the 'model' split): 1/4 here.
    assert by_name["fc1.weight"][:4] == [(24, 16), (("fsdp", "model"), None), 96, 384]
    assert by_name["fc2.weight"][:4] == [(16, 24), ("fsdp", "model"), 96, 384]
    assert "colwise over 'model' (paired)" in by_name["fc1.weight"][4]
    assert "rowwise over 'model' (paired)" in by_name["fc2.weight"][4]
    assert by_name["fc2.bias"][:4] == [(16,), ("fsdp",), 8, 16]  # replicated over 'model': FSDP's 1/2

    # The collectives of one step, as CommDebugMode counted them (the same on every rank):
    assert same_on_every_rank([r[1] for r in results]) == counts
    assert counts == {
        # FSDP2's all-gather of the one unit (the root) over 'fsdp', once: the root keeps its
        # gathered parameters from forward to backward (FSDPv2's default, FSDP2's too).
        "c10d._allgather_base_": 1,
        # The row-parallel fc2's output: a pending sum over 'model', all-reduced in forward.
        # No backward all-reduce of the column-parallel fc1's input gradient: fc1's input is
        # the batch, which needs no gradient, so autograd never computes it.
        "c10d_functional.all_reduce": 1,
        # FSDP2's reduce-scatter of the unit's gradients over 'fsdp', in backward.
        "c10d._reduce_scatter_base_": 1,
        # loss.item(): the global loss is a pending sum over 'fsdp' (each shard's rows);
        # the loss's backward starts the all-reduce of the 4-byte scalar, item() waits on it.
        "c10d.allreduce_": 1,
    }
    assert total == 4
    unit = 2 * 4 * (96 + 6 + 96 + 8)  # the unit's gathered parameters: 2 shards of 206 fp32
    assert same_on_every_rank([r[3] for r in results]) == sorted([
        ("c10d._allgather_base_", "forward", "fsdp", 2, 1, unit),
        ("c10d_functional.all_reduce", "forward", "model", 2, 1, 3 * 16 * 4),  # this shard's 3 rows of fc2
        ("c10d._reduce_scatter_base_", "backward", "fsdp", 2, 1, unit),
        ("c10d.allreduce_", "backward", "fsdp", 2, 1, 4),
    ])


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.weight


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = Scale()

    def forward(self, x):
        return self.scale(self.fc(x))


def _gathered_whole_and_pattern1():
    mesh = ts.Mesh(np.arange(4), (2, 2), ("fsdp", "model"))
    torch.manual_seed(0)
    m = Scaled()
    ts.mark_sharding(m.scale.weight, mesh, ("model",))  # not a Linear's or Embedding's weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GatheredWholeWarning names it too
        model = ts.FSDPv2(m, mesh=mesh, collectives="native")
    whole = explain(model).gathered_whole
    with pytest.raises(ts.SpmdError) as e:
        explain(model, strict=True)

    # Pattern 1: DTensor parameters, no FSDP.
    lin = nn.Linear(16, 24)
    ts.mark_sharding(lin.weight, mesh, ("model", None))
    layouts = [(p.name, p.axes, p.local_numel, p.numel, p.compute) for p in explain(lin).layouts]
    return whole, str(e.value), layouts


def test_gathered_whole_and_pattern1(dist):
    whole, error, layouts = same_on_every_rank(dist(4).run(_gathered_whole_and_pattern1))
    assert whole == ["scale.weight"]
    assert "'scale.weight'" in error and "gathered whole" in error
    assert layouts == [("weight", ("model", None), 192, 384,
                        "tensor-parallel colwise over 'model' (no wrapper: Megatron's layouts)"),
                       ("bias", (None,), 24, 24, "whole on every process")]


def test_plain_module_without_processes(capsys):
    model = nn.Linear(4, 3)
    r = explain(model, lambda: model(torch.ones(2, 4)).sum().backward())
    assert [(p.name, p.local_numel, p.numel) for p in r.layouts] == [("weight", 12, 12), ("bias", 3, 3)]
    assert r.comm_counts == {} and r.total == 0 and r.collectives == []
    out = capsys.readouterr().out
    assert "weight" in out and "CommDebugMode: 0 calls" in out


class _SharedActivation(nn.Module):
    """One module called twice in a forward (as transformers >= 5.25's Llama calls one
    module-level rotary module from every attention layer)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.b(self.act(self.a(self.act(x))))


def test_a_module_called_twice_in_the_step():
    # torch 2.13's CommDebugMode hooks a module again each time it is called and pops once
    # per hook: the second call failed with an IndexError (and hooks stayed behind)
    model = _SharedActivation()
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # twice: nothing left over from the first
            r = explain(model, lambda: model(x).sum().backward())
            assert [p.name for p in r.layouts] == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    expected = model.b(torch.relu(model.a(torch.relu(x))))
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
