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
