"""A tensor-parallel pair keeps its activation split only where the forward's code between its
linears is proven to act on each process's features alone (``feature_flow``); everywhere else
the activation is gathered and the result is still one device's. The oracle: each program
trained on one plain process in a clean process."""

import pytest
import torch
from _clean import run_clean
from _pair_programs import BETWEEN, train_all

RTOL, ATOL = 1e-5, 1e-6
NAMES = list(BETWEEN)


@pytest.fixture(scope="module")
def reference():
    return run_clean(train_all, NAMES, 5)


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
def test_a_pair_is_split_exactly_where_proven_and_one_devices_everywhere(dist, reference, shape):
    """Each program under FSDPv2 on ('fsdp', 'model') (5 rows: uneven over 'fsdp' of 2) gives one
    device's losses, gradients and parameters; its pair is split (proven) for the code that
    acts per feature or per head and gathered, with the reason, for the rest."""
    results = dist(shape[0] * shape[1]).run(train_all, NAMES, 5, shape)
    for rank, got in enumerate(results):
        for name in NAMES:
            assert not isinstance(got[name], str), f"rank {rank}, {name}: {got[name]}"
            losses, grads, final, paths = got[name]
            want_losses, want_grads, want_final, _ = reference[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=RTOL, atol=ATOL)
            for k in want_grads:
                torch.testing.assert_close(grads[k], want_grads[k], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=k, name=name: f"{name} grad {k}: {m}")
                torch.testing.assert_close(final[k], want_final[k], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=k, name=name: f"{name} param {k}: {m}")
            (_, pair, why), = paths
            assert pair == "down", paths
            split = BETWEEN[name][1]
            assert (why is None) == split, f"{name}: {why}"
            assert paths == results[0][name][3]  # (every process decides alike)


def test_the_reasons_name_what_cannot_stay_split(dist):
    got = dist(2).run(train_all, ["softmax", "fixed-heads", "returned", "bias"], 4, (1, 2))[0]
    reasons = {name: got[name][3][0][2] for name in got}
    assert "_softmax" in reasons["softmax"] and "works along dim 2" in reasons["softmax"], reasons
    assert "a process's share" in reasons["fixed-heads"], reasons
    assert "an output of the forward" in reasons["returned"], reasons
    assert "whole value of shape (8,)" in reasons["bias"], reasons


def test_explain_lists_each_pair_split_or_gathered(dist):
    from _pair_programs import explained

    split, gathered = dist(2).run(explained, "gelu")[1], dist(2).run(explained, "layernorm")[1]
    assert "Tensor-parallel pairs, per kind of call" in split
    assert "| down" in split.replace("  ", " ") or " down " in split, split
    assert "split (proven)" in split and "gathered whole" not in split, split
    assert "gathered whole: torch.ops.aten.native_layer_norm" in gathered, gathered
