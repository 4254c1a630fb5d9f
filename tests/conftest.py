import importlib.util
import os
import sys

import pytest

# tests/xla/ runs in the torch_xla environment (see .ci/envs.py and the README's test command).
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]

sys.path.insert(0, os.path.dirname(__file__))
from _pool import Pool  # noqa: E402

_POOLS: dict[int, Pool] = {}


def pytest_addoption(parser):
    parser.addoption("--fuzz-n", type=int, default=0,
                     help="tests/test_fuzz.py: this many more random programs per world size than CI's seeds")


@pytest.fixture(scope="session")
def dist():
    """``dist(world).run(fn, *args)`` runs ``fn`` on every rank of a gloo group of size
    ``world`` (processes started once per session) and returns each rank's result."""

    def get(world: int) -> Pool:
        pool = _POOLS.get(world)
        if pool is None or not pool.alive:
            pool = _POOLS[world] = Pool(world)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()


@pytest.fixture(scope="session")
def once(tmp_path_factory):
    """``once(name, make)``: made once for all the test runners of a run. ``make(folder)``
    fills an empty folder and returns a JSON value; ``once`` returns ``(folder, value)``.
    pytest-xdist's workers share the parent of their temporary directories: a file lock
    there lets one of them make it while the others wait for it. A make that raised (or
    ran past pytest-timeout's limit) is not made again: every later caller fails at once
    with its error, so that one broken shared job costs one job's time, not one per test
    that reads it. What is made is shared: tests read it and write their own files
    elsewhere."""
    import json
    import traceback

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, make):
        folder, done, failed = shared / name, shared / f"{name}.json", shared / f"{name}.failed"
        with FileLock(str(shared / f"{name}.lock")):
            if failed.exists():
                pytest.fail(f"the shared setup {name!r} failed in an earlier test (not made again):\n"
                            f"{failed.read_text()[-3000:]}", pytrace=False)
            if not done.exists():
                folder.mkdir()
                try:
                    value = make(folder)
                except BaseException:  # pytest-timeout's signal and KeyboardInterrupt included
                    failed.write_text(traceback.format_exc())
                    raise
                done.write_text(json.dumps({"value": value}))
            return folder, json.loads(done.read_text())["value"]

    return get


@pytest.fixture(autouse=True)
def _restore_environment():
    """Every change a test makes to ``os.environ`` in this process is undone after it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run where CUDA is present and are skipped elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
