import numpy as np
import pytest
from _helpers import same_on_every_rank

import torchspmd as ts
from torchspmd.mesh import Mesh

# --- validation: one rule per test, error type and culprit in the message ----------

def test_axis_names_length_must_match_shape():
    with pytest.raises(ts.SpmdError, match=r"axis_names=\('a',\).*one name per axis"):
        Mesh(np.arange(4), (2, 2), ("a",))


def test_axis_names_unique():
    with pytest.raises(ts.SpmdError, match=r"Axis names must be unique, got: \('x', 'x'\): .* repeats 'x'"):
        Mesh(np.arange(4), (2, 2), ("x", "x"))


def test_shape_product_must_equal_device_count():
    with pytest.raises(ts.SpmdError, match=r"Number of device IDs \(3\) must match mesh size \(4\): .*3 device_ids do not fill mesh_shape \(2, 2\)"):
        Mesh(np.arange(3), (2, 2))


def test_device_ids_unique():
    with pytest.raises(ts.SpmdError, match=r"Device IDs must be unique, got: \[0 1 1 2\]: .* lists device 1 more than once"):
        Mesh([0, 1, 1, 2], (4,))


def test_device_ids_in_range():
    with pytest.raises(ts.SpmdError, match=r"Device IDs must be less than mesh size \(4\), got: \[0 1 2 7\]: .*device id 7 is out of range"):
        Mesh([0, 1, 2, 7], (2, 2))


def test_errors_are_torch_xla_compatible():
    # torch_xla reports these with assert; code catching AssertionError keeps working.
    with pytest.raises(AssertionError):
        Mesh(np.arange(3), (2, 2))
    with pytest.raises(ValueError):
        Mesh(np.arange(3), (2, 2))


def test_accessors():
    mesh = Mesh(np.arange(8), (4, 2), ("data", "model"))
    assert mesh.size() == 8
    assert list(mesh.shape().items()) == [("data", 4), ("model", 2)]
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.get_axis_name_idx("model") == 1
    assert mesh.get_axis_name_idx("nope") is None
    unnamed = Mesh(np.array([3, 2, 1, 0]), (2, 2))
    assert list(unnamed.shape().items()) == [(0, 2), (1, 2)]
    assert unnamed.get_logical_mesh().tolist() == [[3, 2], [1, 0]]


def test_api_needs_use_spmd_first():
    mesh = Mesh(np.arange(1), (1,), ("data",))
    with pytest.raises(ts.SpmdError, match=r"call torchspmd.use_spmd\(\)"):
        mesh.device_mesh
    import torch

    with pytest.raises(ts.SpmdError, match=r"mark_sharding needs SPMD mode"):
        ts.mark_sharding(torch.zeros(2), mesh, ("data",))


# --- multi-rank ----------------------------------------------------------------

def _mesh_over_wrong_count(ids):
    try:
        Mesh(np.arange(ids), (ids,), ("fsdp",))  # refused where it is built, as torch_xla does
    except ts.SpmdError as e:
        assert isinstance(e, AssertionError)
        return str(e)
    return None


@pytest.mark.parametrize("ids", [2, 5])
def test_mesh_size_must_match_world(dist, ids):
    msgs = dist(4).run(_mesh_over_wrong_count, ids)
    assert msgs[0] is not None and msgs == [msgs[0]] * 4  # the same error on every rank
    assert f"Number of device IDs ({ids}) must match the global number of devices (4)" in msgs[0]


def _hybrid(local_world, ici, dcn):
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    try:
        m = ts.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=("a", "b"))
        return m.get_logical_mesh().tolist()
    except ts.SpmdError as e:
        return str(e)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"]


def test_hybrid_mesh_maps_dcn_axes_across_hosts(dist):
    pool = dist(4)
    # two hosts of two devices: hosts tile the first axis...
    assert pool.run(_hybrid, 2, (1, 2), (2, 1))[0] == [[0, 1], [2, 3]]
    # ...or the second one
    assert pool.run(_hybrid, 2, (2, 1), (1, 2))[0] == [[0, 2], [1, 3]]
    # one host: ici alone
    assert pool.run(_hybrid, 4, (2, 2), None)[0] == [[0, 1], [2, 3]]
    msg = same_on_every_rank(pool.run(_hybrid, 4, (1, 2), (2, 1)))
    assert "dcn_mesh_shape=(2, 1)" in msg and "1 host(s)" in msg


def _one_d():
    m = ts.get_1d_mesh("data")
    ts.set_global_mesh(m)
    return m.mesh_shape, m.axis_names, ts.get_global_mesh() is m


def test_get_1d_mesh_and_global_mesh(dist):
    assert dist(2).run(_one_d) == [((2,), ("data",), True)] * 2


def _annotate_and_drop():
    import warnings

    import torch

    mesh = Mesh(np.arange(2), (2,), ("data",))
    t = torch.randn(6, 3)
    with warnings.catch_warnings(record=True) as dropped:
        warnings.simplefilter("always")
        ts.mark_sharding(t, mesh, ("data", None))  # the result dropped: t cannot become the DTensor
    with warnings.catch_warnings(record=True) as kept:
        warnings.simplefilter("always")
        u = ts.mark_sharding(t, mesh, ("data", None))
    said = [str(w.message) for w in dropped if "mark_sharding" in str(w.message)]
    return (len(said), type(t).__name__, type(u).__name__, [str(w.message) for w in kept],
            dropped[0].filename if dropped else None)


def test_a_dropped_annotation_of_a_plain_tensor_warns(dist):
    n, t_type, u_type, kept, where = same_on_every_rank(dist(2).run(_annotate_and_drop))
    assert (n, t_type, u_type, kept) == (1, "Tensor", "DTensor", []), (n, t_type, u_type, kept)
    assert where == __file__  # the warning points at the program's line


def _compare_across_layouts():
    import torch

    mesh = Mesh(np.arange(2), (2,), ("d",))
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    rows, cols = ts.mark_sharding(x.clone(), mesh, ("d", None)), ts.mark_sharding(x.clone(), mesh, (None, "d"))
    near = x + 1e-7 * torch.randn(5, 3)
    return [torch.allclose(rows, cols), torch.equal(rows, cols), torch.allclose(rows, cols + 1),
            torch.allclose(rows, ts.mark_sharding(near, mesh, (None, "d"))), torch.equal(rows, x),
            torch.allclose(x, near), torch.equal(x, near)]


def test_allclose_and_equal_compare_whole_values_across_layouts(dist):
    got = same_on_every_rank(dist(2).run(_compare_across_layouts))
    # the last two are plain PyTorch's answers for the same whole values
    assert got == [True, True, False, got[-2], True, got[-2], got[-1]] and got[-2] is True and got[-1] is False


def _relayout_in_place():
    import torch

    mesh = Mesh(np.arange(2), (2,), ("d",))
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    t = ts.mark_sharding(x.clone(), mesh, ("d", None))
    kept = ts.mark_sharding(t, mesh, (None, "d"))  # the result used: t stays as it was
    before = [str(p) for p in t.placements], [str(p) for p in kept.placements]
    ts.mark_sharding(t, mesh, (None, "d"))  # dropped: t itself is re-laid out, as on torch_xla
    return before, [str(p) for p in t.placements], torch.equal(t.full_tensor(), x)


def test_a_sharded_tensor_marked_again_with_the_result_dropped_changes_in_place(dist):
    before, after, same = same_on_every_rank(dist(2).run(_relayout_in_place))
    assert before == (["S(0)"], ["S(1)"]) and after == ["S(1)"] and same


def _meshes_built_again():
    import os

    import torch

    def threads():
        return len(os.listdir("/proc/self/task"))

    def use(names):
        mesh = ts.Mesh(np.arange(4), (2, 2), names)
        t = ts.mark_sharding(torch.randn(6, 5), mesh, (names[0], names[1]))
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).shape

    use(("p", "q"))
    first = threads()
    for _ in range(5):  # the same mesh again: its process groups again
        use(("p", "q"))
    again = threads()
    use(("r", "s"))  # another mesh (other axis names): groups of its own
    return first, again, threads()


def test_the_same_mesh_built_again_reuses_its_process_groups(dist):
    # A program that builds its Mesh in a function it calls each step: no new process groups (each
    # gloo group holds threads for as long as the process runs: 141 leaked groups per process made
    # the test suite's pools run hundreds of threads)
    for first, again, other in dist(4).run(_meshes_built_again):  # (rank 0 runs the store's thread too)
        assert again == first
        assert other > first  # (the count sees new groups)
