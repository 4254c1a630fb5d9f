"""``--xla-compat`` against torch_xla itself (this environment has it): the layer's HLO
sharding text (``torchspmd.layouts.hlo``, what ``torch_xla._XLAC._get_xla_sharding_spec``
returns under the switch) equals torch_xla's own for the cases of
tests/xla_compat/sharding_cases.py; and with torch_xla installed, the switch says that it
shadows it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import clean_env, native_python

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.distributed.spmd as xs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _cases():
    spec = importlib.util.spec_from_file_location("sharding_cases", ROOT / "tests" / "xla_compat" / "sharding_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}{c[1]}{c[2]}{c[4]}")
def test_layer_text_equals_torch_xlas(ts, case):
    from torchspmd.layouts import hlo

    shape, names, ids, tshape, spec = case
    mesh = xs.Mesh(np.array(ids), shape, names)
    t = torch.randn(*tshape).to(torch_xla.device())
    xs.mark_sharding(t, mesh, spec)
    theirs = torch_xla._XLAC._get_xla_sharding_spec(t)
    assert hlo.from_partition_spec(np.array(ids).reshape(shape), names, spec) == theirs
    # its sharding type, read from the text as tests/test_xla_compat.py checks the layer's
    want = 0 if theirs == "{replicated}" else 5 if "last_tile_dim_replicate" in theirs else 3
    assert int(torch_xla._XLAC._get_xla_sharding_type(t)) == want


def test_the_switch_says_it_shadows_an_installed_torch_xla_and_refuses_this_torch(tmp_path):
    """With torch_xla installed the switch says that it shadows it; on this environment's torch
    (2.9, below what the native engine and the layer's patches are verified on) it then refuses
    to start, once, naming the versions, without a traceback."""
    script = tmp_path / "probe.py"
    script.write_text("import torch_xla, torch_xla.runtime as xr\nprint(torch_xla.__version__, xr.world_size())\n")
    r = subprocess.run([sys.executable, "-m", "torchspmd.compat", str(script)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=clean_env(PYTHONPATH=ROOT))
    assert r.returncode == 2 and not r.stdout, (r.stdout, r.stderr[-3000:])
    assert "torch_xla is installed" in r.stderr and "is shadowed" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("torchspmd --xla-compat: --xla-compat needs ") == 1, r.stderr[-3000:]
    assert "is outside the versions torchspmd's patch" in r.stderr and "install torch>=2.13,<2.16" in r.stderr


def test_the_switch_runs_a_probe_in_the_native_environment(tmp_path):
    """The same probe under the switch in the native engine's environment (no torch_xla there):
    torch_xla's SPMD view of one process."""
    script = tmp_path / "probe.py"
    script.write_text("import torch_xla, torch_xla.runtime as xr\nprint(torch_xla.__version__, xr.world_size())\n")
    r = subprocess.run([native_python(), "-m", "torchspmd.compat", str(script)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=clean_env(PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["2.9.0+torchspmd.compat", "1"]


def _result(cmd, env) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT / "tests" / "xla_compat", env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


def test_device_data_tables_and_the_save_planners_index_equal_torch_xlas():
    """tests/xla_compat/device_data.py on torch_xla (2 CPU devices) and under the switch (2
    processes): the same sharding texts, tables (drawn identically) and write-item indices. The
    program leaves out what differs by design: an op's result after a sync (torch_xla's is
    ``{replicated}``, the layer's ``''``: an op on a tensor put on the device gives a plain one)."""
    program = str(ROOT / "tests" / "xla_compat" / "device_data.py")
    theirs = _result([sys.executable, program], clean_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=2))
    ours = _result([native_python(), "-m", "torchspmd.cli", "run", "--xla-compat", "--nproc", "2", program],
                   clean_env(PYTHONPATH=ROOT, OMP_NUM_THREADS=1))
    assert ours == theirs
