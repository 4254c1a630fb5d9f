"""row_locality: the batch-size half of the automatic path's proof (a symbolic trace of the
local forward), and the table of torch layers row-local by type. The layouts half (DTensor,
no redistribution) and the whole path are tested against one device in
test_auto_replicate.py and test_row_mixing.py."""

import pytest
import sympy
import torch
import torch.nn as nn

from torchspmd.engines.native.global_view.row_locality import batch_size_proof, row_local_layer

pytestmark = pytest.mark.smoke


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x))


def _branch_on_size(h):
    return h * 2 if h.shape[0] > 4 else h


def _branch_on_values(h):
    return h * 2 if h.sum() > 0 else h


@pytest.mark.parametrize("fn,proven", [
    (lambda h: h, True),
    (lambda h: torch.softmax(h, -1) * h, True),
    (lambda h: h.view(h.shape[0], 5, 1).reshape(h.size(0), -1), True),  # the size shapes views only
    (lambda h: h + torch.zeros(5).expand(h.shape[0], 5), True),  # expanded to the batch: a view
    (lambda h: h * h.shape[0], False),  # the batch size as a scale
    (lambda h: h / len(h), False),
    (lambda h: h + torch.arange(h.shape[0])[:, None], False),  # values made from the size
    (lambda h: h + torch.zeros(h.shape[0], 1), False),  # a new tensor of the batch's size (not proven)
    (lambda h: h[: h.shape[0] // 2], False),  # a slice length
    (_branch_on_values, False),  # cannot be traced without values
], ids=["identity", "softmax", "views", "expand", "scale", "len", "arange", "zeros", "slice", "branch-on-values"])
def test_batch_size_proof(fn, proven):
    torch.manual_seed(0)
    proof = batch_size_proof(Lambda(fn), (torch.randn(3, 5),), {}, 3)
    assert (proof.why is None) is proven, proof.why


def test_branches_on_the_size_are_conditions_every_call_must_meet():
    # h.shape[0] > 1 is a branch too (the trace does not assume 2 rows or more): it holds for
    # every batch of 2 rows or more, and a call with a share of 1 row is not covered
    two = batch_size_proof(Lambda(lambda h: h * 2 if h.shape[0] > 1 else h), (torch.randn(3, 5),), {}, 3)
    assert two.why is None and two.conditions and two.holds([2, 3, 100])
    assert not two.holds([1]) and not two.holds([0])
    # torch itself branches on a size of 1 (strides): 1 row is covered where a trace of 1 row,
    # compared operator by operator, computes what the general trace computes at 1 row
    plain = batch_size_proof(Lambda(lambda h: h * 2), (torch.randn(3, 5),), {}, 3)
    assert plain.why is None and plain.holds([2, 100]) and not plain.holds([0])
    assert batch_size_proof(Lambda(lambda h: h * 2), (torch.randn(3, 5),), {}, 3, one_row=True).holds([1, 2, 100])
    for program in (lambda h: h * 2 if h.shape[0] > 1 else h,  # a branch taken otherwise at 1 row
                    lambda h: h.squeeze() + 1):  # the same operator, another shape at 1 row
        assert not batch_size_proof(Lambda(program), (torch.randn(3, 5),), {}, 3, one_row=True).holds([1])
    # h.shape[0] > 4: the trace (at a size of its own) took one branch; calls whose sizes took
    # the other are not covered (the path runs them on DTensor)
    branch = batch_size_proof(Lambda(_branch_on_size), (torch.randn(3, 5),), {}, 3)
    assert branch.why is None and any(c.has(sympy.Integer(4)) for c in branch.conditions)
    assert branch.holds([5, 9]) is not branch.holds([3, 4])


def test_torch_arange_of_the_batch_size_to_pick_each_row():
    # transformers' mask functions: x[torch.arange(b)[:, None], idx] picks row i for row i
    def pick(h):
        idx = torch.arange(h.shape[0])[:, None]
        return h + h[idx, torch.tensor([[0]])]

    assert batch_size_proof(Lambda(pick), (torch.randn(3, 5),), {}, 3).why is None

    def reversed_rows(h):  # the same arange, but reversed: row i reads another row
        return h + h[torch.arange(h.shape[0]).flip(0)]

    assert batch_size_proof(Lambda(reversed_rows), (torch.randn(3, 5),), {}, 3).why is not None


def test_one_row_is_traced_with_a_symbolic_size():
    # traced with 1 row, torch would specialise the size to a constant and hide its use
    assert batch_size_proof(Lambda(lambda h: h * h.shape[0]), (torch.randn(1, 5),), {}, 1).why is not None
    assert batch_size_proof(Lambda(lambda h: h), (torch.randn(0, 5),), {}, 0).why is None


def test_the_trace_leaves_no_trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 5)
    rng = torch.get_rng_state()
    batch_size_proof(model, (x,), {}, 4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_keyword_inputs_and_token_ids():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 4)

        def forward(self, ids, mask=None):
            return self.embed(ids) * mask.unsqueeze(-1)

    ids = torch.randint(0, 11, (2, 6))
    assert batch_size_proof(Tagger(), (ids,), {"mask": torch.ones(2, 6)}, 2).why is None


def test_torch_layers_row_local_by_type():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 4, 8)
    assert row_local_layer(mha, (x, x, x), {})
    assert row_local_layer(mha, (x, x, x), {"attn_mask": torch.zeros(4, 4, dtype=torch.bool)})
    assert not row_local_layer(mha, (x, x, x), {"attn_mask": torch.zeros(6, 4, 4, dtype=torch.bool)})  # heads x batch
    assert not row_local_layer(nn.MultiheadAttention(8, 2), (x, x, x), {})  # sequence first: dim 0 is not the batch
    lstm = nn.LSTM(8, 5, batch_first=True)
    assert row_local_layer(lstm, (x,), {})
    assert not row_local_layer(lstm, (x, (torch.zeros(1, 3, 5), torch.zeros(1, 3, 5))), {})  # a state: batch on dim 1

    class MyAttention(nn.MultiheadAttention):  # a subclass may compute anything
        pass

    assert not row_local_layer(MyAttention(8, 2, batch_first=True), (x, x, x), {})


def test_a_listed_layer_may_use_the_batch_size_inside():
    # nn.LSTM makes its zero initial state of the batch's size: its own, row-local use
    model = nn.Sequential(nn.Linear(5, 8))
    lstm = nn.LSTM(8, 4, batch_first=True)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.lstm = model, lstm

        def forward(self, x):
            return self.lstm(self.lin(x))[0]

    assert batch_size_proof(Net(), (torch.randn(3, 2, 5),), {}, 3).why is None

    class Sub(nn.LSTM):
        pass

    class SubNet(Net):
        def __init__(self):
            super().__init__()
            self.lstm = Sub(8, 4, batch_first=True)

    assert batch_size_proof(SubNet(), (torch.randn(3, 2, 5),), {}, 3).why is not None


class _Gathering(nn.Module):
    """A forward with a collective in it (as an annotation inside forward makes)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        h = self.lin(x)
        torch.distributed.all_reduce(h)
        return h


def _trace_a_forward_with_a_collective():
    import torch.distributed as dist

    rows = 3 - dist.get_rank()  # each process's rows differ in number (an uneven split)
    return batch_size_proof(_Gathering(), (torch.randn(rows, 5),), {}, rows).why


def test_a_collective_is_not_proven_and_not_run():
    # run, the all-reduce would meet the other process with another size (gloo aborts) or not at all
    from _clean import run_clean

    whys = run_clean(_trace_a_forward_with_a_collective, world=2, allow_torchspmd=True)
    assert all(why is not None and "torch.distributed" in why for why in whys), whys
