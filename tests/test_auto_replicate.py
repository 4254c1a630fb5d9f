"""The automatic data-parallel path: a program without a wrapper (the seed's Pattern 1)
computes locally with DDP's reducer once its forward is found row-local, and stays
exact. The oracle is the same program on one device, in a clean process that never imports
torchspmd (tests/_auto_replicate_programs.py, tests/_clean.py)."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _auto_replicate_programs import (
    ATOL,
    RTOL,
    VOCAB,
    Net,
    data,
    decoder,
    ignored_targets,
    optimizer_steps_reference,
    run,
)
from _clean import run_clean

import torchspmd as ts


def _check(results, ref, atol=ATOL):
    ref_losses, ref_grads, ref_state, _ = ref
    for losses, grads, state, _ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=atol)
        assert losses == results[0][0]  # loss.item() is the same global value on every process
        assert len(grads) == len(ref_grads)
        for g, rg in zip(grads, ref_grads):
            assert g.keys() == rg.keys()
            for k in rg:
                torch.testing.assert_close(g[k], rg[k], rtol=RTOL, atol=atol)
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=atol)


# Batches of 8 rows split evenly over 2 and 4 processes, then a last batch of 7 (uneven).
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["net", "decoder"])
def test_fast_path_exact_with_uneven_last_batch(dist, world, kind):
    ref = run_clean(run, kind, 8 * 3 + 7, 8)
    results = dist(world).run(run, kind, 8 * 3 + 7, 8, spmd=True)
    _check(results, ref)
    assert all(r[3] == [True] for r in results)  # the local path was taken


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wrap", [False, True], ids=["auto", "replicate"])
def test_gradient_accumulation_exact(dist, world, wrap):
    # Two backward passes per optimizer step: DDP's reducer alone would count the first
    # pass's (already reduced) gradient once per process.
    ref = run_clean(run, "net", 8 * 4, 8, accumulate=2)
    results = dist(world).run(run, "net", 8 * 4, 8, accumulate=2, spmd=True, wrap=wrap)
    _check(results, ref)
    if not wrap:
        assert all(r[3] == [True] for r in results)


@pytest.mark.parametrize("world", [2, 4])
def test_row_local_in_a_layout_dtensor_cannot_express_takes_the_path(dist, world):
    # The seed's decoder: nn.MultiheadAttention returns its weights through a (sequence *
    # batch) view, where DTensor gathers the batch: listed as row-local by its type
    # (row_locality.ROW_LOCAL_LAYERS), so the local path, exact, with a last batch of 7 rows (uneven).
    ref = run_clean(run, "seed-decoder", 8 * 2 + 7, 8)
    results = dist(world).run(run, "seed-decoder", 8 * 2 + 7, 8, spmd=True)
    _check(results, ref)
    assert all(r[3] == [True] for r in results)


def _recurrent(auto: bool):
    previous = ts.set_auto_replicate(auto)
    try:
        return run("recurrent", 8 * 2 + 7, 8, spmd=True)
    finally:
        ts.set_auto_replicate(previous)


@pytest.mark.parametrize("world,auto", [(2, True), (4, True), (2, False)], ids=["2-path", "4-path", "2-dtensor"])
def test_recurrent_layers_run_through_dtensor_and_take_the_path(dist, world, auto):
    # nn.LSTM / nn.GRU: on CPU a oneDNN op DTensor has no rule for, so the global view runs
    # them decomposed; the first call regathers the batch (time-major inside); they are
    # row-local by their type, and later calls compute locally. Without the path: DTensor, exact.
    ref = run_clean(run, "recurrent", 8 * 2 + 7, 8)
    results = dist(world).run(_recurrent, auto)
    # atol 1e-5: one device runs oneDNN's fused layers, the DTensor calls their decomposition
    # (another summation order, carried through the time steps: 4.6e-6 apart on one gradient
    # element of 360, measured)
    _check(results, ref, atol=1e-5)
    assert all(r[3] == ([True] if auto else []) for r in results)


def test_annotated_parameter_keeps_the_sharded_path(dist):
    ref = run_clean(run, "net", 8 * 3, 8)
    results = dist(2).run(run, "net", 8 * 3, 8, spmd=True, annotate=True)
    _check(results, ref)
    assert all(r[3] == [] for r in results)  # never considered: a parameter is sharded


@pytest.mark.parametrize("net_kwargs,expected", [
    ({"norm": True}, [False]),  # BatchNorm mixes rows: stays on DTensor
    ({"inner_loss": True}, [False]),  # a global loss returned by forward: stays on DTensor
    ({"unused": True}, [True]),  # a parameter no forward uses: DDP told to look for it
    ({"norm": "eval"}, [True]),  # BatchNorm with running statistics: each row on its own
    ({"cumsum": True}, [False]),  # later rows depend on earlier ones: DTensor regathers: not proven
], ids=["batchnorm", "inner-loss", "unused-parameter", "batchnorm-eval", "cumsum"])
def test_decision_follows_the_program(dist, net_kwargs, expected):
    ref = run_clean(run, "net", 8 * 3, 8, net_kwargs=net_kwargs)
    results = dist(2).run(run, "net", 8 * 3, 8, spmd=True, net_kwargs=net_kwargs)
    _check(results, ref)
    assert all(r[3] == expected for r in results)


def test_evaluation_before_training(dist):
    # An evaluation call (no gradients) is its own kind of call; training after it is
    # checked on its own and still exact.
    ref = run_clean(run, "net", 8 * 3, 8, eval_first=True)
    results = dist(2).run(run, "net", 8 * 3, 8, spmd=True, eval_first=True)
    _check(results, ref)
    assert all(sorted(r[3]) == [True, True] for r in results)


def test_a_call_that_raised_leaves_the_path_to_the_next_calls(dist):
    # torch calls a global always-called forward hook without keyword arguments after a
    # forward raised: the path's hook must still close the call (no warning), and the
    # next calls are checked and take the local path as if the failed call had not been.
    ref = run_clean(run, "net", 8 * 3, 8, raise_first=True)
    results = dist(2).run(run, "net", 8 * 3, 8, spmd=True, raise_first=True)
    _check(results, ref)
    assert all(r[3] == [True] for r in results)


def _switch_off():
    previous = ts.set_auto_replicate(False)
    try:
        return run("net", 8 * 3, 8, spmd=True)
    finally:
        ts.set_auto_replicate(previous)


def test_switched_off_stays_on_dtensor(dist):
    ref = run_clean(run, "net", 8 * 3, 8)
    results = dist(2).run(_switch_off)
    _check(results, ref)
    assert all(r[3] == [] for r in results)


def _switched_off_by_the_environment():
    os.environ["TORCHSPMD_AUTO_REPLICATE"] = "0"  # (the pool undoes it after the task)
    return run("net", 8 * 3, 8, spmd=True)


def test_the_environment_switch_is_read_when_the_path_is_asked(dist):
    # These workers imported torchspmd before the variable was set, as a forked worker of
    # `torchspmd run` did in its launcher before its program set it: still off.
    ref = run_clean(run, "net", 8 * 3, 8)
    results = dist(2).run(_switched_off_by_the_environment)
    _check(results, ref)
    assert all(r[3] == [] for r in results)


def _optimizer_steps(spmd: bool):
    """An Adam step on plain parameters, a step with a closure, a step that raises; with
    spmd, count the global-view mode's calls during each and report whether it is still
    the innermost mode after the failed step."""
    from torchspmd.engines.native.start import global_mode
    from torchspmd.engines.native.global_view import implicit_replication as gv

    torch.manual_seed(0)
    model = Net()
    x, y = data("net", 8)
    if spmd:
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        spec = ts.ShardingSpec(mesh, ("data", None))
        x, y = next(iter(ts.MpDeviceLoader([(x, y)], ts.device(), input_sharding=spec)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    calls = []
    original = gv._ReplicateUnannotated.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return original(self, func, types, args, kwargs)

    gv._ReplicateUnannotated.__torch_function__ = counting
    try:
        F.cross_entropy(model(x), y).backward()
        calls.clear()
        opt.step()
        plain = [str(f) for f in calls if "profiler" not in str(f)]  # (torch's hook records the step)

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        calls.clear()
        loss = opt.step(closure).item()
        with_closure = len(calls)

        class Failing(torch.optim.SGD):
            def step(self, closure=None):
                raise RuntimeError("step failed 0.41")

        failing = Failing(model.parameters(), lr=0.1)
        try:
            failing.step()
        except RuntimeError:
            pass
        innermost = torch.overrides._get_current_function_mode()
        mode_kept = innermost is global_mode.mode()
        loss_after = F.cross_entropy(model(x), y).item()
    finally:
        gv._ReplicateUnannotated.__torch_function__ = original
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return plain, with_closure, mode_kept, [loss, loss_after], state


def test_optimizer_step_on_plain_parameters_leaves_the_global_view_aside(dist):
    # A data-parallel program's optimizer sees only plain tensors: its step runs without the
    # global view's per-operation Python call (as under DDP). A step with a closure (the
    # program's forward on global batches) keeps it, and a step that raises leaves it in place.
    ref_losses, ref_state = run_clean(optimizer_steps_reference)
    results = dist(2).run(_optimizer_steps, True)
    for plain, with_closure, mode_kept, losses, state in results:
        assert plain == [], plain
        assert with_closure > 0, with_closure
        assert mode_kept
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world,whole", [(2, False), (4, False), (2, True)], ids=["2", "4", "2-whole-batches"])
def test_ignored_targets_need_no_blocking_collective(dist, world, whole):
    # The count a mean cross-entropy divides by comes from the loader (reduced while the
    # forward runs, or counted by each process when every process reads whole batches) and
    # loss.item() from a reduction started at the backward pass: the loss and item() block
    # on no collective, and everything still equals one device's run (batches of 8 rows,
    # then 7: uneven).
    rows = 8 * 3 + 7
    ref = run_clean(ignored_targets, False, rows, 8)
    results = dist(world).run(ignored_targets, True, rows, 8, whole=whole)
    _check([(*r[:3], None) for r in results], ref)
    assert all(r[3] == [0, 0, 0, 0] for r in results), [r[3] for r in results]


@pytest.mark.parametrize("case", [
    dict(change_in_place=True),  # targets changed after the loader counted them
    dict(ignore_index=3),  # another ignore_index than the one counted
    dict(item_first=True),  # item() before backward: nothing reduced yet
    dict(host_group=False),  # counts that cannot be summed ahead
])
def test_ignored_targets_exact_where_nothing_was_counted_ahead(dist, case):
    rows = 8 * 2 + 5
    ref = run_clean(ignored_targets, False, rows, 8, **case)
    results = dist(2).run(ignored_targets, True, rows, 8, **case)
    _check([(*r[:3], None) for r in results], ref)
    # the loss (or item()) reduced at once what was not known ahead, on every process alike
    assert all(r[3] == results[0][3] and all(b > 0 for b in r[3][:2]) for r in results), [r[3] for r in results]


def _hooks_during_local_calls(fail: bool):
    """Count the automatic path's global hook calls during a local forward of the decoder
    (with ``fail``, one whose forward raises); report the hook tables' order after it and
    the module stack."""
    import importlib

    from torch.nn.modules import module as m

    rp = importlib.import_module("torchspmd.engines.native.wrappers.data_parallel")

    torch.manual_seed(0)
    model = decoder()
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    x_all, y_all = data("decoder", 8 * 3)
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=8),
                               ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    calls = []
    original = rp._global_pre
    rp._INSTALLED[0].remove()
    rp._INSTALLED[0] = m.register_module_forward_pre_hook(lambda mod, args: (calls.append(mod), original(mod, args))[1])
    other = m.register_module_forward_pre_hook(lambda mod, args: None)  # someone else's global hook, after ours
    before = (list(m._global_forward_pre_hooks), list(m._global_forward_hooks))
    try:
        batches = iter(loader)
        for _ in range(2):  # the check, then the first local call
            x, y = next(batches)
            F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        x, y = next(batches)
        calls.clear()
        raised = False
        if fail:
            model.layers[0].register_forward_pre_hook(lambda mod, args: 1 / 0)
            try:
                model(x)
            except ZeroDivisionError:
                raised = True
        else:
            F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        counted = len(calls)
        after = (list(m._global_forward_pre_hooks), list(m._global_forward_hooks))
        stack = list(rp._stack())
        local = list(ts.auto_path(model).values())
    finally:
        other.remove()
        rp._INSTALLED[0].remove()
        rp._INSTALLED[0] = m.register_module_forward_pre_hook(original)
    return counted, before[0] == after[0] or (before, after), before[1] == after[1], stack, local, raised


@pytest.mark.parametrize("fail", [False, True], ids=["local-call", "raising-local-call"])
def test_local_call_sets_the_global_module_hooks_aside(dist, fail):
    # Inside a local call the submodules take Module.__call__'s fast path: the automatic
    # path's global hook is called for the root only; afterwards (after a raise too) the
    # global hooks are back in their order and the module stack is empty.
    for counted, pre_order, post_order, stack, local, raised in dist(2).run(_hooks_during_local_calls, fail):
        assert local == [True]
        assert counted == 1, counted
        assert pre_order is True, pre_order
        assert post_order and stack == []
        assert raised == fail
