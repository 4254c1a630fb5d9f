"""bench/gpu.py, the script for the first GPU: its check (Pattern 1 and FSDPv2 at world
size 1 against plain PyTorch, each in a process of its own) on CPU here, and on CUDA
where a GPU is present (marked ``cuda``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _check(tmp_path, *args):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--check-only", "--out", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=280)
    result = json.loads((tmp_path / "gpu.json").read_text())
    return r, result


def test_check_runs_on_cpu(tmp_path):
    r, result = _check(tmp_path, "--device", "cpu", "--tiny", "--check-dtype", "float32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(result["verdicts"]) == {"pattern1", "fsdpv2"}
    assert all(v[0] == "pass" for v in result["verdicts"].values()), result["verdicts"]
    assert len(result["check"]["plain"]["losses"]) == 4
    assert "| Pattern 1 (no wrapper) | pass |" in (tmp_path / "gpu.md").read_text()


def test_stages_against_fsdpv2_on_cpu(tmp_path):
    """The multi-device entry: 2 pipeline stages against FSDPv2 over 2 processes, same losses."""
    r, result = _check(tmp_path, "--device", "cpu", "--tiny", "--check-dtype", "float32", "--stages-procs", "2",
                        "--steps", "3", "--warmup", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert result["verdicts"]["stages-pipeline"][0] == "pass", result["verdicts"]
    assert [s["strategy"] for s in result["stages"]] == ["stages-fsdpv2", "stages-pipeline"]
    assert all(s["tokens_per_s"] > 0 and len(s["losses"]) >= 3 for s in result["stages"])
    assert "| ts.pipeline, 2 stages (1f1b) |" in (tmp_path / "gpu.md").read_text()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_on_cuda(tmp_path, dtype):
    r, result = _check(tmp_path, "--device", "cuda", "--check-dtype", dtype)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(v[0] == "pass" for v in result["verdicts"].values()), result["verdicts"]
