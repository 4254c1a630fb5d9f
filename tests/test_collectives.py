"""FSDPv2's collectives (torchspmd/engines/native/communication/collectives.py): the all-reduce forms give the
native collectives' results; the shared-memory ones are exact on random fp32 and bf16 data
(stated below), grow their buffer, and stay right when one process is late; and the choice
of variant."""

import os
import warnings

import pytest
import torch

import torchspmd as ts


def _compare(numel):
    """The all-reduce forms against the native collectives, on integer-valued floats (sums
    exact in any order)."""
    import torch.distributed as dist

    from torchspmd.engines.native.communication.collectives import (
        AllReduceAllGather,
        AllReduceReduceScatter,
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
    return (torch.equal(native, ours), torch.equal(native, separate), torch.equal(rs_native, rs_ours),
            torch.isinf(ours[0]).item())


@pytest.mark.parametrize("world,numel", [(2, 5), (3, 7), (4, 1), (4, 13)])
def test_allreduce_forms_equal_native_collectives(dist, world, numel):
    for ag, ag_separate, rs, inf in dist(world).run(_compare, numel):
        assert ag and ag_separate and rs and inf


def _variant(collectives):
    from torch.distributed.fsdp import FSDPModule

    from torchspmd.engines.native.communication.collectives import (
        AllReduceAllGather,
        SharedMemoryAllGather,
        SharedParamsAllGather,
    )

    mesh = ts.Mesh(list(range(ts.global_runtime_device_count())), (ts.global_runtime_device_count(), 1),
                   ("fsdp", "model"))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    wrapped = ts.FSDPv2(model, mesh, collectives=collectives)
    units = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    comms = [u._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm for u in units]
    return [type(c).__name__ if isinstance(c, (AllReduceAllGather, SharedMemoryAllGather, SharedParamsAllGather))
            else "native" for c in comms]


def test_auto_picks_shared_memory_on_one_machine(dist):
    from torchspmd.engines.native.communication.collectives import can_point_storages

    # the gathered parameters live in shared memory where this torch lets FSDP2's storages point there
    shm = "SharedParamsAllGather" if can_point_storages() else "SharedMemoryAllGather"
    assert dist(2).run(_variant, "auto")[0] == [shm]
    assert dist(2).run(_variant, "shm")[0] == [shm]
    assert dist(2).run(_variant, "native")[0] == ["native"]
    assert dist(2).run(_variant, "allreduce")[0] == ["AllReduceAllGather"]


def _variant_without_room():
    """'auto' where /dev/shm has no room for the unit (a default Docker container's 64 MB):
    the backend's collectives, with a warning. ('shm' asked by name raises:
    test_shared_memory_buffer_that_cannot_be_made_fails_on_every_rank.)"""
    import warnings

    from torchspmd.engines.native.communication import shared_memory
    from torchspmd.engines.native.communication.collectives import SharedMemoryUnavailableWarning

    made = shared_memory.new_file
    shared_memory.new_file = lambda size: [None, f"cannot make a {size}-byte shared-memory buffer (test: no room)"]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            auto = _variant("auto")
        return auto, [str(w.message) for w in caught if issubclass(w.category, SharedMemoryUnavailableWarning)]
    finally:
        shared_memory.new_file = made


def test_auto_takes_the_backend_where_dev_shm_has_no_room(dist):
    for auto, warned in dist(2).run(_variant_without_room):
        assert auto == ["native"]  # ('auto' through the backend: FSDP2's gather, the all-reduce reduce-scatter)
        assert len(warned) == 1 and "test: no room" in warned[0] and "--shm-size" in warned[0], warned


def _fsdp_reduce_scatter_path():
    """Train an FSDPv2 model (two units of uneven sizes and the root) one step with the
    shared-memory collectives; return the shared buffers the collectives asked for, in order."""
    import functools

    import torchspmd.engines.native.communication.collectives as coll

    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(list(range(n)), (n, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={torch.nn.Linear})
    wrapped = ts.FSDPv2(model, mesh, collectives="shm", auto_wrap_policy=policy)
    x = ts.mark_sharding(torch.randn(8, 5), mesh, ("fsdp", None))
    asked, arena = [], coll._arena
    coll._arena = lambda group, kind: asked.append(kind) or arena(group, kind)
    try:
        wrapped(x).square().mean().backward()
    finally:
        coll._arena = arena
    return asked


def test_fsdp2_writes_its_gradients_straight_into_the_shared_buffer(dist):
    """Under FSDP2 the reduce-scatter's input is the shared buffer itself: the stepped path (a
    copy of every gradient into a small shared buffer) is never used."""
    for asked in dist(2).run(_fsdp_reduce_scatter_path):
        assert asked.count("reduce_scatter_input") == 2 and "reduce_scatter" not in asked, asked


def _bad_choice():
    try:
        _variant("fastest")
    except ts.SpmdError as e:
        return str(e)


def test_unknown_variant_is_refused(dist):
    assert "collectives='fastest'" in dist(2).run(_bad_choice)[0]


# -- the shared-memory collectives on random data ---------------------------------------------
# What is guaranteed (and measured here): the all-gather is a copy, bit-identical to gloo's on
# every rank. The reduce-scatter sums each element over the processes in rank order,
# ((x_0 + x_1) + x_2) + ..., accumulating in float32 (bf16 inputs are rounded to bf16 once, at
# the end), whatever order the processes arrive in: each rank's shard is bit-identical to that
# fixed-order sum, so the reduced tensor is one value, the same on every run. gloo's own
# reduce-scatter adds in ring order (a different order for each shard, every addition rounded to
# the dtype), so against gloo the tolerance is the sum of the two rounding-error bounds:
# |shm - exact| <= gamma(W-1, 2^-24) * sum|x_i| (+ 2^-8 |sum| for the final bf16 rounding),
# |gloo - exact| <= gamma(W-1, u) * sum|x_i| with u the dtype's unit roundoff (2^-24, 2^-8),
# where gamma(k, u) = k u / (1 - k u) (recursive summation; Higham, Accuracy and Stability of
# Numerical Algorithms, 4.2).

_UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8}


def _data(kind, n, dtype, seed, world, rank):
    """This rank's input of one call: a shard of ``n`` elements to all-gather ("ag"), or
    ``n * world`` gradients to reduce-scatter ("rs"). Random values over six orders of
    magnitude (sums that cancel), the same in the workers and in the test process."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    numel = n if kind == "ag" else n * world
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x *= torch.exp(2 * torch.randn(numel, generator=g, dtype=torch.float64))
    return x.to(getattr(torch, dtype))


def _busy(seconds):
    """Real work for a while: skews this rank against the others."""
    import time

    a, start = torch.randn(64, 64), time.perf_counter()
    while time.perf_counter() - start < seconds:
        a = torch.tanh(a @ a)


def _shm_calls(calls, fresh_group=False, with_gloo=False):
    """Run ``calls`` through the shared-memory all-gather / reduce-scatter, as FSDP2 drives
    them (the all-gather input copied into its slot of the buffer ``allocate`` gave), and
    return each call's output (and gloo's, ``with_gloo``), the arena's size and file after it,
    and for each of those files whether it still exists and whether it is still mapped.
    A call: (kind, n, dtype, seed, rs_step, skew), kind "ag" (all-gather), "rsa" (reduce-scatter
    as FSDP2 calls it: its input from ``allocate``) or "rs" (a direct reduce-scatter call on a
    plain input: the stepped path), ``rs_step`` the direct reduce-scatter's elements
    per step (None: the default), ``skew`` (rank, where, seconds) or None: that rank works
    for a while before the call ("before"), between ``allocate`` and the all-gather
    ("between") or between the all-gather and reading its output ("after")."""
    import torch.distributed as dist

    import torchspmd.engines.native.communication.collectives as coll

    group = dist.new_group(list(range(dist.get_world_size()))) if fresh_group else dist.group.WORLD
    world, rank = group.size(), group.rank()
    ag, rs = coll.SharedMemoryAllGather(group), coll.SharedMemoryReduceScatter(group)
    default_step, results, out = coll.RS_STEP_BYTES, [], None
    try:
        for kind, n, dtype, seed, rs_step, skew in calls:
            x = _data(kind, n, dtype, seed, world, rank)
            delay = skew[2] if skew and skew[0] == rank else 0
            where = skew[1] if delay else None
            if where == "before":
                _busy(delay)
            if kind == "ag":
                out = ag.allocate((n * world,), dtype=x.dtype, device=torch.device("cpu"))
                out.view(world, -1)[rank].copy_(x)
                if where == "between":
                    _busy(delay)
                ag(out, out.view(world, -1)[rank], group)
                if where == "after":
                    _busy(delay)
                got = out.clone()
                native = torch.empty_like(got)
                if with_gloo:
                    dist.all_gather_into_tensor(native, x, group=group)
            elif kind == "rsa":  # as FSDP2 drives it: the input from allocate, then the output, then the call
                inp = rs.allocate((n * world,), dtype=x.dtype, device=torch.device("cpu"))
                inp.copy_(x)
                got = rs.allocate((n,), dtype=x.dtype, device=torch.device("cpu"))
                if where == "between":
                    _busy(delay)
                rs(got, inp, group, dist.ReduceOp.SUM)
                if where == "after":
                    _busy(delay)
                native = torch.empty_like(got)
                if with_gloo:
                    dist.reduce_scatter_tensor(native, x.clone(), group=group)
            else:  # a direct call with this process's own input: through the small buffer, in steps
                coll.RS_STEP_BYTES = rs_step * world * world * x.element_size() if rs_step else default_step
                got = torch.empty(n, dtype=x.dtype)
                rs(got, x.clone(), group, dist.ReduceOp.SUM)
                native = torch.empty_like(got)
                if with_gloo:
                    dist.reduce_scatter_tensor(native, x.clone(), group=group)
            arena = coll._ARENAS[(group.group_name, {"ag": "all_gather", "rs": "reduce_scatter",
                                                   "rsa": "reduce_scatter_input"}[kind])]
            results.append((got, native if with_gloo else None, arena.capacity, arena.path))
    finally:
        coll.RS_STEP_BYTES = default_step
    del out
    with open("/proc/self/maps") as f:
        maps = f.read()
    return results, {path: (os.path.exists(path), path in maps) for *_, path in results}


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _check(calls, per_rank):
    """The outputs of ``calls`` on every rank against references computed here, in plain
    torch: the all-gather bit for bit; the reduce-scatter bit for bit against the rank-order
    float32 sum, and within the rounding-error bounds (above) of the float64 sum and of gloo's."""
    world = len(per_rank)
    per_rank = [results for results, _ in per_rank]
    worst = {}
    for i, (kind, n, dtype, seed, _, _) in enumerate(calls):
        xs = [_data(kind, n, dtype, seed, world, r) for r in range(world)]
        if kind == "ag":
            want = torch.cat(xs)
            for rank, results in enumerate(per_rank):
                got, native, *_ = results[i]
                assert torch.equal(_bits(got), _bits(want)), f"all-gather {i} wrong on rank {rank}"
                if native is not None:
                    assert torch.equal(_bits(native), _bits(want)), "gloo's all-gather is a copy too"
            continue
        in_order = xs[0].float()
        for x in xs[1:]:
            in_order = in_order + x.float()  # rank order, float32
        in_order = in_order.to(xs[0].dtype)
        exact = torch.stack([x.double() for x in xs]).sum(0)  # off by <= 3 * 2^-53 * sum|x|: negligible here
        magnitude = torch.stack([x.double().abs() for x in xs]).sum(0)
        u = _UNIT_ROUNDOFF[dtype]
        gamma = lambda u: (world - 1) * u / (1 - (world - 1) * u)  # noqa: E731
        shm_bound = gamma(2.0**-24) * magnitude
        if dtype == "bfloat16":
            shm_bound = shm_bound + u * (exact.abs() + shm_bound)
        gloo_bound = gamma(u) * magnitude
        for rank, results in enumerate(per_rank):
            got, native, *_ = results[i]
            mine = slice(rank * n, (rank + 1) * n)
            assert torch.equal(_bits(got), _bits(in_order[mine])), (
                f"reduce-scatter {i} ({dtype}, n={n}) on rank {rank}: not the rank-order float32 sum")
            assert ((got.double() - exact[mine]).abs() <= shm_bound[mine]).all()
            if native is not None:
                assert ((native.double() - exact[mine]).abs() <= gloo_bound[mine]).all()
                diff = (got.double() - native.double()).abs()
                assert (diff <= shm_bound[mine] + gloo_bound[mine]).all(), "shm and gloo differ beyond the bounds"
                worst[dtype] = max(worst.get(dtype, 0.0), (diff / magnitude[mine]).max().item())
    return worst


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_collectives_on_random_data(dist, world):
    """fp32 and bf16, uneven sizes, the reduce-scatter in one or many steps (with a remainder):
    bit-identical to the rank-order sum on every rank, within the bounds of gloo's."""
    calls = [(kind, n, dtype, seed, step, None)
             for seed, (n, step) in enumerate([(1, None), (7, 3), (1031, 100), (20011, None)])
             for dtype in ("float32", "bfloat16") for kind in ("ag", "rs", "rsa")]
    per_rank = dist(world).run(_shm_calls, calls, with_gloo=True)
    worst = _check(calls, per_rank)
    if world == 2:  # one addition, a + b == b + a: gloo's result exactly
        assert worst == {"float32": 0.0, "bfloat16": 0.0}, worst
    else:  # not vacuous: the sums do differ from gloo's (other orders, bf16 rounded at each step)
        assert worst["float32"] > 0 and worst["bfloat16"] > 0, worst


@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_arena_grows(dist, world):
    """A fresh group: small calls, calls larger than the arena (it grows, on every rank, and the
    results stay exact), small ones again (in the grown arena), then a bf16 call. No file is
    left in /dev/shm, and the buffers grown out of are unmapped."""
    n_big = 300_007  # > 1 MB per all-gather output and per reduce-scatter step
    calls = [("ag", 10, "float32", 1, None, None), ("rs", 10, "float32", 2, None, None),
             ("ag", n_big, "float32", 3, None, None), ("rs", n_big, "float32", 4, None, None),
             ("ag", 9, "float32", 5, None, None), ("rs", 9, "float32", 6, None, None),
             ("ag", 1001, "bfloat16", 7, None, None), ("rs", 1001, "bfloat16", 8, 100, None),
             ("rsa", 10, "float32", 9, None, None), ("rsa", n_big, "float32", 10, None, None),
             ("rsa", 9, "bfloat16", 11, None, None)]
    per_rank = dist(world).run(_shm_calls, calls, fresh_group=True, with_gloo=True)
    _check(calls, per_rank)
    first = [c for _, _, c, _ in per_rank[0][0][:8]]
    big_ag, big_rs = n_big * world * 4, min(n_big, 8 * 2**20 // (world * world * 4)) * world * world * 4
    for results, files in per_rank:
        rsa = [(c, p) for _, _, c, p in results[8:]]  # the input buffer: every process's input, grown once
        assert rsa[0][0] == 2**20 and rsa[1][0] == rsa[2][0] >= n_big * world * world * 4, rsa
        assert rsa[1][1] == rsa[2][1] != rsa[0][1], rsa
        assert [files[p][1] for _, p in rsa] == [False, True, True], files
        results = results[:8]
        capacity = [c for _, _, c, _ in results]
        assert capacity == first and capacity[0] == capacity[1] == 2**20, capacity  # same everywhere
        assert capacity[2] >= big_ag > 2**20 and capacity[3] >= big_rs > 2**20, capacity  # grown
        assert capacity[4:] == [capacity[2], capacity[3]] * 2, capacity  # and kept
        paths = [p for *_, p in results]
        assert len(set(paths)) == 4 and paths[4:] == paths[2:4] * 2, paths
        assert not any(exists for exists, _ in files.values()), files  # deleted once mapped
        assert [files[p][1] for p in paths[:4]] == [False, False, True, True], files  # old ones unmapped


def test_shared_memory_collectives_with_a_late_process(dist):
    """One process works for a while (0.3 s, real computation) at each point of the calls where
    a missing wait would let the others read a slot before it is written or overwrite one still
    being read: the results are still exact, on every rank."""
    calls = [("ag", 513, "float32", 1, None, (1, "before", 0.3)),
             ("ag", 513, "float32", 2, None, (1, "between", 0.3)),
             ("ag", 513, "float32", 3, None, (1, "after", 0.3)),
             ("ag", 513, "float32", 4, None, (0, "after", 0.3)),
             ("ag", 2**18, "float32", 5, None, (0, "before", 0.3)),  # grows: rank 0 creates the segment
             ("rs", 513, "float32", 6, 64, (1, "before", 0.3)),
             ("rs", 513, "float32", 7, 64, (2, "before", 0.3)),
             ("rs", 2**18, "float32", 8, None, (0, "before", 0.3)),
             ("rsa", 513, "float32", 11, None, (1, "before", 0.3)),
             ("rsa", 513, "float32", 12, None, (2, "between", 0.3)),
             ("rsa", 513, "float32", 13, None, (0, "after", 0.3)),
             ("rsa", 2**18, "float32", 14, None, (1, "after", 0.3)),  # grows after a late process
             ("rsa", 513, "float32", 15, None, None),
             ("ag", 5, "float32", 9, None, None), ("rs", 5, "float32", 10, None, None)]
    _check(calls, dist(3).run(_shm_calls, calls, fresh_group=True))


def _no_room():
    """A unit too big for /dev/shm (1 PiB): the buffer cannot be made."""
    import torch.distributed as dist

    from torchspmd.engines.native.communication.collectives import SharedMemoryAllGather

    group = dist.new_group(list(range(dist.get_world_size())))
    try:
        SharedMemoryAllGather(group).allocate((2**48,), dtype=torch.float32, device=torch.device("cpu"))
    except ts.SpmdError as e:
        return str(e)


def test_shared_memory_buffer_that_cannot_be_made_fails_on_every_rank(dist):
    """The error (/dev/shm too small) is raised on every rank, naming the setting and the way out,
    before any memory is touched."""
    for message in dist(2).run(_no_room):
        assert message and "collectives='shm'" in message and "1125899906842624-byte" in message, message
        assert "/dev/shm" in message and "--shm-size" in message and "collectives='allreduce'" in message, message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reduce_scatter_sums_in_rank_order_at_any_process_count(dtype):
    """The reduce-scatter's sum at every process count (more than the multi-process tests
    start, where ``torch.sum`` over the rows would regroup them), on strided rows as the
    reduce-scatter reads them: exactly the rank-order float32 sum."""
    from torchspmd.engines.native.communication.collectives import sum_in_rank_order

    for world in (1, 2, 3, 4, 5, 8, 17):
        for n in (1, 15, 1003, 70001):  # tails of the vectorized kernels, and a size they split
            # as the reduce-scatter reads them: this process's column of every row (strided)
            buffer = torch.stack([_data("rs", n, dtype, 11, world, r) for r in range(world)])
            rows = buffer.view(world, world, n)[:, world // 2]
            want = rows[0].float()
            for r in range(1, world):
                want = want + rows[r].float()
            got = torch.empty(n, dtype=rows.dtype)
            sum_in_rank_order(rows, got)
            assert torch.equal(_bits(got), _bits(want.to(rows.dtype))), (world, n)


# -- the gathered parameters in shared memory -------------------------------------------------
def _mapping_of(ptr):
    """(file, offset of ``ptr`` in the mapping) of the mapping of this process holding ``ptr``."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if start <= ptr < end:
            return " ".join(fields[5:]), ptr - start
    return "", 0


def _nested_model():
    """Uneven sizes (not divisible by 2, 3 or 4), a unit inside a unit, and a root with
    parameters of its own."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(13, 11), torch.nn.Tanh(), torch.nn.Linear(11, 13))
    return torch.nn.Sequential(torch.nn.Linear(5, 13), inner, torch.nn.Linear(13, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 7))


def _train_shared(shared, late=None, steps=3, prefetch=False, slow_sum=None):
    """Train ``_nested_model`` under FSDPv2 (shm collectives) ``steps`` Adam steps; with
    ``shared`` False, TORCHSPMD_SHARED_PARAMS=0 (the gathered parameters copied into each
    process's memory). ``late``: (rank, seconds): that rank computes for a while in the
    forward and backward of every wrapped Linear, so that the others run ahead. ``prefetch``:
    the first unit gathers the next two as it starts (FSDP2's explicit prefetching: two
    gathers wait to be copied out at once). ``slow_sum``: that rank computes for 0.05 s
    before each sum of a reduce-scatter's rows, so that the others, done with theirs, run
    ahead to the next reduce-scatter. Returns the
    losses, the full parameters, for each Linear's forward (in order) where its gathered
    weight lives: (file of the mapping, offset in it), and the barriers, gathers and
    reduce-scatters of the last step."""
    import torch.distributed as tdist

    import torchspmd.engines.native.communication.collectives as coll

    counts = {"barrier": 0, "gather": 0, "reduce_scatter": 0}
    originals = (tdist.barrier, coll.SharedParamsAllGather.gather, coll.SharedMemoryReduceScatter.__call__,
                 coll.sum_in_rank_order)

    def counted(name, f):
        def call(*args, **kwargs):
            counts[name] += 1
            return f(*args, **kwargs)
        return call

    tdist.barrier = counted("barrier", tdist.barrier)
    coll.SharedParamsAllGather.gather = counted("gather", coll.SharedParamsAllGather.gather)
    coll.SharedMemoryReduceScatter.__call__ = counted("reduce_scatter", coll.SharedMemoryReduceScatter.__call__)
    if slow_sum == ts.global_ordinal():
        coll.sum_in_rank_order = lambda rows, out: (_busy(0.05), originals[3](rows, out))
    try:
        return _train_shared_counted(shared, late, steps, prefetch, counts)
    finally:
        (tdist.barrier, coll.SharedParamsAllGather.gather, coll.SharedMemoryReduceScatter.__call__,
         coll.sum_in_rank_order) = originals


def _train_shared_counted(shared, late, steps, prefetch, counts):
    from torchspmd.engines.native.communication.collectives import SHARED_PARAMS_SWITCH

    os.environ[SHARED_PARAMS_SWITCH] = "1" if shared else "0"
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(list(range(n)), (n, 1), ("fsdp", "model"))
    model = _nested_model()
    wrap = {model[0], model[1], model[1][0], model[2]}
    wrapped = ts.FSDPv2(model, mesh, collectives="shm",
                        auto_wrap_policy=lambda module, recurse, **kw: recurse or module in wrap)
    if prefetch:
        first, second, third = (wrapped.module[i]._orig_module for i in range(3))  # the FSDP2 units
        first.set_modules_to_forward_prefetch([second, third])
    where = []

    def look(module, args):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if get_proxy_mode() is not None:
            return  # (FSDPv2's analysis traces the forward once, on stand-ins)
        where.append(_mapping_of(module.weight.data_ptr()))
        if late and late[0] == ts.global_ordinal():
            _busy(late[1])

    def look_back(module, grad_output):
        if late and late[0] == ts.global_ordinal():
            _busy(late[1])

    for m in wrapped.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(look)
            m.register_full_backward_pre_hook(look_back)
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses = []
    warnings.filterwarnings("ignore", "Full backward hook is firing")  # the first Linear's input needs none
    for _ in range(steps):
        x = ts.mark_sharding(torch.randn(7, 5, generator=g), mesh, ("fsdp", None))
        counts.update(barrier=0, gather=0, reduce_scatter=0)
        with ts.step():
            loss = wrapped(x).sin().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, ts.full_state_dict(wrapped), where, dict(counts)


@pytest.mark.parametrize("world", [2, 4])
def test_gathered_parameters_live_once_in_shared_memory(dist, world):
    """Where this torch allows it, every process reads a unit's gathered parameters from the
    same shared pages (the same file, the same place in it, on every rank), and training
    gives bit for bit what the copying all-gather gives, also with two gathers waiting at once
    (explicit prefetching); with TORCHSPMD_SHARED_PARAMS=0 the gathered parameters are in
    each process's own memory."""
    from torchspmd.engines.native.communication.collectives import can_point_storages

    if not can_point_storages():
        pytest.skip("this torch cannot point a storage at shared memory (UntypedStorage._swap_data_ptr_)")
    shared = dist(world).run(_train_shared, True)
    copied = dist(world).run(_train_shared, False)
    prefetched = dist(world).run(_train_shared, True, None, 3, True)
    for (losses, state, where, _), (ref_losses, ref_state, ref_where, _), (p_losses, p_state, _, _) in \
            zip(shared, copied, prefetched):  # the full state on rank 0
        assert losses == ref_losses == p_losses and losses == shared[0][0] and state.keys() == ref_state.keys()
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]) and torch.equal(p_state[k], ref_state[k]), k
        assert len(where) == 3 * 5 and all("/torchspmd-" in f and f.endswith("(deleted)") for f, _ in where), where
        assert not any("/torchspmd-" in f for f, _ in ref_where), ref_where
    assert all(w == shared[0][2] for _, _, w, _ in shared)  # the same pages everywhere


@pytest.mark.parametrize("late_rank", [0, 2])
def test_shared_parameters_with_a_late_process(dist, late_rank):
    """One process computes for a while (0.05 s, real work) before each Linear's forward and
    backward, so the others run ahead into the next unit's gathering: a region written before
    every process is done reading it would show in the results. They are bit for bit those of
    the copying all-gather without the late process, on every rank."""
    from torchspmd.engines.native.communication.collectives import can_point_storages

    if not can_point_storages():
        pytest.skip("this torch cannot point a storage at shared memory (UntypedStorage._swap_data_ptr_)")
    late = dist(3).run(_train_shared, True, (late_rank, 0.05))
    copied = dist(3).run(_train_shared, False)
    for (losses, state, _, _), (ref_losses, ref_state, _, _) in zip(late, copied):  # full state on rank 0
        assert losses == ref_losses and state.keys() == ref_state.keys()
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), k


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_rows_are_written_again_only_after_every_sum(dist, world):
    """A reduce-scatter's rows are written again without a barrier of their own when a
    barrier of the group (the next unit's gathering) has passed since the last sum: fewer
    barriers than one per gather and two per reduce-scatter. With one process summing 0.05 s
    late every time, the others run ahead as far as that allows: training is still bit for
    bit the copying all-gather's, on every rank."""
    from torchspmd.engines.native.communication.collectives import can_point_storages

    if not can_point_storages():
        pytest.skip("this torch cannot point a storage at shared memory (UntypedStorage._swap_data_ptr_)")
    slow = dist(world).run(_train_shared, True, None, 3, False, world - 1)
    copied = dist(world).run(_train_shared, False)
    for (losses, state, _, counts), (ref_losses, ref_state, _, _) in zip(slow, copied):
        assert losses == ref_losses and state.keys() == ref_state.keys()
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), k
        assert counts["gather"] and counts["reduce_scatter"], counts
        assert counts["barrier"] < counts["gather"] + 2 * counts["reduce_scatter"], counts
