"""torch_xla's sharded-tensor semantics on the native engine (issue #17): meshes over device
ids in any order. Checked against one device's computation and against the layout torch_xla
documents (a device's shard is the block at its place in the logical mesh)."""

import numpy as np
import pytest
import torch
from _helpers import same_on_every_rank

import torchspmd as ts


def _orders(n):
    """Device orders torch_xla accepts: reversed, transposed (2-D), a fixed shuffle."""
    out = {"flip": (np.flip(np.arange(n)), (n,), ("x",)),
           "shuffle": (np.random.RandomState(0).permutation(n), (n,), ("x",))}
    if n == 4:
        out["transposed"] = (np.arange(4).reshape(2, 2).T, (2, 2), ("x", "y"))
    return out


def _reordered(order_name):
    n = ts.global_runtime_device_count()
    ids, shape, names = _orders(n)[order_name]
    mesh = ts.Mesh(ids, shape, names)
    rank = ts.process_index()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g)  # rows not divisible by the devices
    w = torch.randn(5, 3, generator=g)
    spec = ("x", None) if len(shape) == 1 else (("x", "y"), None)
    s = ts.mark_sharding(x.clone(), mesh, spec)
    # where this process sits in the logical mesh, in C order along the sharded axes
    logical = np.asarray(ids).reshape(shape)
    place = int(np.ravel_multi_index(tuple(int(i) for i in np.argwhere(logical == rank)[0]), shape))
    expected = torch.chunk(x, n, dim=0)[place] if place < len(torch.chunk(x, n, dim=0)) else x[:0]
    local_ok = torch.equal(s.to_local(), expected)
    full_ok = torch.equal(s.full_tensor(), x)
    y = (s @ w).sum()  # a computation on the sharded tensor: one device's value
    return local_ok, full_ok, float(y), float((x @ w).sum())


@pytest.mark.parametrize("world", [2, 4])
def test_mesh_over_reordered_device_ids(dist, world):
    for order in _orders(world):
        results = dist(world).run(_reordered, order)
        assert all(r[0] for r in results), (order, results)  # each rank holds the block at its place
        assert all(r[1] for r in results), order
        got = same_on_every_rank([r[2] for r in results])
        assert got == pytest.approx(results[0][3], rel=1e-5), order


def _against_plain(mesh, wrapper, rows, n_rows, optimizer):
    """Train a small MLP on ``n_rows`` random rows in global batches of ``rows`` from
    MpDeviceLoader over ``mesh`` (``wrapper``: 'fsdpv2' or 'pattern1', no wrapper) and a copy
    with plain PyTorch on the same global batches: [(its loss, plain loss)] per step,
    whether the final parameters agree (fp32, rtol 1e-5), this process's rows per batch."""
    import copy

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = ts.FSDPv2(copy.deepcopy(plain), mesh) if wrapper == "fsdpv2" else copy.deepcopy(plain)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n_rows, 5, generator=g), torch.randn(n_rows, 3, generator=g))
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=rows), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opts = [optimizer(m.parameters()) for m in (model, plain)]
    losses, local_rows = [], []
    for (x, y), (gx, gy) in zip(loader, torch.utils.data.DataLoader(data, batch_size=rows)):
        local_rows.append(x.to_local().shape[0])
        pair = []
        for m, opt, (a, b) in ((model, opts[0], (x, y)), (plain, opts[1], (gx, gy))):
            loss = torch.nn.functional.mse_loss(m(a), b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(float(loss))
        losses.append(pair)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(params, plain.parameters()))
    return losses, close, local_rows


def _train_on_reordered(order_name):
    """FSDPv2 with batches from MpDeviceLoader over a mesh in another device order (7 rows
    per batch: uneven over 2 and 4 devices)."""
    n = ts.global_runtime_device_count()
    ids, _, _ = _orders(n)[order_name]
    mesh = ts.Mesh(np.asarray(ids).reshape(-1), (n, 1), ("fsdp", "model"))
    return _against_plain(mesh, "fsdpv2", 7, 21, lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.mark.parametrize("world", [2, 4])
def test_fsdpv2_and_loader_over_reordered_device_ids(dist, world):
    for order in ("flip", "shuffle"):
        results = dist(world).run(_train_on_reordered, order)
        losses = same_on_every_rank([r[0] for r in results])
        for sharded, plain in losses:
            assert sharded == pytest.approx(plain, rel=1e-5), (order, losses)
        assert all(r[1] for r in results), order


def _tuple_out_of_mesh_order():
    """mark_sharding takes a tuple in any order (XLA's tiling: devices numbered along the tuple);
    an input ShardingSpec (the loader's rows, split by DTensor) still wants the mesh's order."""
    mesh = ts.Mesh(np.arange(4), (2, 2), ("data", "model"))
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    t = ts.mark_sharding(x.clone(), mesh, (("model", "data"), None))
    coord = ts.Mesh.get_logical_mesh(mesh).tolist()
    place = [(i, j) for i in range(2) for j in range(2) if coord[i][j] == ts.process_index()][0]
    start = (place[1] * 2 + place[0]) * 2  # 'model' outermost
    got = [torch.equal(t.to_local(), x[start:start + 2]), ts.get_sharding(t) == (("model", "data"), None)]
    try:
        ts.ShardingSpec(mesh, (("model", "data"), None))
    except ts.SpmdError as e:
        return got, str(e)
    return got, "no error"


def test_tuple_of_axes_out_of_mesh_order_tiles_as_xla_and_loader_specs_name_the_order(dist):
    got, message = same_on_every_rank([(tuple(g), m) for g, m in dist(4).run(_tuple_out_of_mesh_order)])
    assert all(got), got
    assert "('model', 'data'): the axes of a tuple must appear in the mesh's order ('data', 'model')" in message
    assert "Write ('data', 'model')" in message


def _with_gradients():
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("x",))
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, 5, generator=g)
    # a plain leaf: the result is sharded, the leaf's gradient whole (the global view)
    w = w0.clone().requires_grad_(True)
    y = ts.mark_sharding_with_gradients(w, mesh, ("x", None))
    (y.sin() * y).sum().backward()
    plain = w0.clone().requires_grad_(True)
    (plain.sin() * plain).sum().backward()
    result = [tuple(str(p) for p in y.placements), type(w.grad).__name__, torch.allclose(w.grad, plain.grad, rtol=1e-6)]
    # a replicated DTensor leaf: its gradient comes back sharded as the spec, with one device's values
    p = ts.mark_sharding(w0.clone().requires_grad_(True), mesh, (None, None))
    z = ts.mark_sharding_with_gradients(p, mesh, ("x", None))
    (z.sin() * z).sum().backward()
    result += [tuple(str(q) for q in p.grad.placements), torch.allclose(p.grad.full_tensor(), plain.grad, rtol=1e-6),
               tuple(str(q) for q in p.placements)]  # p itself is unchanged
    try:
        ts.mark_sharding_with_gradients(w, mesh, ("x",))
    except ts.SpmdError as e:
        result.append(str(e))
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_mark_sharding_with_gradients(dist, world):
    r = same_on_every_rank(dist(world).run(_with_gradients))
    assert r[:3] == [("S(0)",), "Tensor", True], r
    assert r[3:6] == [("S(0)",), True, ("R",)], r
    assert "mark_sharding_with_gradients" in r[6] and "('x',)" in r[6], r


def _train_small_batches(wrapper):
    """Batches of fewer rows than devices (3 over 4, 1 over 2, and a last one of 1): some
    processes hold no row of a batch, as a torch_xla device holds only padding."""
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    return _against_plain(mesh, wrapper, n - 1, 3 * (n - 1) + 1, lambda p: torch.optim.Adam(p, lr=0.01))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wrapper", ["pattern1", "fsdpv2"])
def test_batches_smaller_than_the_device_count_train_as_one_device(dist, world, wrapper):
    results = dist(world).run(_train_small_batches, wrapper)
    losses = same_on_every_rank([r[0] for r in results])
    for sharded, plain in losses:
        assert sharded == pytest.approx(plain, rel=1e-5), losses
    assert all(r[1] for r in results)
    assert results[-1][2][0] == 0  # the last process held no row of the first batch


def _to_host():
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("x",))
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))  # uneven rows
    out = ts.mark_sharding(x.clone(), mesh, ("x", None)).sin()
    host = out.cpu()
    result = [type(host).__name__, torch.allclose(host, x.sin()),  # torch_xla's check of a result
              type(out.to(torch.float64)).__name__,  # no device: stays sharded
              type(out.to("cpu")).__name__]  # a CPU mesh's device: "to the device", unchanged
    # a module's parameters and buffers keep their layout: model.cpu() / model.to(device) must not unshard it
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 4)
    lin.register_buffer("scale", torch.arange(4.0))
    expected = float((lin(torch.ones(2, 3)) * lin.scale).sum())
    ts.mark_sharding(lin.weight, mesh, ("x", None))
    ts.mark_sharding(lin.scale, mesh, ("x",))
    lin.cpu()
    lin.to(ts.device())
    with torch.no_grad():
        got = float((lin(torch.ones(2, 3)) * lin.scale).sum())
    result += [isinstance(lin.weight, torch.nn.Parameter), str(lin.weight.placements), type(lin.scale).__name__,
               abs(got - expected) <= 1e-5 * abs(expected)]
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_of_a_sharded_value_is_its_whole_value_and_modules_stay_sharded(dist, world):
    r = same_on_every_rank(dist(world).run(_to_host))
    assert r[:4] == ["Tensor", True, "DTensor", "DTensor"], r
    assert r[4:8] == [True, "(Shard(dim=0),)", "DTensor", True], r


def _shards(case):
    from _xla_shards import expected_shard, spec_of

    name, ids, mesh_shape, shape, dims = case
    names = ("a", "b")[:len(mesh_shape)]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    t = ts.mark_sharding(x.clone(), ts.Mesh(np.array(ids), mesh_shape, names), spec_of(dims, names))
    (shard,) = t.local_shards
    device = int(shard.shard_device.split(":")[-1])
    kind, indices, padded, replica = expected_shard(ids, mesh_shape, shape, dims, device)
    got = [device == ts.process_index(), t.global_tensor is t, t.sharding_type.name == kind,
           shard.replica_id == replica, t.sharding_spec == torchspmd_compat_text(t)]
    if indices is None:
        got += [shard.indices is Ellipsis, torch.equal(shard.data, x)]
    else:
        got += [[(s.start, s.stop) for s in shard.indices] == indices, tuple(shard.data.shape) == padded and
                torch.equal(shard.unpadded_data, x[tuple(slice(a, b) for a, b in indices)])]
    # load_local_shards_: write this process's shard (padded data, as local_shards gives it)
    shard.unpadded_data = shard.unpadded_data + 1
    t.load_local_shards_([shard])
    got.append(torch.equal(t.full_tensor(), x + 1))
    return got


def torchspmd_compat_text(t):
    from torchspmd.engines.native.global_view.sharded_view import sharding_string

    return sharding_string(t)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_tensor_api_follows_torch_xlas_rule(dist, world):
    from _xla_shards import CASES, RANDOM_CASES

    for case in [c for c in CASES + RANDOM_CASES if len(c[1]) == world]:
        for rank, got in enumerate(dist(world).run(_shards, case)):
            assert all(got), (case[0], rank, got)


def _manual(shape):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("x",))
    x0 = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x = x0.clone().requires_grad_(True)
    local = ts.enable_manual_sharding(x, ("x", None), mesh=mesh)  # this process's rows, padded
    shard_shape = tuple(local.shape)
    y = ts.disable_manual_sharding(local.sin() * 2, ("x", None), shape, mesh=mesh)  # per-shard code
    (y * y).sum().backward()
    plain = x0.clone().requires_grad_(True)
    p = plain.sin() * 2
    (p * p).sum().backward()
    try:
        ts.disable_manual_sharding(torch.ones(5, 5), ("x", None), shape, mesh=mesh)
        error = ""
    except ts.SpmdError as e:
        error = str(e)
    return [shard_shape, str(y.placements), torch.allclose(y.full_tensor(), p),
            type(x.grad).__name__, torch.allclose(x.grad, plain.grad, rtol=1e-5), error]


@pytest.mark.parametrize("world", [2, 4])
def test_manual_sharding_round_trip_equals_one_device(dist, world):
    shape = (7, 3)  # uneven: torch_xla pads each shard to ceil(7 / devices) rows
    r = same_on_every_rank(dist(world).run(_manual, shape))
    assert r[0] == (-(-7 // world), 3), r
    assert r[1:5] == ["(Shard(dim=0),)", True, "Tensor", True], r
    assert "disable_manual_sharding: the shard has 5 on dim 0" in r[5], r


def _flat_tiled(want):
    """A dim split over two axes, unevenly (9 rows over 2x2): XLA's flat tiles (3, 3, 3, 0)
    wherever the value goes."""
    from torch.distributed.tensor import DTensor

    mesh = ts.Mesh(np.arange(4), (2, 2), ("a", "b"))
    rank = ts.process_index()
    x, w, r = want["x"], want["w"], want["r"]
    tiles = [(0, 3), (3, 6), (6, 9), (9, 9)]
    start, stop = tiles[rank]

    def block(t):  # this process's block is XLA's
        return torch.equal(t.to_local(), t.full_tensor()[start:stop])

    t = ts.mark_sharding(x.clone(), mesh, (("a", "b"), None))
    got = {"spec": ts.get_sharding(t), "block": block(t) and torch.equal(t.to_local(), x[start:stop])}
    y = (t * 2).sin()  # among flat-tiled tensors: computed there, tiled alike
    got["sin2"] = block(y) and torch.allclose(y.full_tensor(), want["sin2"], rtol=1e-6, atol=1e-7)
    ws = ts.mark_sharding(w.clone(), mesh, ("a", None))  # mixed with a DTensor of the mesh
    got["mm"] = torch.allclose((t @ ws).full_tensor(), want["mm"], rtol=1e-5, atol=1e-6)
    rs = ts.mark_sharding(r.clone(), mesh, ("a", None))
    u = t.clone()
    u.add_(rs)  # in place: keeps its tiling
    got["add_"] = block(u) and ts.get_sharding(u) == (("a", "b"), None) and torch.equal(u.full_tensor(),
                                                                                        want["added"])
    # manual sharding: XLA's block, padded to the tile
    xm = x.clone().requires_grad_(True)
    local = ts.enable_manual_sharding(xm, (("a", "b"), None), mesh=mesh)
    got["manual"] = tuple(local.shape) == (3, 3) and torch.equal(local[:stop - start], x[start:stop])
    back = ts.disable_manual_sharding(local * 2, (("a", "b"), None), (9, 3), mesh=mesh)
    got["manual back"] = block(back) and torch.equal(back.full_tensor(), x * 2)
    (back * rs).sum().backward()  # the gradient goes through the manual region, back to the whole input
    got["manual grad"] = torch.allclose(xm.grad, 2 * r, rtol=1e-6, atol=1e-7)
    # gradients through mark_sharding_with_gradients come back whole to a plain input
    xg = x.clone().requires_grad_(True)
    s = ts.mark_sharding_with_gradients(xg, mesh, (("a", "b"), None))
    (s.sin() * rs).sum().backward()
    got["grad"] = block(s) and torch.allclose(xg.grad, want["sin_grad"], rtol=1e-6, atol=1e-7)
    # annotated again: re-laid out on the mesh; cleared: the whole value
    again = ts.mark_sharding(t, mesh, ("a", "b"))
    got["again"] = ts.get_sharding(again) == ("a", "b") and torch.equal(again.full_tensor(), x)
    whole = ts.clear_sharding(ts.mark_sharding(x.clone(), mesh, (("a", "b"), None)))
    got["cleared"] = type(whole) is torch.Tensor and torch.equal(whole, x)
    got["is DTensor"] = isinstance(t, DTensor) and t.shape == x.shape
    return got


def test_a_dim_split_over_several_axes_is_tiled_flat_everywhere(dist):
    import _xla_shards
    from _clean import run_clean

    want = run_clean(_xla_shards.flat_tiled_values)
    for rank, got in enumerate(dist(4).run(_flat_tiled, want)):
        assert got.pop("spec") == (("a", "b"), None), (rank, got)
        assert all(got.values()), (rank, got)


def _fsdp_over_flat_tiled(want):
    mesh = ts.Mesh(np.arange(4), (2, 2), ("fsdp", "model"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    ts.mark_sharding(model[0].weight, mesh, (("fsdp", "model"), None))  # 9 rows over 4: tiled flat
    model = ts.FSDPv2(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for data, target in want["batches"]:
        with ts.step():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return losses, params


def test_fsdpv2_trains_over_a_flat_tiled_weight_as_one_device(dist):
    import _xla_shards
    from _clean import run_clean

    want = run_clean(_xla_shards.flat_tiled_training)
    for losses, params in dist(4).run(_fsdp_over_flat_tiled, want):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6)
        for k, v in want["params"].items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
