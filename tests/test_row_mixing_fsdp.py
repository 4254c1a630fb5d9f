"""FSDPv2 gives one device's result for programs whose wrapped model mixes the batch's rows
(issue #57's table): the model computes on this process's rows only where that is proven
(torchspmd/engines/native/global_view/unit_rows.py), else on the global view, and the decision with its
reason is listed (``row_paths``, ``ts.explain``). The oracle is the same program on one plain
process (tests/_row_mixing_programs.py, a clean process); batches of 7 rows: 4 + 3 over 2
processes, 2 + 2 + 2 + 1 over 4."""

import pytest
import torch
from _clean import run_clean
from _row_mixing_programs import ATOL, LAYERS, RTOL, train_each

#: what each refused program's reason names (the operator, or the batch size's use)
NAMED = {
    "amax0": "amax", "amin0": "amin", "abs-amax": "amax", "clamp-max": "aten.max", "topk0": "topk",
    "median0": "median", "argsort": "batch size", "softmax0": "batch size", "cummax0": "cummax",
    "cumsum0": "cumsum", "mean0": "mean.dim", "cumprod0": "cumprod", "argmax-gather": "argmax",
    "nonzero": "nonzero", "masked-select": "masked_select", "unique": "unique", "batch-size": "batch size",
    "arange-rows": "batch size",
}


def _check(got: dict, ref: dict, layers):
    for layer in layers:
        ref_losses, ref_grads, ref_params, _ = ref[layer]
        losses, grads, params, decided = got[layer]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{layer}: {m}")
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{layer} {k}: {m}")
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{layer} {k}: {m}")
        if layer == "row-local":
            assert decided == [None], decided  # proven: this process's rows
        else:
            assert len(decided) == 1 and NAMED[layer] in decided[0], (layer, decided)


@pytest.mark.parametrize("world, strategy, layers", [
    pytest.param(2, "fsdpv2", list(LAYERS), marks=pytest.mark.smoke),
    (4, "fsdpv2-nested", ["row-local", "amax0", "median0", "cummax0", "nonzero", "batch-size", "softmax0"]),
], ids=["whole-model-2", "nested-units-4"])
def test_fsdpv2_gives_one_devices_result(dist, world, strategy, layers):
    ref = run_clean(train_each, layers)
    results = dist(world).run(train_each, layers, strategy)
    for got in results:
        _check(got, ref, layers)
    for got in results[1:]:  # one program: every process decided alike
        assert [got[la][3] for la in layers] == [results[0][la][3] for la in layers]


def test_per_process_semantics_only_by_name(dist):
    # FSDPv2(per_process=True): each process computes its own rows whatever the model does,
    # as FSDP2 and DDP do; the oracle computes the model on each process's share of the rows
    layers = ["amax0", "median0", "batch-size"]
    ref = run_clean(train_each, layers, "blocks:2")
    for got in dist(2).run(train_each, layers, "fsdpv2-per-process"):
        for layer in layers:
            ref_losses, ref_grads, ref_params, _ = ref[layer]
            losses, grads, params, decided = got[layer]
            assert decided == []  # nothing analysed
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
            for k in ref_params:
                torch.testing.assert_close(params[k], ref_params[k], rtol=RTOL, atol=ATOL)
