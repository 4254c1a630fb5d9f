"""Sums of a few numbers through shared memory (torchspmd/engines/native/communication/shared_sums.py): the
same values as gloo's all-reduce (integers exactly, floats as the rank-order float64 sum,
the same bits on every process), many sums in flight around the ring, sums never waited
for, a late process, the fall-back to the backend, a disagreement between the processes,
and a process that ended while another waits for it."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import free_port

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32]


def _values(rank: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i)
    n = 1 + (i * 7) % 32
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** (i % 5)).to(dtype)
    return torch.randint(-(2 ** 40) if dtype == torch.int64 else -(2 ** 20), 2 ** 20, (n,), generator=g, dtype=dtype)


def _many(count: int, late: int):
    """``count`` sums of every dtype, in flight together (waited for in another order, some
    never); rank ``late`` starts each burst after some work of its own."""
    import torch.distributed as dist

    from torchspmd.engines.native.communication import shared_sums

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    assert shared_sums.all_reduce(torch.zeros(1), group).wait()  # (the board is made by the first sum)
    assert shared_sums._BOARDS[group] is not None, "the shared-memory path was not taken"
    mismatches, results = [], []
    works = []
    for i in range(count):
        if rank == late and i % 40 == 0:
            torch.linalg.svd(torch.randn(300, 300))  # be late: the others wait for this process
        dtype = DTYPES[i % len(DTYPES)]
        t = _values(rank, i, dtype)
        works.append((i, dtype, t, shared_sums.all_reduce(t, group)))
    waited = [w for w in works if w[0] % 3 != 1]  # a third never waited for: read when the ring wraps
    for i, dtype, t, work in reversed(waited):
        work.wait()
        everyone = [_values(r, i, dtype) for r in range(world)]
        if dtype.is_floating_point:
            expected = everyone[0].double()
            for v in everyone[1:]:
                expected = expected + v.double()
            expected = expected.to(dtype)
        else:
            expected = torch.stack(everyone).sum(0)
        gloo = everyone[rank].clone()
        dist.all_reduce(gloo)
        if not torch.equal(t, expected):
            mismatches.append((i, str(dtype)))
        if dtype.is_floating_point:  # gloo rounds after each addition: within world roundings of the sum
            bound = world * torch.finfo(dtype).eps * torch.stack([v.double().abs() for v in everyone]).sum(0)
            close = bool(((t.double() - gloo.double()).abs() <= bound).all())
        else:
            close = torch.equal(t, gloo)
        if not close:
            mismatches.append((i, str(dtype), "gloo"))
        results.append(t.double().tolist())
    return mismatches, results


@pytest.mark.parametrize("world", [2, 4])
def test_sums_equal_gloo_with_the_ring_wrapping(dist, world):
    from torchspmd.engines.native.communication.shared_sums import RING

    out = dist(world).run(_many, 3 * RING + 5, world - 1)
    for mismatches, _ in out:
        assert mismatches == []
    assert all(results == out[0][1] for _, results in out), "the processes got different bits"


def _fallbacks():
    import torch.distributed as dist

    from torchspmd.engines.native.communication import shared_sums

    rank = dist.get_rank()
    wide = torch.arange(shared_sums.WIDTH + 3, dtype=torch.float32) * (rank + 1) + 0.25
    work = shared_sums.all_reduce(wide)
    taken_by_gloo = not isinstance(work, shared_sums._Done)
    work.wait()
    world = dist.get_world_size()
    expected = torch.arange(shared_sums.WIDTH + 3, dtype=torch.float32) * (world * (world + 1) / 2) + 0.25 * world
    os.environ[shared_sums.SWITCH] = "0"  # (the pool puts the environment back)
    small = torch.tensor([rank + 0.5])
    switched_off = not isinstance(shared_sums.all_reduce(small), shared_sums._Done)
    return taken_by_gloo, torch.equal(wide, expected), switched_off


def test_wide_tensors_and_the_switch_go_to_the_backend(dist):
    for by_gloo, equal, switched_off in dist(2).run(_fallbacks):
        assert by_gloo and equal and switched_off


def _subgroup():
    import torch.distributed as dist

    from torchspmd.engines.native.communication import shared_sums

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    t = torch.tensor([float(rank) + 0.125, 3.0])
    shared_sums.all_reduce(t, mine).wait()
    return t.tolist(), shared_sums._BOARDS[mine] is not None


def test_subgroups_sum_over_their_own_processes(dist):
    out = dist(4).run(_subgroup)
    assert [v for v, _ in out] == [[1.25, 6.0], [1.25, 6.0], [5.25, 6.0], [5.25, 6.0]]
    assert all(board for _, board in out)


_DISAGREE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
from torchspmd.engines.native.communication import shared_sums
rank = dist.get_rank()
shared_sums.all_reduce(torch.ones(2)).wait()
try:
    if os.environ["CASE"] == "skip" and rank == 1:
        os._exit(0)  # ends without making the sum the other makes
    t = {"size": torch.ones(3 if rank == 0 else 4), "dtype": torch.ones(3, dtype=torch.float32 if rank == 0
                                                                         else torch.float64)}.get(
        os.environ["CASE"], torch.ones(2))
    shared_sums.all_reduce(t).wait()
    print(f"rank {rank}: no error", flush=True)
except Exception as e:
    print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.parametrize("case", ["size", "dtype", "skip"])
def test_disagreeing_or_ended_processes_raise(tmp_path, case):
    """Different sizes or dtypes: every process raises, naming them. A process that ended: the one
    waiting for it raises (within the check interval), naming it, instead of waiting forever."""
    script = tmp_path / "sums.py"
    script.write_text(textwrap.dedent(_DISAGREE))
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CASE=case)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    if case in ("size", "dtype"):
        for rank, out in enumerate(outs):
            assert f"rank {rank}: SpmdError" in out, out
            assert "differ in dtype or size" in out, out
            assert ("torch.float32 x 3, torch.float32 x 4" if case == "size" else
                    "torch.float32 x 3, torch.float64 x 3") in out, out
    else:
        assert "rank 0: PeerLost" in outs[0] and "process 1 (pid" in outs[0] and "ended" in outs[0], outs[0]


class _Bucket:  # (what DDP hands a communication hook)
    def __init__(self, t, index, count):
        self.t, self.i, self.n = t, index, count

    def buffer(self):
        return self.t

    def index(self):
        return self.i

    def is_last(self):
        return self.i == self.n - 1


def _without_shared_memory(how: str):
    """Sums, gradient buckets and FSDPv2's gather where the shared memory cannot be used:
    ``how`` is "weak-order" (a machine whose stores other cores may see out of order, as
    ARM's: the gate forced), "no-room" (/dev/shm cannot hold the buffer, as in a default
    Docker container's 64 MB) or "outgrown" (the gradient buckets outgrow the buffer made at
    the start, and no larger one can be had). Each user falls back alike on every process."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    from torchspmd.engines.native.communication import gradient_sums, shared_memory, shared_sums

    made = shared_memory.new_file

    def no_room(size):
        return [None, f"cannot make a {size}-byte buffer (test: no room)"]

    if how == "weak-order":
        os.environ[shared_memory.ORDER_SWITCH] = "weak"  # (the pool puts the environment back)
    elif how == "no-room":
        shared_memory.new_file = no_room
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        group = dist.new_group(list(range(world)))  # (a group no earlier test made a buffer for)
        small = torch.tensor([rank + 0.25, 2.0 * rank])
        work = shared_sums.all_reduce(small, group)
        through_backend = not isinstance(work, shared_sums._Done)
        work.wait()
        sums_right = small.tolist() == [sum(r + 0.25 for r in range(world)), 2.0 * sum(range(world))]
        params = [nn.Parameter(torch.zeros(1000))]
        ddp = DistributedDataParallel(nn.ParameterList(params), process_group=group, init_sync=False)
        chosen = gradient_sums.register(ddp, group, params)
        if how == "outgrown":
            shared_memory.new_file = no_room
        n = 400_000 if how == "outgrown" else 1000  # (1.6 MB: more than the 1 MiB row made at the start)
        every = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        hook, state = ddp._comm_hooks[0]
        grads_right = []
        for step in range(2):
            bucket = every[rank].clone()
            hook(state, _Bucket(bucket, 0, 1)).wait()
            grads_right.append(torch.allclose(bucket, sum(every), rtol=1e-6, atol=1e-6))
        return through_backend, sums_right, chosen, all(grads_right)
    finally:
        shared_memory.new_file = made


@pytest.mark.parametrize("how", ["weak-order", "no-room", "outgrown"])
def test_every_user_falls_back_to_the_backend_alike(dist, how):
    for through_backend, sums_right, chosen, grads_right in dist(2).run(_without_shared_memory, how):
        assert sums_right and grads_right
        assert through_backend == (how != "outgrown")
        # (weak order: the buckets still go through shared memory, ordered by the backend's barriers)
        assert chosen == ("backend" if how == "no-room" else "shared memory")
