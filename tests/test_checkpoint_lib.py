"""torchspmd.checkpoint as a library: optimizers whose state the checkpoint lacks (in part
or whole), checkpoints of another model or optimizer, and saves that fail on one process.

The oracle is one plain-PyTorch process (no torchspmd) on the same global batches: a run
saved, loaded and continued at 2 processes must equal the uninterrupted plain run (fp32,
rtol 1e-5). Errors must be the same on every process (they are one program), and a
failed save must leave the processes in step (the next collective pairs up) and the last
good checkpoint whole.
"""

import errno

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _helpers import same_on_every_rank

import torchspmd as ts

RTOL, ATOL = 1e-5, 1e-6
STEPS = 5
BATCH = 8


class Net(nn.Module):
    """Two layers, and with ``unused`` a third that takes part in no forward: it never gets
    a gradient, so Adam never makes state for it."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 3)
        if unused:
            self.unused = nn.Linear(12, 12)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


# case: (optimizer, the step the checkpoint is saved after, whether the model has an unused layer)
CASES = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), 2, False),  # plain SGD keeps no state at all
    "adam_before_first_step": (lambda ps: torch.optim.Adam(ps, lr=1e-2), 0, False),
    "unused_parameter": (lambda ps: torch.optim.Adam(ps, lr=1e-2), 2, True),
}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]


def _net(unused: bool, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(unused)


def _optim_state(model, opt, whole=lambda v: v.detach().clone()) -> dict:
    """The optimizer's state by parameter name and key (``whole`` gathers a sharded value)."""
    return {f"{n}.{k}": whole(v) for n, p in model.named_parameters() for k, v in sorted(opt.state.get(p, {}).items())}


def _oracle(case: str):
    """One plain process, never interrupted: the losses, the weights and the optimizer's
    state at the end, and the parameters the optimizer holds state for at the save."""
    make_opt, save_at, unused = CASES[case]
    model = _net(unused)
    opt = make_opt(model.parameters())
    names = {p: n for n, p in model.named_parameters()}
    losses, with_state = [], None
    for i, (x, y) in enumerate(_batches()):
        if i == save_at:
            with_state = sorted(names[p] for p in opt.state if opt.state[p])
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), with_state, _optim_state(model, opt)


def _mesh():
    return ts.Mesh(np.arange(2), (2,), ("fsdp",))


def _wrapped(unused: bool, seed: int = 0):
    return ts.FSDPv2(_net(unused, seed), mesh=_mesh())


def _step(model, opt, x, y) -> float:
    """One step on a global batch, split over the processes by rows."""
    with ts.step():
        x, y = (ts.mark_sharding(t, _mesh(), ("fsdp", None)) for t in (x, y))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def _save_load_continue(root: str, case: str, into: str):
    """Train to the save point, save; load into a fresh model and optimizer (``fresh``) or
    into the same ones after a step past the save point (``trained``: the load takes that
    step back, the optimizer state included); train on from there."""
    from torchspmd import checkpoint as ckpt

    make_opt, save_at, unused = CASES[case]
    batches = _batches()
    model = _wrapped(unused)
    opt = make_opt(model.parameters())
    losses = [_step(model, opt, *b) for b in batches[:save_at]]
    path = ckpt.save(root, save_at, model, opt, {"step": save_at}, "")
    if into == "fresh":
        model = _wrapped(unused, seed=7)  # other weights: the load must set them
        opt = make_opt(model.parameters())
    else:
        _step(model, opt, *batches[save_at])
    assert ckpt.load(path, model, opt) == {"step": save_at}
    names = {p: n for n, p in model.named_parameters()}
    with_state = sorted(names[p] for p in opt.state if opt.state[p])
    losses += [_step(model, opt, *b) for b in batches[save_at:]]
    optim = _optim_state(model, opt, lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone())
    return losses, ts.full_state_dict(model, rank0_only=False), with_state, optim


@pytest.mark.parametrize("case,into", [("sgd", "fresh"), ("adam_before_first_step", "trained"),
                                       ("unused_parameter", "fresh"), ("unused_parameter", "trained")])
def test_optimizer_state_the_checkpoint_lacks_stays_absent_and_training_continues_exactly(dist, tmp_path, case,
                                                                                           into):
    ref_losses, ref_weights, ref_with_state, ref_optim = _oracle(case)
    if case == "unused_parameter":  # the case is what it says: Adam has state for all but the unused layer
        assert ref_with_state == ["a.bias", "a.weight", "b.bias", "b.weight"]
    else:
        assert ref_with_state == []
    for losses, weights, with_state, optim in dist(2).run(_save_load_continue, str(tmp_path / "ck"), case, into):
        assert with_state == ref_with_state  # as the uninterrupted optimizer had at that step
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
        assert weights.keys() == ref_weights.keys()
        for k in ref_weights:
            torch.testing.assert_close(weights[k], ref_weights[k], rtol=RTOL, atol=ATOL, msg=k)
        assert optim.keys() == ref_optim.keys()  # and the optimizer's state at the end
        for k in ref_optim:
            torch.testing.assert_close(optim[k], ref_optim[k], rtol=RTOL, atol=ATOL, msg=k)


# --- checkpoints of another model or optimizer: a clear error, nothing loaded --------------

def _full(model, opt) -> dict:
    out = {f"model.{k}": v.clone() for k, v in ts.full_state_dict(model, rank0_only=False).items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[p]}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def _unchanged(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(
        before[k] == after[k] if k == "groups" else torch.equal(before[k], after[k]) for k in before)


def _load_mismatched(root: str, saved: str, loaded: str):
    """Save a trained model (``saved``), load it into another (``loaded``, trained a step
    so that it has optimizer state); return the error, its type and whether the model and
    optimizer being loaded into are unchanged."""
    from torchspmd import checkpoint as ckpt

    def make(kind: str, seed: int):
        torch.manual_seed(seed)
        layers = {"3 layers": 3, "1 layer": 1}.get(kind, 2)
        model = ts.FSDPv2(nn.Sequential(*[nn.Linear(6, 6) for _ in range(layers)]), mesh=_mesh())
        params = list(model.parameters())
        if kind == "sgd momentum":
            return model, torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if kind == "2 groups":
            return model, torch.optim.Adam([{"params": [p for p in params if p.ndim == 2]},
                                            {"params": [p for p in params if p.ndim < 2], "lr": 0.0}], lr=1e-2)
        return model, torch.optim.Adam(params, lr=1e-2)

    x, y = _batches()[0]
    x, y = x[:, :6], torch.cat([y, y], 1)
    model, opt = make(saved, 0)
    _step(model, opt, x, y)
    path = ckpt.save(root, 1, model, opt, {"step": 1}, "")
    other, other_opt = make(loaded, 3)
    _step(other, other_opt, x, y)
    before = _full(other, other_opt)
    try:
        ckpt.load(path, other, other_opt)
    except Exception as e:
        return type(e).__name__, str(e).replace(str(path), "PATH"), _unchanged(before, _full(other, other_opt))
    return "loaded", "", _unchanged(before, _full(other, other_opt))


MISMATCHES = {
    # F2: more weights in the checkpoint than in the model (loaded them, then failed with a KeyError)
    ("3 layers", "adam"): "checkpoint PATH: it has weights for '2.bias' (and 1 more), which this model does not have; "
                          "it was saved from another model (one with more layers or modules)",
    ("adam", "3 layers"): "checkpoint PATH: it has no weights for '2.weight' (and 1 more); it was saved from another "
                          "model",
    # F1: another optimizer class (was "corrupt ... momentum_buffer") and other parameter groups
    ("adam", "sgd momentum"): "checkpoint PATH was saved with another optimizer: a torch.optim.adam.Adam, and this one "
                              "is a torch.optim.sgd.SGD; load it into the kind of optimizer that saved it",
    ("adam", "2 groups"): "checkpoint PATH was saved with another optimizer: it has 1 parameter group(s) and this "
                          "optimizer 2; build the optimizer with the parameter groups of the one that saved it",
}


@pytest.mark.parametrize("saved,loaded", list(MISMATCHES))
def test_a_checkpoint_of_another_model_or_optimizer_is_refused_before_anything_is_loaded(dist, tmp_path, saved,
                                                                                         loaded):
    kind, message, unchanged = same_on_every_rank(dist(2).run(_load_mismatched, str(tmp_path), saved, loaded))
    assert (kind, message) == ("CheckpointMismatch", MISMATCHES[saved, loaded])
    assert unchanged  # neither the weights nor the optimizer's state and settings were touched


# --- saves that fail on one process: the same error everywhere, the group in step ------------

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _save_fails(root: str, where: str):
    """Save step 1, then step 2 with a fault on one process (``where``); return the error
    (its type, message, and whether ``except Exception`` catches it), a collective after it
    (it pairs up only if every process is in step), what is left under ``root``, and
    whether step 1 still loads as it was saved."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torchspmd import checkpoint as ckpt
    from torchspmd.checkpoint_format import files

    model = _wrapped(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _batches()[0]
    _step(model, opt, x, y)
    ckpt.save(root, 1, model, opt, {"step": 1}, "", keep=1)
    saved = ts.full_state_dict(model, rank0_only=False)
    _step(model, opt, x, y)
    rank = dist.get_rank()
    real_write, real_write_data = files.write_synced, dcp.FileSystemWriter.write_data
    if where == "state.pt on rank 0" and rank == 0:  # rank 0's disk fills up as it writes state.pt
        files.write_synced = _no_space
    if where == "shards on rank 1" and rank == 1:  # DCP's writer fails on rank 1 only
        dcp.FileSystemWriter.write_data = _no_space
    try:
        ckpt.save(root, 2, model, opt, {"step": 2}, "", keep=1)
        error = ("saved", "", True)
    except Exception as e:
        error = (type(e).__name__, str(e).replace(root, "ROOT"), True)
    except BaseException as e:  # DCP's CheckpointException is one
        error = (type(e).__name__, str(e).replace(root, "ROOT"), False)
    finally:  # (the pool's processes run the next tests)
        files.write_synced, dcp.FileSystemWriter.write_data = real_write, real_write_data
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank)  # out of step, it would pair with another collective or hang
    left = sorted(os.listdir(root))
    fresh = _wrapped(False, seed=5)
    state = ckpt.load(f"{root}/step-00000001", fresh, torch.optim.Adam(fresh.parameters(), lr=1e-2))
    same = all(torch.equal(v, saved[k]) for k, v in ts.full_state_dict(fresh, rank0_only=False).items())
    return error, ranks, left, state, same


SAVE_FAILURES = {
    # F3: rank 0 alone failed and the others went on (no checkpoint, the group out of step)
    "state.pt on rank 0": "checkpoint ROOT/step-00000002 was not saved: OSError: [Errno 28] No space left on device "
                          "(on process 0, writing state.pt, config.toml, meta.json and checksums.json); the "
                          "checkpoints saved before it are unchanged",
    # F4: DCP's CheckpointException (a BaseException) that named the ranks only
    "shards on rank 1": "checkpoint ROOT/step-00000002 was not saved: writing its shards failed on process 1 "
                        "(process 1: OSError: [Errno 28] No space left on device); the checkpoints saved before it "
                        "are unchanged",
}


@pytest.mark.parametrize("where", list(SAVE_FAILURES))
def test_a_save_that_fails_on_one_process_fails_alike_on_every_process(dist, tmp_path, where):
    root = str(tmp_path / "ck")
    results = dist(2).run(_save_fails, root, where)
    error, ranks, left, state, same = same_on_every_rank(results)
    assert error == ("SpmdError", SAVE_FAILURES[where], True)  # an Exception: `except Exception` catches it
    assert ranks == [0, 1]  # the processes are still in step
    assert left == ["step-00000001"]  # the unfinished one is gone, the last good one is there
    assert state == {"step": 1} and same


def _hash_fails_on_rank1(root):
    import torch.distributed as dist

    from torchspmd import checkpoint as ckpt
    from torchspmd.checkpoint_format import files

    model = _wrapped(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, opt, *_batches()[0])
    path = ckpt.save(root, 1, model, opt, {"step": 1}, "")
    real = files.sha256

    def unreadable(f):
        raise OSError(errno.EIO, "Input/output error")

    if dist.get_rank() == 1:
        files.sha256 = unreadable
    try:
        ckpt.check(path)
        error = None
    except Exception as e:
        error = (type(e).__name__, str(e).replace(root, "ROOT"))
    finally:
        files.sha256 = real
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dist.get_rank())  # still in step
    return error, ranks


def test_a_file_one_process_cannot_hash_fails_the_check_alike_everywhere(dist, tmp_path):
    # rank 1 raised while hashing its share of the files and rank 0 waited in the
    # all-gather of the hashes: the same error on every process now, and they stay in step
    error, ranks = same_on_every_rank(dist(2).run(_hash_fails_on_rank1, str(tmp_path / "ck")))
    assert error == ("DamagedCheckpoint", "checkpoint ROOT/step-00000001 cannot be checked: a file cannot be read "
                                          "on process 1 (OSError: [Errno 5] Input/output error)")
    assert ranks == [0, 1]
