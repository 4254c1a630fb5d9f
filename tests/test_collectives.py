"""The all-reduce forms of FSDP2's collectives give the native collectives' results, and
FSDPv2 trains like one device with each variant (uneven sizes, 2, 3 and 4 processes)."""

import pytest
import torch

import torchspmd as ts


def _compare(numel):
    """Each variant against the native collective, on integer-valued floats (sums exact)."""
    import torch.distributed as dist

    from torchspmd.fsdp.collectives import (
        AllReduceAllGather,
        AllReduceReduceScatter,
        SharedMemoryAllGather,
        SharedMemoryReduceScatter,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    shard = torch.randint(-50, 50, (numel,), generator=g).float()
    shard[0] = float("inf") if rank == 0 else shard[0]  # non-finite values pass through
    native = torch.empty(numel * world)
    dist.all_gather_into_tensor(native, shard)
    # FSDP2 passes the input as a view of the output's slot: both layouts are handled.
    ours = torch.full((numel * world,), 7.0)
    ours.view(world, -1)[rank].copy_(shard)
    AllReduceAllGather()(ours, ours.view(world, -1)[rank], group)
    separate = torch.full((numel * world,), 7.0)
    work = AllReduceAllGather()(separate, shard.clone(), group, async_op=True)
    work.wait()

    full = torch.randint(-50, 50, (numel * world,), generator=g).float()
    rs_native = torch.empty(numel)
    dist.reduce_scatter_tensor(rs_native, full.clone())
    rs_ours = torch.empty(numel)
    AllReduceReduceScatter()(rs_ours, full.clone(), group, dist.ReduceOp.SUM)
    # Shared memory: several rounds (the buffer halves alternate, sizes grow and shrink).
    shm_ok = True
    import torchspmd.fsdp.collectives as coll

    coll.RS_STEP_BYTES = 64  # the reduce-scatter in many small steps
    ag, rs = SharedMemoryAllGather(group), SharedMemoryReduceScatter(group)
    for k, n in enumerate([numel, 3 * numel + 1, numel, 2 * numel]):
        piece = torch.randint(-50, 50, (n,), generator=g).float() + k
        want = torch.empty(n * world)
        dist.all_gather_into_tensor(want, piece)
        out = ag.allocate((n * world,), dtype=torch.float32, device=torch.device("cpu"))
        out.view(world, -1)[rank].copy_(piece)
        ag(out, out.view(world, -1)[rank], group)
        shm_ok &= torch.equal(out, want)
        grads = torch.randint(-50, 50, (n * world,), generator=g).float()
        want_rs = torch.empty(n)
        dist.reduce_scatter_tensor(want_rs, grads.clone())
        got_rs = torch.empty(n)
        rs(got_rs, grads, group, dist.ReduceOp.SUM)
        shm_ok &= torch.equal(got_rs, want_rs)
    coll.RS_STEP_BYTES = 8 * 2**20
    return (torch.equal(native, ours), torch.equal(native, separate), torch.equal(rs_native, rs_ours) and shm_ok,
            torch.isinf(ours[0]).item())


@pytest.mark.parametrize("world,numel", [(2, 5), (3, 7), (4, 1), (4, 13)])
def test_allreduce_forms_equal_native_collectives(dist, world, numel):
    for ag, ag_separate, rs, inf in dist(world).run(_compare, numel):
        assert ag and ag_separate and rs and inf


def _variant(collectives):
    from torch.distributed.fsdp import FSDPModule

    from torchspmd.fsdp.collectives import AllReduceAllGather, SharedMemoryAllGather

    mesh = ts.Mesh(list(range(ts.global_runtime_device_count())), (ts.global_runtime_device_count(), 1),
                   ("fsdp", "model"))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    wrapped = ts.FSDPv2(model, mesh, collectives=collectives)
    units = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    comms = [u._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm for u in units]
    return [type(c).__name__ if isinstance(c, (AllReduceAllGather, SharedMemoryAllGather)) else "native"
            for c in comms]


def test_auto_picks_shared_memory_on_one_machine(dist):
    assert dist(2).run(_variant, "auto")[0] == ["SharedMemoryAllGather"]
    assert dist(2).run(_variant, "shm")[0] == ["SharedMemoryAllGather"]
    assert dist(2).run(_variant, "native")[0] == ["native"]
    assert dist(2).run(_variant, "allreduce")[0] == ["AllReduceAllGather"]


def _bad_choice():
    try:
        _variant("fastest")
    except ts.SpmdError as e:
        return str(e)


def test_unknown_variant_is_refused(dist):
    assert "collectives='fastest'" in dist(2).run(_bad_choice)[0]
