"""The multi-rank harness itself: a failed task ends its pool, environment changes are undone."""

import os

import pytest
from _pool import WorkerFailed


def _pid_and_fail(fail_on):
    import torch.distributed as tdist

    if tdist.get_rank() == fail_on:
        raise ValueError("this rank fails")
    tdist.barrier()  # the other rank waits for the failed one, as a real collective would
    return os.getpid()


def _pid():
    return os.getpid()


def test_a_failed_task_gives_the_next_test_a_fresh_pool(dist):
    pool = dist(2)
    before = pool.run(_pid)
    with pytest.raises(WorkerFailed, match="this rank fails"):
        pool.run(_pid_and_fail, 1)
    assert not pool.alive
    after = dist(2).run(_pid)
    assert set(after).isdisjoint(before)


def _set_env():
    os.environ["TORCHSPMD_POOL_PROBE"] = "set"
    os.environ.pop("WORLD_SIZE")
    return True


def _read_env():
    return os.environ.get("TORCHSPMD_POOL_PROBE"), os.environ.get("WORLD_SIZE")


def test_environment_changes_are_undone(dist):
    pool = dist(2)
    pool.run(_set_env)
    assert pool.run(_read_env) == [(None, "2"), (None, "2")]


def _leave_state():
    import numpy as np

    import torchspmd as ts
    from torchspmd.patches import dtensor as dtensor_patches

    n = ts.global_runtime_device_count()
    ts.set_global_mesh(ts.Mesh(np.arange(n), (n,), ("data",)))
    ts.set_auto_replicate(False)
    with dtensor_patches.groups_in_mesh_order():  # (removed on exit: nothing left)
        pass
    from torchspmd import patches
    from torchspmd.patches import torch as torch_patches

    torch_patches.map_device(lambda d: False, ts.device)  # a patch use_spmd() does not apply
    return sorted(p.name for p in patches.active())


def _state():
    import torchspmd as ts
    from torchspmd import patches
    from torchspmd.engines.native.wrappers import data_parallel

    return ts.get_global_mesh(), data_parallel.set_auto_replicate(None), sorted(p.name for p in patches.active())


def _remove_a_use_spmd_patch():
    from torchspmd import patches
    from torchspmd.patches import torch as torch_patches

    patches.remove(torch_patches.OPTIMIZER_STEPS.name)


def test_a_task_leaves_no_global_state_to_the_next(dist):
    pool = dist(2)
    before = pool.run(_state)
    left = pool.run(_leave_state)
    assert "torch: the 'xla' device" in left[0]
    assert pool.run(_state) == before == [(None, None, before[0][2])] * 2


def test_a_task_that_removes_a_patch_of_use_spmd_fails_and_the_pool_starts_again(dist):
    pool = dist(2)
    names = pool.run(_state)[0][2]
    with pytest.raises(WorkerFailed, match=r"cannot be reset: the patches \['torch.optim.Optimizer.profile_hook_step"):
        pool.run(_remove_a_use_spmd_patch)
    assert not pool.alive
    assert dist(2).run(_state)[0][2] == names
