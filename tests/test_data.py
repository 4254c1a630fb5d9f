import numpy as np
import pytest
import torch
from _helpers import same_on_every_rank
from torch.utils.data import DataLoader, Dataset, IterableDataset

import torchspmd as ts
from torchspmd.mesh import Mesh


class Counting(Dataset):
    """Map-style dataset that records every index it hands out."""

    def __init__(self, n=20, dict_items=False):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, generator=g)
        self.y = torch.arange(n)
        self.read: list[int] = []
        self.dict_items = dict_items

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.read.append(int(i))
        if self.dict_items:
            return {"x": self.x[i], "y": self.y[i]}
        return self.x[i], self.y[i]


def _in_a_thread(scenario, *args):
    """``scenario(*args)`` with the loader making its batches in a thread of its own, as it
    does for a GPU (on the CPU it makes them at ``next()``)."""
    from torchspmd.engines.native import data

    rule = data.background_thread
    data.background_thread = lambda device: True
    try:
        return scenario(*args)
    finally:
        data.background_thread = rule


def _mesh():
    w = torch.distributed.get_world_size()
    return Mesh(np.arange(w), (w,), ("data",))


def _read_own_rows(batch_size, shuffle, n=20):
    torch.manual_seed(0)
    ds = Counting(n)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=shuffle)
    mesh = _mesh()
    dl = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    out = []
    for x, y in dl:
        out.append((x.full_tensor(), y.full_tensor(), tuple(x.shape), x.to_local().shape[0], ts.get_sharding(y)))
    return ds.read, out, dl.per_process_reading


@pytest.mark.parametrize("world,batch,n", [(2, 6, 20), (2, 7, 20), (4, 8, 20), (4, 7, 21)])
@pytest.mark.parametrize("thread", [False, True], ids=["at next", "in a thread"])
def test_each_rank_reads_only_its_rows(dist, world, batch, n, thread):
    results = dist(world).run(_in_a_thread, _read_own_rows, batch, True, n) if thread else \
        dist(world).run(_read_own_rows, batch, True, n)
    reads = [set(r[0]) for r in results]
    assert all(r[2] for r in results)  # per-process reading was used
    for i in range(world):
        for j in range(i + 1, world):
            assert not reads[i] & reads[j], "two ranks read the same sample"
    assert set().union(*reads) == set(range(n))
    assert sum(len(r[0]) for r in results) == n  # nothing read twice
    # values and order equal the plain loader's global batches
    torch.manual_seed(0)
    ds = Counting(n)
    ref = list(DataLoader(ds, batch_size=batch, shuffle=True))
    for _, out, _ in results:
        assert len(out) == len(ref)
        for (x, y, shape, _, yspec), (rx, ry) in zip(out, ref):
            torch.testing.assert_close(x, rx, rtol=0, atol=0)
            torch.testing.assert_close(y, ry, rtol=0, atol=0)
            assert shape == tuple(rx.shape)
            assert yspec == ("data",)  # 1-D labels beside a 2-D spec: split on the batch dim


def test_odd_last_batch(dist):
    # 20 samples, batch 6: the last batch has 2 rows, one per rank
    results = dist(2).run(_read_own_rows, 6, False)
    for _, out, _ in results:
        assert [o[2][0] for o in out] == [6, 6, 6, 2]
    assert [o[3] for o in results[0][1]] == [3, 3, 3, 1]


def _dict_batches(spec_keys, dict_items=True):
    torch.manual_seed(0)
    ds = Counting(8, dict_items=dict_items)
    loader = DataLoader(ds, batch_size=4)
    mesh = _mesh()
    specs = {k: ts.ShardingSpec(mesh, ("data", None) if k == "x" else ("data",)) for k in spec_keys}
    try:
        batch = next(iter(ts.MpDeviceLoader(loader, ts.device(), input_sharding=specs)))
    except (KeyError, ValueError) as e:
        return type(e).__name__, str(e)
    return {k: (v.full_tensor(), ts.get_sharding(v)) for k, v in batch.items()}


def test_dict_specs(dist):
    res = dist(2).run(_dict_batches, ("x", "y"))[0]
    ds = Counting(8, dict_items=True)
    torch.testing.assert_close(res["x"][0], ds.x[:4])
    assert res["x"][1] == ("data", None) and res["y"][1] == ("data",)


def test_dict_spec_missing_key_is_keyerror(dist):
    kind, msg = same_on_every_rank(dist(2).run(_dict_batches, ("x",)))
    assert kind == "KeyError" and "'y'" in msg


def test_dict_spec_with_non_dict_batch_is_valueerror(dist):
    kind, msg = same_on_every_rank(dist(2).run(_dict_batches, ("x", "y"), False))
    assert kind == "ValueError" and "input_sharding is a dict" in msg


def _iterable_and_replicated():
    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(3):
                yield torch.arange(10.0).reshape(5, 2) + i

    mesh = _mesh()
    sharded = ts.MpDeviceLoader(DataLoader(Stream(), batch_size=None), ts.device(),
                                input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    a = [(b.to_local(), b.full_tensor()) for b in sharded]
    plain = ts.MpDeviceLoader([torch.ones(4, 2)], ts.device())
    b = next(iter(plain))
    return a, sharded.per_process_reading, type(b).__name__


def test_iterable_loader_keeps_each_rank_block(dist):
    results = dist(2).run(_iterable_and_replicated)
    for rank, (batches, per_process, replicated_type) in enumerate(results):
        assert not per_process
        for i, (local, full) in enumerate(batches):
            ref = torch.arange(10.0).reshape(5, 2) + i
            torch.testing.assert_close(full, ref)
            torch.testing.assert_close(local, torch.chunk(ref, 2)[rank])
        assert replicated_type == "Tensor"  # no input_sharding: plain batches on the device


def _rows_per_device(batch_size):
    torch.manual_seed(0)
    loader = DataLoader(Counting(20), batch_size=batch_size)
    dl = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(_mesh(), ("data", None)))
    return [(x.to_local().shape[0], (x.full_tensor(), y.full_tensor())) for x, y in dl]


def test_a_batch_too_small_for_every_device_leaves_some_without_rows(dist):
    # 5 rows over 4 devices split like torch.chunk: 2, 2, 1 and nothing for the last (the
    # global batch is still the loader's, as in torch_xla, which pads the device's shard)
    results = dist(4).run(_rows_per_device, 5)
    whole = [b for b in DataLoader(Counting(20), batch_size=5)]
    for rank, batches in enumerate(results):
        assert [rows for rows, _ in batches] == [[2, 2, 1, 0][rank]] * 4
        for (_, full), expected in zip(batches, whole):
            torch.testing.assert_close(full[0], expected[0])
            torch.testing.assert_close(full[1], expected[1])


def _divergent_seeds():
    torch.manual_seed(torch.distributed.get_rank())
    loader = DataLoader(Counting(20), batch_size=4, shuffle=True)
    try:
        iter(ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(_mesh(), ("data", None))))
    except ts.SpmdError as e:
        return str(e)
    return None


def _split_by_process():
    # a torch_xla multi-host habit: each process samples its part of the data
    from torch.utils.data import DistributedSampler

    ds = Counting(20)
    sampler = DistributedSampler(ds, num_replicas=torch.distributed.get_world_size(),
                                 rank=torch.distributed.get_rank(), shuffle=False)
    try:
        iter(ts.MpDeviceLoader(DataLoader(ds, batch_size=4, sampler=sampler), ts.device(),
                               input_sharding=ts.ShardingSpec(_mesh(), ("data", None))))
    except ts.SpmdError as e:
        return str(e)
    return None


def test_processes_must_draw_the_same_batches(dist):
    msgs = dist(2).run(_divergent_seeds)
    assert all(m and "torch.manual_seed" in m for m in msgs)
    msg = same_on_every_rank(dist(2).run(_split_by_process))
    assert msg and "DistributedSampler" in msg and "minibatch=True" in msg, msg


def _minibatch():
    rank = torch.distributed.get_rank()
    parts = [torch.full((2, 3), float(rank * 10 + i)) for i in range(2)]
    dl = ts.MpDeviceLoader(parts, ts.device(), input_sharding=ts.ShardingSpec(_mesh(), ("data", None), minibatch=True))
    return [b.full_tensor() for b in dl]


def _sized_by_addressable_devices():
    """A program sizing its minibatch=True share by the devices it addresses (torch_xla's per-host
    idiom: 2 rows per device), and the counts."""
    rows = 2 * ts.addressable_runtime_device_count()
    part = torch.randn(rows, 3)
    dl = ts.MpDeviceLoader([part], ts.device(), input_sharding=ts.ShardingSpec(_mesh(), ("data", None), minibatch=True))
    counts = (ts.addressable_runtime_device_count(), ts.addressable_device_count(), ts.local_device_count())
    return counts, [tuple(b.shape) for b in dl]


def test_a_share_sized_by_addressable_devices_is_one_devices(dist):
    """One process per device: each addresses 1 device (not its host's 4), so the global batch is
    2 rows per device, as on torch_xla."""
    for counts, shapes in dist(4).run(_sized_by_addressable_devices):
        assert counts == (1, 1, 4) and shapes == [(8, 3)], (counts, shapes)


def test_minibatch_mode_assembles_global_batches(dist):
    res = dist(2).run(_minibatch)[0]
    torch.testing.assert_close(res[0], torch.cat([torch.full((2, 3), 0.0), torch.full((2, 3), 10.0)]))
    torch.testing.assert_close(res[1], torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 11.0)]))


def _prefetch_workers():
    torch.manual_seed(0)
    ds = Counting(20)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    dl = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(_mesh(), ("data", None)),
                           device_prefetch_size=2)
    return [x.full_tensor() for x, _ in dl]


def test_prefetch_and_workers_keep_order(dist):
    torch.manual_seed(0)
    ref = [x for x, _ in DataLoader(Counting(20), batch_size=4, shuffle=True)]
    for got in (dist(2).run(_prefetch_workers)[0], dist(2).run(_in_a_thread, _prefetch_workers)[0]):
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Failing(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i >= 8:  # the third batch, on every process (each reads its own rows of it)
            raise IndexError("samples from 8 on cannot be read")
        return torch.full((2,), float(i))


def _failing_loader():
    dl = ts.MpDeviceLoader(DataLoader(_Failing(), batch_size=4), ts.device(),
                           input_sharding=ts.ShardingSpec(_mesh(), ("data", None)))
    it, got, errors = iter(dl), [], []
    for _ in range(4):  # two batches, then the error, raised again by the next call
        try:
            got.append(next(it).full_tensor())
        except IndexError as e:
            errors.append(str(e))
    return got, errors


@pytest.mark.parametrize("thread", [False, True], ids=["at next", "in a thread"])
def test_a_dataset_error_reaches_the_program_at_its_batch_and_after(dist, thread):
    got, errors = same_on_every_rank([(torch.stack(g).tolist(), e) for g, e in (
        dist(2).run(_in_a_thread, _failing_loader) if thread else dist(2).run(_failing_loader))])
    assert got == [[[float(i)] * 2 for i in range(4)], [[float(i)] * 2 for i in range(4, 8)]]
    assert len(errors) == 2 and all("samples from 8 on cannot be read" in e for e in errors), errors


class _Ragged(Dataset):
    """Samples of different lengths: (features 5 x L, targets L), L = 3 for the first half
    of each batch of 8 and 4 for the second (so process 0's rows are shorter than 1's)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        n = 3 if i % 8 < 4 else 4
        return torch.randn(5, n, generator=g), torch.randint(0, 5, (n,), generator=g)


def _pad_to_longest(samples):  # a collate_fn padding to the longest row it is given
    n = max(x.shape[1] for x, _ in samples)
    xs = torch.stack([torch.nn.functional.pad(x, (0, n - x.shape[1])) for x, _ in samples])
    ys = torch.stack([torch.nn.functional.pad(y, (0, n - y.shape[0]), value=-100) for _, y in samples])
    return xs, ys


def _rows_of_different_shapes(case):
    mesh = _mesh()
    if case == "minibatch":  # each process's own part: process 1's has 3 rows, 0's 2
        rank = torch.distributed.get_rank()
        parts = [torch.randn(2 + rank, 3), torch.randn(2 + rank, 3)]
        batches = ts.MpDeviceLoader(parts, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None),
                                                                                       minibatch=True))
    else:
        loader = DataLoader(_Ragged(), batch_size=8, collate_fn=_pad_to_longest)
        batches = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None, None)))
    where = "next"
    try:
        for batch in batches:
            if case == "loss":  # the loss reads the batch's counts: checked before it is computed
                where = "loss"
                x, y = batch
                torch.nn.functional.cross_entropy(x, y)
                where = "next"
    except ts.SpmdError as e:
        return where, str(e)
    return where, None


@pytest.mark.parametrize("case", ["loss", "next", "minibatch"])
def test_rows_collated_to_different_shapes_are_an_error_on_every_rank(dist, case):
    # One device, or one process collating the whole batch, would have raised or padded
    # alike; each process collating its own rows must not build a different global shape.
    where, message = same_on_every_rank(dist(2).run(_rows_of_different_shapes, case))
    assert message is not None, "no error"
    # found by the loss of the batch, else when the next batch is taken
    assert where == ("loss" if case == "loss" else "next")
    if case == "minibatch":
        assert message.startswith("MpDeviceLoader: batch 0's tensor number 0 has different numbers of rows on "
                                  "different processes (minibatch=True"), message
    else:
        assert message.startswith("MpDeviceLoader: batch 0's tensor number 0 has different sizes of dim 2 on "
                                  "different processes (sizes averaging 3.5): each process collated only its own "
                                  "rows"), message
        assert "ts.shard_batch(batch, input_sharding)" in message


def _fixed_batch_size(batchdim):
    # time-major batches (sequence, batch): their rows are on dim 1; the last batch has 2 rows
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(5, rows, generator=g) for rows in (3, 3, 2)]
    mesh = _mesh()
    dl = ts.MpDeviceLoader(batches, ts.device(), input_sharding=ts.ShardingSpec(mesh, (None, "data")),
                           batchdim=batchdim, fixed_batch_size=True)
    try:
        return [b.full_tensor() for b in dl]
    except ts.SpmdError as e:
        return str(e)


def test_fixed_batch_size_counts_rows_on_the_batch_dim(dist):
    g = torch.Generator().manual_seed(3)
    want = [torch.randn(5, rows, generator=g) for rows in (3, 3, 2)][:2]  # the odd last batch is dropped
    for got in dist(2).run(_fixed_batch_size, 1) + dist(2).run(_fixed_batch_size, -1) + \
            dist(2).run(_in_a_thread, _fixed_batch_size, 1):
        assert len(got) == 2
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # batchdim 0 sees every batch with 5 rows: nothing dropped
    assert [len(got) for got in dist(2).run(_fixed_batch_size, 0)] == [3, 3]
    message = same_on_every_rank(dist(2).run(_fixed_batch_size, 2))
    assert message == "MpDeviceLoader(batchdim=2): the batch's first tensor has 2 dims (shape (5, 3)); give the " \
                      "dim its rows are on", message


def _batchdim_not_an_int():
    try:
        ts.MpDeviceLoader([torch.ones(2, 2)], ts.device(), batchdim="0")
    except ts.SpmdError as e:
        return str(e)


def test_batchdim_must_be_an_int(dist):
    message = same_on_every_rank(dist(2).run(_batchdim_not_an_int))
    assert message == "MpDeviceLoader(batchdim='0'): give the batch dim as an int (0: the first)", message
