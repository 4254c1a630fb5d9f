"""torch_xla's own answers for the sharded-tensor semantics torchspmd's native engine
matches (issue #17; the native side: tests/test_xla_semantics.py): mesh errors carry
torch_xla's messages, and a mesh over reordered device ids puts on each device the block
at that device's place in the logical mesh."""

import numpy as np
import pytest
import torch
from _xla_shards import CASES, RANDOM_CASES
from _xla_shards import expected_shard, spec_of

pytest.importorskip("torch_xla")

MESH_ERRORS = {
    "global device count": (np.arange(3), (3,), None),
    "axis names count": (np.arange(4), (2, 2), ("a",)),
    "unique axis names": (np.arange(4), (2, 2), ("a", "a")),
    "mesh size": (np.arange(4), (2, 3), None),
    "unique ids": (np.array([0, 1, 1, 2]), (4,), None),
    "ids in range": (np.array([0, 1, 2, 7]), (4,), None),
}


@pytest.mark.parametrize("case", MESH_ERRORS)
def test_native_mesh_errors_contain_torch_xlas_message(ts, case):
    import torch_xla.distributed.spmd as xs

    from torchspmd.mesh import Mesh

    ids, shape, names = MESH_ERRORS[case]
    with pytest.raises(AssertionError) as theirs:
        xs.Mesh(ids, shape, names)
    with pytest.raises(AssertionError) as ours:  # torchspmd's own Mesh, not the delegation to torch_xla
        type.__call__(Mesh, ids, shape, names)
    assert str(theirs.value) in str(ours.value), (str(theirs.value), str(ours.value))


@pytest.mark.parametrize("order", ["flip", "transposed", "shuffle"])
def test_torch_xla_puts_each_block_at_its_devices_place_in_the_mesh(ts, order):
    """The rule tests/test_xla_semantics.py checks torchspmd's processes against."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    ids = {"flip": np.flip(np.arange(4)), "transposed": np.arange(4).reshape(2, 2).T,
           "shuffle": np.random.RandomState(0).permutation(4)}[order]
    shape = (2, 2) if order == "transposed" else (4,)
    spec = ((0, 1), None) if order == "transposed" else (0, None)
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))  # 7 rows: uneven over 4 devices
    t = xs.mark_sharding(x.to(torch_xla.device()), xs.Mesh(np.asarray(ids).reshape(-1), shape), spec)
    logical = np.asarray(ids).reshape(shape)
    for shard in t.local_shards:
        device = int(shard.shard_device.split(":")[-1])
        place = int(np.ravel_multi_index(tuple(int(i) for i in np.argwhere(logical == device)[0]), shape))
        rows = -(-7 // 4)  # torch_xla pads to ceil(rows / devices) per device
        got = shard.indices[0]
        assert (got.start, got.stop) == (place * rows, min(7, (place + 1) * rows)), (order, device, shard.indices)
        assert torch.equal(shard.unpadded_data.cpu(), x[shard.indices[0]])


def test_mark_sharding_with_gradients_is_torch_xlas(ts):
    import torch_xla

    mesh = ts.Mesh(np.arange(4), (4,), ("x",))
    w0 = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    w = w0.to(torch_xla.device()).requires_grad_(True)
    y = ts.mark_sharding_with_gradients(w, mesh, ("x", None))
    assert "devices=[4,1]" in torch_xla._XLAC._get_xla_sharding_spec(y)
    (y.sin() * y).sum().backward()
    plain = w0.clone().requires_grad_(True)
    (plain.sin() * plain).sum().backward()
    assert torch.allclose(w.grad.cpu(), plain.grad, rtol=1e-5)


def test_torch_xla_loader_keeps_a_batch_of_fewer_rows_than_devices_whole(ts):
    """3 rows over 4 devices: torch_xla pads the shards; its global batch is the 3 rows."""
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.distributed.spmd as xs

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    loader = pl.MpDeviceLoader([x], torch_xla.device(),
                               input_sharding=xs.ShardingSpec(xs.Mesh(np.arange(4), (4,), ("data",)), ("data", None)))
    (batch,) = list(loader)
    assert batch.shape == (3, 5) and torch.equal(batch.cpu(), x)
    assert torch_xla._XLAC._get_xla_sharding_spec(batch).startswith("{devices=[4,1]")


def test_torch_xla_cpu_of_a_sharded_result_is_its_whole_value(ts):
    import torch_xla
    import torch_xla.distributed.spmd as xs

    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    t = xs.mark_sharding(x.to(torch_xla.device()), xs.Mesh(np.arange(4), (4,), ("x",)), ("x", None))
    host = t.global_tensor.sin().cpu()
    assert type(host) is torch.Tensor and host.device.type == "cpu" and torch.allclose(host, x.sin())


@pytest.mark.parametrize("case", [c for c in CASES + RANDOM_CASES if len(c[1]) == 4], ids=lambda c: c[0])
def test_torch_xla_local_shards_follow_the_rule(ts, case):
    import torch_xla
    import torch_xla.distributed.spmd as xs
    name, ids, mesh_shape, shape, dims = case
    names = ("a", "b")[:len(mesh_shape)]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    t = xs.mark_sharding(x.to(torch_xla.device()), xs.Mesh(np.array(ids), mesh_shape, names), spec_of(dims, names))
    kinds = set()
    for shard in t.local_shards:
        device = int(shard.shard_device.split(":")[-1])
        kind, indices, padded, replica = expected_shard(ids, mesh_shape, shape, dims, device)
        kinds.add(kind)
        assert shard.replica_id == replica, (name, device, shard.replica_id)
        if indices is None:
            assert shard.indices is Ellipsis and torch.equal(shard.data.cpu(), x)
            continue
        assert [(s.start, s.stop) for s in shard.indices] == indices, (name, device, shard.indices)
        assert tuple(shard.data.shape) == padded, (name, device, shard.data.shape)
        assert torch.equal(shard.unpadded_data.cpu(), x[tuple(slice(a, b) for a, b in indices)])
    assert [t.sharding_type.name] == sorted(kinds), name


def test_torch_xla_manual_shards_are_padded_to_the_tile(ts):
    """The shard shape tests/test_xla_semantics.py expects of torchspmd: ceil(rows / devices)."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    mesh = xs.Mesh(np.arange(4), (4,), ("x",))
    local = xs.enable_manual_sharding(x.to(torch_xla.device()), ("x", None), mesh=mesh)
    assert tuple(local.shape) == (2, 3)
    y = xs.disable_manual_sharding(local.global_tensor.sin() * 2, ("x", None), (7, 3), mesh=mesh)
    assert torch.allclose(y.global_tensor.cpu(), x.sin() * 2, rtol=1e-5)
