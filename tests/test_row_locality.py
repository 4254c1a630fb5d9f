"""row_locality.probe: whether a module computes each row from that row alone, and that
probing leaves no trace (buffers, the random stream)."""

import pytest
import torch
import torch.nn as nn

from torchspmd.engines.native.row_locality import probe


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x))


@pytest.mark.parametrize("fn,expected", [
    (lambda h: h, True),
    (lambda h: torch.softmax(h, -1) * h, True),
    (lambda h: h - h.mean(0), False),  # every row depends on all rows
    (lambda h: h + h.amax(0), False),  # the same: an exact statistic, unchanged by reordering the rows
    (lambda h: h.cumsum(0), False),  # later rows depend on earlier ones only
    (lambda h: h.flip(0).cumsum(0).flip(0), False),  # earlier rows depend on later ones only
    (lambda h: h.sum(), False),  # no rows in the output
    (lambda h: (h, h.sum(0)), False),  # one output without the batch on dim 0
    (lambda h: h.reshape(-1), False),  # the rows merged: dim 0 is no longer the batch
], ids=["identity", "softmax", "mean-over-batch", "max-over-batch", "cumsum", "reverse-cumsum", "scalar", "pair", "flat"])
@pytest.mark.parametrize("rows", [1, 3])
def test_probe_tells_row_local_from_row_mixing(fn, expected, rows):
    torch.manual_seed(0)
    assert probe(Lambda(fn), (torch.randn(rows, 5),), {}, rows) is expected


def test_probe_leaves_buffers_and_the_random_stream_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 5)
    rng = torch.get_rng_state()
    assert probe(model, (x,), {}, 4) is False  # batch statistics mix the rows
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    model.eval()  # running statistics and no dropout: each row on its own
    assert probe(model, (x,), {}, 4) is True
    model.train()
    model[1].eval()  # dropout drawn per call: the same masks in the probe's runs
    assert probe(model, (x,), {}, 4) is True


def test_probe_changes_token_ids_within_their_range_and_reads_keyword_inputs():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 4)

        def forward(self, ids, mask=None):
            return self.embed(ids) * mask.unsqueeze(-1)

    ids = torch.randint(0, 11, (1, 6))
    mask = torch.ones(1, 6)
    assert probe(Tagger(), (ids,), {"mask": mask}, 1) is True


def test_probe_without_anything_to_change_decides_nothing():
    # one row of one token: nothing can be changed, so there is no evidence
    assert probe(nn.Embedding(5, 3), (torch.tensor([[2]]),), {}, 1) is False


class _Gathering(nn.Module):
    """A forward with a collective in it (as an annotation inside forward makes)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.reached = False

    def forward(self, x):
        h = self.lin(x)
        torch.distributed.all_reduce(h)
        self.reached = True
        return h


def _probe_a_forward_with_a_collective():
    import torch.distributed as dist

    rows = 3 - dist.get_rank()  # each process's rows differ in number (an uneven split)
    model = _Gathering()
    decided = probe(model, (torch.randn(rows, 5),), {}, rows)
    return decided, model.reached


def test_probe_refuses_a_collective_before_it_starts():
    # run, the all-reduce would meet the other process with another size (gloo aborts) or not
    # at all; refused, every process decides "not row-local" and goes on
    from _clean import run_clean

    assert run_clean(_probe_a_forward_with_a_collective, world=2, allow_torchspmd=True) == [(False, False)] * 2
