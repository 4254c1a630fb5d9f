import numpy as np
import pytest
import torch
from _helpers import same_on_every_rank

import torchspmd as ts
from torchspmd.mesh import Mesh
from torchspmd.sharding import resolve_partition_spec


def _mesh_2x2():
    # Built in the test process, where no launcher runs: a mesh of 4 devices is checked at
    # use, not at construction (pool workers import this module in worlds of other sizes).
    return Mesh(np.arange(4), (2, 2), ("data", "model"))


# --- partition-spec validation: one rule per test -------------------------------

def test_spec_length_must_equal_rank():
    with pytest.raises(ts.SpmdError, match=r"Partition spec length \(1\) should be equal to the input rank \(2\)"):
        resolve_partition_spec(_mesh_2x2(), ("data",), 2)


def test_unknown_axis_name():
    with pytest.raises(ts.SpmdError, match=r"partition_spec\[1\]: axis name 'fsdp' is not defined"):
        resolve_partition_spec(_mesh_2x2(), (None, "fsdp"), 2)


def test_repeated_axis():
    with pytest.raises(ts.SpmdError, match=r"mesh axis 'data' appears in partition_spec\[0\] and partition_spec\[1\]"):
        resolve_partition_spec(_mesh_2x2(), ("data", ("data", "model")), 2)


def test_axis_index_out_of_range():
    with pytest.raises(ts.SpmdError, match=r"partition_spec\[0\]: mesh axis index 2 is out of range"):
        resolve_partition_spec(_mesh_2x2(), (2, None), 2)


def test_nested_tuples_rejected():
    with pytest.raises(ts.SpmdError, match=r"partition_spec\[0\].*nested tuples"):
        resolve_partition_spec(_mesh_2x2(), ((("data",), "model"), None), 2)


def test_unsupported_entry_type():
    with pytest.raises(ts.SpmdError, match=r"partition_spec\[0\]: spec type float"):
        resolve_partition_spec(_mesh_2x2(), (1.0, None), 2)


def test_tuple_axes_follow_mesh_order():
    with pytest.raises(ts.SpmdError, match=r"partition_spec\[0\] = \('model', 'data'\).*mesh's order"):
        resolve_partition_spec(_mesh_2x2(), (("model", "data"), None), 2)


def test_spec_must_be_a_tuple():
    with pytest.raises(ts.SpmdError, match="one entry per tensor dim"):
        ts.ShardingSpec(_mesh_2x2(), "data")


def test_sharding_spec_checks_at_construction():
    with pytest.raises(ts.SpmdError, match="axis name 'x' is not defined"):
        ts.ShardingSpec(_mesh_2x2(), ("x", None))
    spec = ts.ShardingSpec(_mesh_2x2(), ("data", None))
    assert spec.can_apply(torch.zeros(2, 3)) and not spec.can_apply(torch.zeros(2))


# --- placement: the right block on the right rank --------------------------------

def _expected_block(full, mesh_shape, coord, resolved):
    """Independent reference, XLA's tiling: a dim split over the axes ``axes`` is torch.chunk'ed
    into their product, the device taking the piece at its place along them (C order)."""
    block = full
    for dim, axes in enumerate(resolved):
        if not axes:
            continue
        tiles = int(np.prod([mesh_shape[a] for a in axes]))
        place = int(np.ravel_multi_index([coord[a] for a in axes], [mesh_shape[a] for a in axes]))
        pieces = torch.chunk(block, tiles, dim=dim)
        block = pieces[place] if place < len(pieces) else block.narrow(dim, block.shape[dim], 0)
    return block


def _place(mesh_shape, axis_names, shape, spec):
    import torch.distributed as tdist

    n = int(np.prod(mesh_shape))
    mesh = Mesh(np.arange(n), mesh_shape, axis_names)
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    dt = ts.mark_sharding(full, mesh, spec)
    rank = tdist.get_rank()
    coord = tuple(int(i) for i in np.argwhere(mesh.get_logical_mesh() == rank)[0])
    return dt.to_local(), dt.full_tensor(), tuple(dt.shape), ts.get_sharding(dt), coord


CASES = [
    (1, (1,), ("data",), (3, 5), ("data", None), ("data", None)),
    (2, (2,), ("x",), (5, 3), ("x", None), ("x", None)),
    (2, (2,), ("x",), (4, 3), (None, 0), (None, "x")),
    (2, (2,), ("x",), (4, 3), (None, None), (None, None)),
    (2, (2,), None, (5,), (0,), (0,)),
    (4, (4,), ("x",), (6,), ("x",), ("x",)),
    (4, (2, 2), ("data", "model"), (7, 5), ("data", "model"), ("data", "model")),
    (4, (2, 2), ("data", "model"), (7, 5), (("data", "model"), None), (("data", "model"), None)),
    (4, (2, 2), ("data", "model"), (3, 9), (None, ("data", "model")), (None, ("data", "model"))),
    (4, (2, 2), ("data", "model"), (5, 3), ("model", None), ("model", None)),
    (4, (2, 2), ("data", "model"), (5, 3), (1, 0), ("model", "data")),
    (4, (2, 2), ("data", "model"), (2, 3, 5), (None, None, "data"), (None, None, "data")),
]


@pytest.mark.parametrize("world,mesh_shape,names,shape,spec,spec_back", CASES)
def test_mark_sharding_places_blocks(dist, world, mesh_shape, names, shape, spec, spec_back):
    results = dist(world).run(_place, mesh_shape, names, shape, spec)
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    mesh = Mesh(np.arange(world), mesh_shape, names)
    resolved = resolve_partition_spec(mesh, spec, len(shape))
    covered = torch.zeros(shape)
    for local, gathered, gshape, got_spec, coord in results:
        assert gshape == shape
        torch.testing.assert_close(gathered, full, rtol=0, atol=0)
        expected = _expected_block(full, mesh_shape, coord, resolved)
        assert local.shape == expected.shape, (coord, local.shape, expected.shape)
        torch.testing.assert_close(local, expected, rtol=0, atol=0)
        assert got_spec == spec_back
        covered.view(-1)[local.reshape(-1).long()] = 1
    assert covered.all()  # every element is held by some device


def _layout_changes():
    mesh = Mesh(np.arange(2), (2,), ("x",))
    t = torch.arange(12.0).reshape(4, 3)
    a = ts.mark_sharding(t, mesh, ("x", None))
    b = ts.mark_sharding(a, mesh, (None, "x"))  # re-mark: re-laid out
    plain = ts.clear_sharding(b)
    # a non-leaf tensor stays differentiable through mark_sharding
    w = torch.ones(4, 3, requires_grad=True)
    y = ts.mark_sharding(w * 3.0, mesh, ("x", None))
    y.sum().backward()
    p = torch.nn.Parameter(torch.randn(4, 3))
    q = ts.mark_sharding(p, mesh, (None, "x"))
    lin = torch.nn.Linear(3, 4)
    ts.mark_sharding(lin.weight, mesh, ("x", None))  # in place, as torch_xla: the module holds it sharded
    return (b.to_local(), type(plain).__name__, torch.equal(plain, t), w.grad,
            isinstance(q, torch.nn.Parameter) and isinstance(q, torch.distributed.tensor.DTensor),
            ts.get_sharding(lin.weight) == ("x", None), ts.get_sharding(t))


def _clear_in_place():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 5)
    whole = lin.weight.detach().clone()
    ts.mark_sharding(lin.weight, Mesh(np.arange(4), (4,), ("x",)), ("x", None))
    back = ts.clear_sharding(lin.weight)
    cleared = (back is lin.weight, isinstance(lin.weight, torch.nn.Parameter),
               isinstance(lin.weight, torch.distributed.tensor.DTensor), torch.equal(lin.weight.detach(), whole),
               ts.get_sharding(lin.weight))
    # as torch_xla: the cleared parameter can be annotated again, on another mesh
    ts.mark_sharding(lin.weight, Mesh(np.arange(4), (2, 2), ("a", "b")), (None, "b"))
    return cleared, ts.get_sharding(lin.weight)


def test_clear_sharding_clears_a_parameter_in_place(dist):
    for cleared, remarked in dist(4).run(_clear_in_place):
        assert cleared == (True, True, False, True, None) and remarked == (None, "b")


def _mark_again_on_another_mesh():
    lin = torch.nn.Linear(3, 4)
    ts.mark_sharding(lin.weight, Mesh(np.arange(4), (4,), ("x",)), ("x", None))
    try:
        ts.mark_sharding(lin.weight, Mesh(np.arange(4), (2, 2), ("a", "b")), (None, "b"))
    except RuntimeError as e:  # (torch_xla's test_annotate_custom_sharding catches RuntimeError)
        return type(e).__name__, isinstance(e, ts.SpmdError), isinstance(e, AssertionError), str(e), \
            ts.get_sharding(lin.weight)
    return None


def test_marking_a_sharded_tensor_on_another_mesh_is_a_runtime_error_as_on_torch_xla(dist):
    """torch_xla refuses to re-shard a sharded tensor (RuntimeError) until clear_sharding: the same
    error on every process, a RuntimeError as well as an SpmdError, the first layout kept."""
    for got in dist(4).run(_mark_again_on_another_mesh):
        name, spmd, asserting, text, kept = got
        assert (name, spmd, asserting, kept) == ("ShardingStateError", True, True, ("x", None)), got
        assert "call clear_sharding(t) first" in text, text


_WRITES = {  # label-masking idioms on a batch split over its rows
    "y[:, -1] = -100": lambda y: y.__setitem__((slice(None), -1), -100),
    "y[0] = -100": lambda y: y.__setitem__(0, -100),
    "y[y == 5] = -100": lambda y: y.__setitem__(y == 5, -100),
    "y[1:, 1:] = 0": lambda y: y.__setitem__((slice(1, None), slice(1, None)), 0),
    "y[2:5, 0] = tensor(-1)": lambda y: y.__setitem__((slice(2, 5), 0), torch.tensor(-1)),
    "y[::2] = 7": lambda y: y.__setitem__(slice(None, None, 2), 7),
    "y[[0, 6]] = 3": lambda y: y.__setitem__([0, 6], 3),
    "y[1] = arange(3)": lambda y: y.__setitem__(1, torch.arange(3)),
    "y[1:3] += 1": lambda y: y.__setitem__(slice(1, 3), y[1:3].__iadd__(1)),
    "y[:, -1].fill_(-100)": lambda y: y[:, -1].fill_(-100),  # a view that keeps the rows: written in place
    # parts that cut the rows: copies on each device, written through into the rows
    "y[0].fill_(-100)": lambda y: y[0].fill_(-100),
    "y[2:5].zero_()": lambda y: y[2:5].zero_(),
    "y[2:5][:, 0].fill_(-1)": lambda y: y[2:5][:, 0].fill_(-1),
    "y.split(3)[1].mul_(2)": lambda y: y.split(3)[1].mul_(2),
    "y.narrow(0, 1, 5).t()[1].copy_(...)": lambda y: y.narrow(0, 1, 5).t()[1].copy_(torch.arange(5)),
    # flattening 7 rows split over the devices: no torch.chunk layout, gathered (a copy)
    "y.view(-1).masked_fill_(...)": lambda y: y.view(-1).masked_fill_(torch.arange(21) % 4 == 1, -7),
}


def _writes_into_a_sharded_batch():
    from torchspmd import SpmdError

    n = ts.global_runtime_device_count()
    mesh = Mesh(np.arange(n), (n,), ("data",))
    ref = torch.randint(0, 10, (7, 3), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, write in _WRITES.items():
        y, one = ts.mark_sharding(ref.clone(), mesh, ("data", None)), ref.clone()
        write(y)
        write(one)  # one device: plain torch
        results[name] = (torch.equal(y.full_tensor(), one), ts.get_sharding(y))
    # a write into such a part while autograd records it is refused
    w = ts.mark_sharding(torch.randn(7, 3, generator=torch.Generator().manual_seed(1)), mesh, ("data", None))
    w.requires_grad_(True)
    h = w * 2
    try:
        h[0].mul_(3)
        refused = None
    except SpmdError as e:
        refused = str(e)
    return results, refused


@pytest.mark.parametrize("world", [2, 4])
def test_writes_into_a_sharded_batch_are_one_devices(dist, world):
    # y[0] of a batch split over its rows is a copy (DTensor gathers it); an in-place write into
    # it was lost silently, and assignments of a Python scalar failed (no rule for fill_.Tensor)
    for results, refused in dist(world).run(_writes_into_a_sharded_batch):
        assert results == {name: (True, ("data", None)) for name in _WRITES}, results
        assert refused is not None and "while autograd records it" in refused and "masked_fill_" in refused


def _repeated_views():
    from torchspmd.engines.native.global_view import exact_ops

    n = ts.global_runtime_device_count()
    mesh = Mesh(np.arange(n), (n,), ("data",))
    g = torch.Generator().manual_seed(3)
    full, weight = torch.randn(8, 6, 5, generator=g), torch.randn(48, 5, generator=g)
    results = []
    for _ in range(3):  # the first call of each view is DTensor's; the later ones reuse its layout
        x = ts.mark_sharding(full.clone(), mesh, ("data", None, None)).requires_grad_(True)
        flat, rows = x.view(-1, 5), x.reshape(8, 30)
        ((flat * weight).sum() + (rows * rows).sum()).backward()
        results.append((torch.equal(flat.full_tensor(), full.view(-1, 5)), torch.equal(rows.full_tensor(), full.reshape(8, 30)),
                        ts.get_sharding(flat), ts.get_sharding(rows), x.grad.full_tensor()))
    kept = any(key[1].placements == x._spec.placements and key[2] == (-1, 5) for key in exact_ops._VIEWS)
    return results, kept


@pytest.mark.parametrize("world", [2, 4])
def test_repeated_views_of_a_split_batch_keep_values_layouts_and_gradients(dist, world):
    # A view made again on the same layout is made locally with the layout the first call
    # got from DTensor (exact_ops._view): the same values, layout and gradient every time.
    g = torch.Generator().manual_seed(3)
    full, weight = torch.randn(8, 6, 5, generator=g), torch.randn(48, 5, generator=g)
    x = full.clone().requires_grad_(True)
    ((x.view(-1, 5) * weight).sum() + (x.reshape(8, 30) ** 2).sum()).backward()
    for results, kept in dist(world).run(_repeated_views):
        assert kept, "the view's layout was not kept for the next call"
        for same_flat, same_rows, flat_spec, rows_spec, grad in results:
            assert same_flat and same_rows
            assert flat_spec == ("data", None) and rows_spec == ("data", None)
            torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=1e-6)


def test_remark_clear_autograd_and_parameters(dist):
    results = dist(2).run(_layout_changes)
    t = torch.arange(12.0).reshape(4, 3)
    for rank, (local, plain_type, same, wgrad, is_param, recorded, plain_spec) in enumerate(results):
        torch.testing.assert_close(local, torch.chunk(t, 2, dim=1)[rank])
        assert plain_type == "Tensor" and same
        torch.testing.assert_close(wgrad, torch.full((4, 3), 3.0))
        assert is_param and recorded
        assert plain_spec is None


def _mark_errors():
    mesh = Mesh(np.arange(2), (2,), ("x",))
    out = []
    for spec in [("x",), ("y", None)]:
        try:
            ts.mark_sharding(torch.zeros(2, 2), mesh, spec)
        except ts.SpmdError as e:
            out.append(str(e))
    return out


def test_mark_sharding_errors_name_the_culprit(dist):
    msgs = same_on_every_rank(dist(2).run(_mark_errors))
    assert "Partition spec length (1) should be equal to the input rank (2)" in msgs[0]
    assert "axis name 'y' is not defined" in msgs[1]


def _visualize(spec):
    from rich.console import Console

    mesh = Mesh(np.arange(4), (2, 2), ("data", "model"))
    dt = ts.mark_sharding(torch.zeros(4, 6), mesh, spec)
    table = ts.visualize_sharding(dt, use_color=False)
    console = Console(record=True, width=60)
    console.print(table)
    return console.export_text()


def test_visualize_sharding_shows_device_blocks(dist):
    text = dist(4).run(_visualize, ("data", "model"))[0]
    lines = [l for l in text.splitlines() if "CPU" in l]
    assert len(lines) == 2
    assert lines[0].index("CPU 0") < lines[0].index("CPU 1")
    assert lines[1].index("CPU 2") < lines[1].index("CPU 3")
    text = dist(4).run(_visualize, ("data", None))[0]
    lines = [l for l in text.splitlines() if "CPU" in l]
    assert "CPU 0,1" in lines[0] and "CPU 2,3" in lines[1]


def _visualize_text(texts):
    from rich.console import Console

    out = []
    for text in texts:
        try:
            table = ts.visualize_sharding(text, use_color=False)
        except ts.SpmdError as e:
            out.append(str(e))
            continue
        console = Console(record=True, width=60)
        console.print(table)
        out.append([l.replace("│", "|").split("|")[1:-1] for l in console.export_text().splitlines() if "CPU" in l])
    return out


def test_visualize_sharding_of_an_hlo_text_as_torch_xla_takes_it(dist):
    got = same_on_every_rank(dist(4).run(_visualize_text, [
        "{devices=[2,2]0,1,2,3}", "{devices=[4]3,2,1,0}", "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}",
        "{replicated}", "", "{devices=[2,2]0,1,2}", "mesh"]))
    cells = [[[c.strip() for c in row] for row in table] for table in got[:5]]
    assert cells[0] == [["CPU 0", "CPU 1"], ["CPU 2", "CPU 3"]]
    assert cells[1] == [["CPU 3", "CPU 2", "CPU 1", "CPU 0"]]  # a 1-D layout: one row
    assert cells[2] == [["CPU 0,2"], ["CPU 1,3"]]  # each tile's copies in one cell
    assert cells[3] == cells[4] == [["CPU 0,1,2,3"]]
    assert got[5].startswith("visualize_sharding('{devices=[2,2]0,1,2}'): 3 device ids for tile dims [2, 2]")
    assert got[6].startswith("visualize_sharding('mesh'): not a sharding text; give a tensor, or a sharding text")
