"""torch_xla's sharded-tensor semantics on the native engine (issue #17): meshes over device
ids in any order. Checked against one device's computation and against the layout torch_xla
documents (a device's shard is the block at its place in the logical mesh)."""

import numpy as np
import pytest
import torch

import torchspmd as ts
from _helpers import same_on_every_rank


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


def _train_on_reordered(order_name):
    """FSDPv2 with batches from MpDeviceLoader over a mesh in another device order, against
    plain PyTorch on the same global batches."""
    import copy

    n = ts.global_runtime_device_count()
    ids, _, _ = _orders(n)[order_name]
    mesh = ts.Mesh(np.asarray(ids).reshape(-1), (n, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    sharded = ts.FSDPv2(copy.deepcopy(plain), mesh)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(21, 5, generator=g), torch.randn(21, 3, generator=g))
    batches = list(torch.utils.data.DataLoader(data, batch_size=7))  # 7 rows: uneven over 2 and 4 devices
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=7), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, sharded)]
    losses = []
    for (x, y), (gx, gy) in zip(loader, batches):
        pair = []
        for model, opt, (a, b) in ((sharded, opts[1], (x, y)), (plain, opts[0], (gx, gy))):
            loss = torch.nn.functional.mse_loss(model(a), b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(float(loss))
        losses.append(pair)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in sharded.parameters()]
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(params, plain.parameters()))
    return losses, close


@pytest.mark.parametrize("world", [2, 4])
def test_fsdpv2_and_loader_over_reordered_device_ids(dist, world):
    for order in ("flip", "shuffle"):
        results = dist(world).run(_train_on_reordered, order)
        losses = same_on_every_rank([r[0] for r in results])
        for sharded, plain in losses:
            assert sharded == pytest.approx(plain, rel=1e-5), (order, losses)
        assert all(r[1] for r in results), order


def _tuple_out_of_mesh_order():
    mesh = ts.Mesh(np.arange(4), (2, 2), ("data", "model"))
    try:
        ts.mark_sharding(torch.randn(8, 3), mesh, (("model", "data"), None))
    except ts.SpmdError as e:
        return str(e)
    return "no error"


def test_tuple_of_axes_out_of_mesh_order_is_refused_with_the_order_to_write(dist):
    message = same_on_every_rank(dist(4).run(_tuple_out_of_mesh_order))
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
    processes hold no row of a batch, as a torch_xla device holds only padding. Against plain
    PyTorch on the same global batches."""
    import copy

    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = copy.deepcopy(plain)
    if wrapper == "fsdpv2":
        model = ts.FSDPv2(model, mesh)
    g = torch.Generator().manual_seed(1)
    rows = n - 1
    data = torch.utils.data.TensorDataset(torch.randn(3 * rows + 1, 5, generator=g),
                                          torch.randn(3 * rows + 1, 3, generator=g))
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=rows), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, plain)]
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


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wrapper", ["pattern1", "fsdpv2"])
def test_batches_smaller_than_the_device_count_train_as_one_device(dist, world, wrapper):
    results = dist(world).run(_train_small_batches, wrapper)
    losses = same_on_every_rank([r[0] for r in results])
    for sharded, plain in losses:
        assert sharded == pytest.approx(plain, rel=1e-5), losses
    assert all(r[1] for r in results)
    assert results[-1][2][0] == 0  # the last process held no row of the first batch
