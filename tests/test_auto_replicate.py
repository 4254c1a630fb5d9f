"""The automatic data-parallel path: a program without a wrapper (the seed's Pattern 1)
computes locally with DDP's reducer once its forward is found row-local, and stays
exact. The oracle is the same program in this (plain PyTorch) process."""

import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchspmd as ts

RTOL, ATOL = 1e-5, 1e-6
VOCAB, SEQ = 29, 8


class Net(nn.Module):
    """Sizes not divisible by the device count; an unused parameter when ``unused``; a
    row-mixing BatchNorm when ``norm`` (with ``norm="eval"``: its running statistics, each
    row on its own); rows mixed one way (a cumulative sum over the batch) when ``cumsum``;
    the loss inside forward when ``inner_loss``."""

    def __init__(self, unused=False, norm=False, inner_loss=False, cumsum=False):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 3)
        self.norm = nn.BatchNorm1d(13) if norm else None
        if norm == "eval":
            with torch.no_grad():
                self.norm.running_mean.uniform_(-0.5, 0.5)
                self.norm.running_var.uniform_(0.5, 2.0)
        self.eval_norm = norm == "eval"
        self.spare = nn.Linear(3, 3) if unused else None
        self.inner_loss = inner_loss
        self.cumsum = cumsum

    def forward(self, x, target=None):
        h = torch.tanh(self.fc1(x))
        if self.norm is not None:
            self.norm.train(self.training and not self.eval_norm)
            h = self.norm(h)
        if self.cumsum:
            h = h.cumsum(0) / 4
        out = self.fc2(h)
        if self.inner_loss:
            return F.cross_entropy(out, target)
        return out


def _decoder():
    from torchspmd.models import DecoderModel

    return DecoderModel(vocab_size=VOCAB, dim=16, num_layers=2, num_heads=2, intermediate_size=24, max_seq_len=SEQ)


def _seed_decoder():
    """The seed document's decoder layers (nn.MultiheadAttention returning its attention
    weights, RMSNorm, a GELU MLP): DTensor regathers the batch inside the attention."""
    from _pattern1_models import DecoderModel

    return DecoderModel(dict(vocab=VOCAB, dim=16, layers=2, heads=2, inter=24, norm="rms"))


class Recurrent(nn.Module):
    """A language model of two LSTM layers (batch first) and a GRU."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 10)
        self.lstm = nn.LSTM(10, 9, num_layers=2, batch_first=True)
        self.gru = nn.GRU(9, 11, batch_first=True)
        self.head = nn.Linear(11, VOCAB)

    def forward(self, ids):
        return self.head(self.gru(self.lstm(self.embed(ids))[0])[0])


def _data(kind: str, rows: int):
    g = torch.Generator().manual_seed(5)
    if kind in ("decoder", "seed-decoder", "recurrent"):
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(rows, 7, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _loss(kind, model, x, y):
    if kind in ("decoder", "seed-decoder", "recurrent"):
        return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    if getattr(model, "inner_loss", False):
        return model(x, target=y)
    return F.cross_entropy(model(x), y)


def _run(kind: str, rows: int, batch: int, accumulate: int = 1, spmd: bool = False, wrap: bool = False,
         annotate: bool = False, net_kwargs=None, eval_first=False, raise_first=False):
    """Train for len(batches) / accumulate steps; return (losses, grads per step, state, decisions)."""
    torch.manual_seed(0)
    model = {"decoder": _decoder, "seed-decoder": _seed_decoder, "recurrent": Recurrent}.get(kind, lambda: Net(**(net_kwargs or {})))()
    x_all, y_all = _data(kind, rows)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=batch)
    if spmd:
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        if annotate:  # one parameter split over the devices: the sharded path
            ts.mark_sharding(model.fc1.weight, mesh, ("data", None))
        if wrap:
            model = ts.replicate(model, mesh)
        spec = ("data", None)
        loader = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, spec))
    # (The attention's key bias has a zero gradient, computed as rounding noise that Adam's
    # default eps turns into full steps: see _pattern1_models.ADAM_EPS.)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **({"eps": 1e-3} if kind == "seed-decoder" else {}))
    if eval_first:  # an evaluation (no gradients) before training: a kind of call of its own
        model.eval()
        with torch.no_grad():
            x0, y0 = next(iter(loader))
            _loss(kind, model, x0, y0)
        model.train()
    if raise_first:  # a call that raises (a batch of the wrong width), caught by the program
        import warnings

        x0, y0 = next(iter(loader))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model(torch.cat([x0, x0], dim=1))
            except RuntimeError:
                pass
            else:
                raise AssertionError("the bad call did not raise")
        assert not caught, [str(w.message) for w in caught]
    losses, grads = [], []
    for i, (x, y) in enumerate(loader):
        loss = _loss(kind, model, x, y) / accumulate
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            grads.append({k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for k, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}
    decided = list(ts.auto_path(model).values()) if spmd else None
    return losses, grads, state, decided


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
    ref = _run(kind, 8 * 3 + 7, 8)
    results = dist(world).run(_run, kind, 8 * 3 + 7, 8, spmd=True)
    _check(results, ref)
    assert all(r[3] == [True] for r in results)  # the local path was taken


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wrap", [False, True], ids=["auto", "replicate"])
def test_gradient_accumulation_exact(dist, world, wrap):
    # Two backward passes per optimizer step: DDP's reducer alone would count the first
    # pass's (already reduced) gradient once per process.
    ref = _run("net", 8 * 4, 8, accumulate=2)
    results = dist(world).run(_run, "net", 8 * 4, 8, accumulate=2, spmd=True, wrap=wrap)
    _check(results, ref)
    if not wrap:
        assert all(r[3] == [True] for r in results)


@pytest.mark.parametrize("world", [2, 4])
def test_row_local_in_a_layout_dtensor_cannot_express_takes_the_path(dist, world):
    # The seed's decoder: nn.MultiheadAttention returns its weights through a (sequence *
    # batch) view, where DTensor gathers the batch. The probe finds each row computed from
    # its own row: the local path, exact, with a last batch of 7 rows (uneven).
    ref = _run("seed-decoder", 8 * 2 + 7, 8)
    results = dist(world).run(_run, "seed-decoder", 8 * 2 + 7, 8, spmd=True)
    _check(results, ref)
    assert all(r[3] == [True] for r in results)


def _recurrent(auto: bool):
    previous = ts.set_auto_replicate(auto)
    try:
        return _run("recurrent", 8 * 2 + 7, 8, spmd=True)
    finally:
        ts.set_auto_replicate(previous)


@pytest.mark.parametrize("world,auto", [(2, True), (4, True), (2, False)], ids=["2-path", "4-path", "2-dtensor"])
def test_recurrent_layers_run_through_dtensor_and_take_the_path(dist, world, auto):
    # nn.LSTM / nn.GRU: on CPU a oneDNN op DTensor has no rule for, so the global view runs
    # them decomposed; the first call regathers the batch (time-major inside), the probe
    # finds them row-local, and later calls compute locally. Without the path: DTensor, exact.
    ref = _run("recurrent", 8 * 2 + 7, 8)
    results = dist(world).run(_recurrent, auto)
    # atol 1e-5: one device runs oneDNN's fused layers, the DTensor calls their decomposition
    # (another summation order, carried through the time steps: 4.6e-6 apart on one gradient
    # element of 360, measured)
    _check(results, ref, atol=1e-5)
    assert all(r[3] == ([True] if auto else []) for r in results)


def test_annotated_parameter_keeps_the_sharded_path(dist):
    ref = _run("net", 8 * 3, 8)
    results = dist(2).run(_run, "net", 8 * 3, 8, spmd=True, annotate=True)
    _check(results, ref)
    assert all(r[3] == [] for r in results)  # never considered: a parameter is sharded


@pytest.mark.parametrize("net_kwargs,expected", [
    ({"norm": True}, [False]),  # BatchNorm mixes rows: stays on DTensor
    ({"inner_loss": True}, [False]),  # a global loss returned by forward: stays on DTensor
    ({"unused": True}, [True]),  # a parameter no forward uses: DDP told to look for it
    ({"norm": "eval"}, [True]),  # BatchNorm with running statistics: each row on its own
    ({"cumsum": True}, [False]),  # later rows depend on earlier ones: DTensor regathers, the probe says mixed
], ids=["batchnorm", "inner-loss", "unused-parameter", "batchnorm-eval", "cumsum"])
def test_decision_follows_the_program(dist, net_kwargs, expected):
    ref = _run("net", 8 * 3, 8, net_kwargs=net_kwargs)
    results = dist(2).run(_run, "net", 8 * 3, 8, spmd=True, net_kwargs=net_kwargs)
    _check(results, ref)
    assert all(r[3] == expected for r in results)


def test_evaluation_before_training(dist):
    # An evaluation call (no gradients) is its own kind of call; training after it is
    # checked on its own and still exact.
    ref = _run("net", 8 * 3, 8, eval_first=True)
    results = dist(2).run(_run, "net", 8 * 3, 8, spmd=True, eval_first=True)
    _check(results, ref)
    assert all(sorted(r[3]) == [True, True] for r in results)


def test_a_call_that_raised_leaves_the_path_to_the_next_calls(dist):
    # torch calls a global always-called forward hook without keyword arguments after a
    # forward raised: the path's hook must still close the call (no warning), and the
    # next calls are checked and take the local path as if the failed call had not been.
    ref = _run("net", 8 * 3, 8, raise_first=True)
    results = dist(2).run(_run, "net", 8 * 3, 8, spmd=True, raise_first=True)
    _check(results, ref)
    assert all(r[3] == [True] for r in results)


def _switch_off():
    previous = ts.set_auto_replicate(False)
    try:
        return _run("net", 8 * 3, 8, spmd=True)
    finally:
        ts.set_auto_replicate(previous)


def test_switched_off_stays_on_dtensor(dist):
    ref = _run("net", 8 * 3, 8)
    results = dist(2).run(_switch_off)
    _check(results, ref)
    assert all(r[3] == [] for r in results)


def _switched_off_by_the_environment():
    os.environ["TORCHSPMD_AUTO_REPLICATE"] = "0"  # (the pool undoes it after the task)
    return _run("net", 8 * 3, 8, spmd=True)


def test_the_environment_switch_is_read_when_the_path_is_asked(dist):
    # These workers imported torchspmd before the variable was set, as a forked worker of
    # `torchspmd run` did in its launcher before its program set it: still off.
    ref = _run("net", 8 * 3, 8)
    results = dist(2).run(_switched_off_by_the_environment)
    _check(results, ref)
    assert all(r[3] == [] for r in results)


def _optimizer_steps(spmd: bool):
    """An Adam step on plain parameters, a step with a closure, a step that raises; with
    spmd, count the global-view mode's calls during each and report whether it is still
    the innermost mode after the failed step."""
    from torchspmd.engines.native import global_mode
    from torchspmd.engines.native import implicit_replication as gv

    torch.manual_seed(0)
    model = Net()
    x, y = _data("net", 8)
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
    _, _, _, ref_losses, ref_state = _optimizer_steps(spmd=False)
    results = dist(2).run(_optimizer_steps, True)
    for plain, with_closure, mode_kept, losses, state in results:
        assert plain == [], plain
        assert with_closure > 0, with_closure
        assert mode_kept
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=ATOL)


def _ignored_targets(spmd: bool, rows: int, batch: int, ignore_index: int = -100, change_in_place: bool = False,
                     item_first: bool = False, whole: bool = False, host_group: bool = True):
    """Pattern 1 on a decoder whose targets hold ``ignore_index`` unevenly (most of them in
    the first rows of each batch, so on the first process). Returns the losses, the
    gradients and the parameters after each step, and with ``spmd`` the number of blocking
    all-reduces made by each step's loss and ``loss.item()``."""
    torch.manual_seed(0)
    model = _decoder()
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    x_all, y_all = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    first_rows = (torch.arange(rows) % batch < 3)[:, None]
    y_all[(torch.rand(y_all.shape, generator=g) < 0.5) & first_rows] = ignore_index
    y_all[(torch.rand(y_all.shape, generator=g) < 0.05) & ~first_rows] = ignore_index
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=batch)
    if spmd:
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        if whole:  # a list: every process reads each whole batch (no per-process reading)
            loader = list(loader)
        loader = ts.MpDeviceLoader(loader, ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if not spmd or host_group:
        return _ignored_steps(model, loader, opt, ignore_index, change_in_place, item_first)
    from torchspmd.engines.native import early_reductions as _early

    host_collectives = _early._host_collectives
    _early._host_collectives = lambda: False  # as with a default group of NCCL alone: no sums on the host
    try:
        return _ignored_steps(model, loader, opt, ignore_index, change_in_place, item_first)
    finally:
        _early._host_collectives = host_collectives


def _ignored_steps(model, loader, opt, ignore_index, change_in_place, item_first):
    import torch.distributed as tdist

    blocking = [0]
    original = tdist.all_reduce

    def counting(*args, **kwargs):
        if not kwargs.get("async_op", False):
            blocking[0] += 1
        return original(*args, **kwargs)

    losses, grads, blocked = [], [], []
    for i, (x, y) in enumerate(loader):
        if change_in_place:  # after the loader counted the targets
            y.masked_fill_(y == 5, ignore_index)
        logits = model(x).reshape(-1, VOCAB)
        tdist.all_reduce, blocking[0] = counting, 0
        try:
            loss = F.cross_entropy(logits, y.reshape(-1), ignore_index=ignore_index)
            if item_first:
                losses.append(loss.item())
            tdist.all_reduce = original
            loss.backward()
            tdist.all_reduce = counting
            if not item_first:
                losses.append(loss.item())
        finally:
            tdist.all_reduce = original
        blocked.append(blocking[0])
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, grads, state, blocked


@pytest.mark.parametrize("world,whole", [(2, False), (4, False), (2, True)], ids=["2", "4", "2-whole-batches"])
def test_ignored_targets_need_no_blocking_collective(dist, world, whole):
    # The count a mean cross-entropy divides by comes from the loader (reduced while the
    # forward runs, or counted by each process when every process reads whole batches) and
    # loss.item() from a reduction started at the backward pass: the loss and item() block
    # on no collective, and everything still equals one device's run (batches of 8 rows,
    # then 7: uneven).
    rows = 8 * 3 + 7
    ref = _ignored_targets(False, rows, 8)
    results = dist(world).run(_ignored_targets, True, rows, 8, whole=whole)
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
    ref = _ignored_targets(False, rows, 8, **case)
    results = dist(2).run(_ignored_targets, True, rows, 8, **case)
    _check([(*r[:3], None) for r in results], ref)
    # the loss (or item()) reduced at once what was not known ahead, on every process alike
    assert all(r[3] == results[0][3] and all(b > 0 for b in r[3][:2]) for r in results), [r[3] for r in results]


def _hooks_during_local_calls(fail: bool):
    """Count the automatic path's global hook calls during a local forward of the decoder
    (with ``fail``, one whose forward raises); report the hook tables' order after it and
    the module stack."""
    import importlib

    from torch.nn.modules import module as m

    rp = importlib.import_module("torchspmd.engines.native.data_parallel")

    torch.manual_seed(0)
    model = _decoder()
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("data",))
    x_all, y_all = _data("decoder", 8 * 3)
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
