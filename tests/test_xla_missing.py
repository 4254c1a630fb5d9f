"""Without torch_xla installed, asking for the XLA backend says how to install it; a set
PJRT_DEVICE alone falls back to the native engine with a warning."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from _helpers import clean_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                                reason="torch_xla is installed here (tests/xla/ covers the backend)")

SCRIPT = textwrap.dedent("""
    import os, warnings
    import torchspmd as ts
    for how in ("argument", "environment"):
        try:
            if how == "argument":
                ts.use_spmd(backend="xla")
            else:
                os.environ["TORCHSPMD_BACKEND"] = "xla"
                ts.use_spmd()
        except ts.SpmdError as e:
            print(how, "|", e)
        os.environ.pop("TORCHSPMD_BACKEND", None)
    os.environ["PJRT_DEVICE"] = "CPU"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.use_spmd()
    print("fallback |", ts.backend(), "|", "; ".join(str(w.message) for w in caught))
""")


def test_asking_for_xla_without_torch_xla_says_how_to_install():
    env = clean_env()
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" | ", 1) for line in r.stdout.splitlines() if " | " in line)
    assert lines["argument"].startswith("use_spmd(backend='xla'): torch_xla is not installed")
    assert lines["environment"].startswith("TORCHSPMD_BACKEND=xla: torch_xla is not installed")
    for message in (lines["argument"], lines["environment"]):
        assert "pip install 'torchspmd[tpu]'" in message and "torch_xla==2.9.0" in message
    backend, warning = lines["fallback"].split(" | ")
    assert backend == "cpu"
    assert "PJRT_DEVICE=CPU is set but torch_xla is not installed" in warning
