"""What torch_xla's SPMD guides state, under ``--xla-compat``: PyTorch's DTensor API on an
``'xla'`` mesh (``init_device_mesh('xla', ...)``, ``distribute_tensor``, ``distribute_module``)
reaches torch_xla's extension point (``torch_xla.distributed.spmd.xla_distribute_tensor``),
which the layer answers with the native engine. Checked on every process, at 2 and 4.

(The guides' own code is run by tools/xla_guides.py from a clone of pytorch/xla; its table is in
docs/xla_conformance.md.)"""

import json
import subprocess
import sys

import pytest
from _helpers import ROOT, clean_env

HERE = ROOT / "tests" / "xla_compat"


def _results(world: int, out) -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--xla-compat", "--nproc", str(world),
                        str(HERE / "dtensor_api.py"), str(out)], capture_output=True, text=True,
                       env=clean_env(OMP_NUM_THREADS=1), timeout=300, cwd=HERE)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("world", [4])  # (one world size: the program uses its mesh by the device count it finds)
def test_dtensor_api_on_an_xla_mesh(world, tmp_path):
    results = _results(world, tmp_path)
    assert len(results) == world, "every process writes its results"
    for out in results:
        assert out["world"] == world
        assert out["type"] == "DTensor" and out["placements"] == ["Shard(dim=0)"], out
        assert out["local_equal"] and out["full_equal"] and out["replicated"], out
        assert out["mesh2_names"] == ["a", "b"] and out["mesh2_full_equal"], out
        assert out["module_weight_types"] == ["DTensor", "DTensor"], out
        assert out["module_output_close"] and out["hooks"] == ["input", "output"], out
        assert out["redistributed"] == [[None, 0], [world], True, [0, None]], out
        assert out["redistribute_refused"] == ["IndexError", "ValueError", "NotImplementedError"], out
        assert out["gradient_accumulation"] == [True, 30.0, True, True], out
        assert out["patched_linear"] == [True, True, True], out
        assert out["planners"] == [[["weight"], ["bias"]]] * 2, out
        assert out["moved_in_place"] == [True, [0, None], True, True], out
        assert out["op_results_in_place"] == [True, "", "OnXlaDevice", True, True, "", "{replicated}"], out
        assert out["flash_attention"] == [True, True] and out["sent"] == [1, [0, None], True], out


NO_SPMD = """
import torch, torch_xla
import torch_xla.distributed.parallel_loader as pl
batches = [(torch.randn(4, 3), torch.arange(4)) for _ in range(3)]
loader = pl.MpDeviceLoader(batches, torch_xla.device())
got = list(loader)
print("RESULT", len(loader), len(got), all(torch.equal(a, b[0]) and torch.equal(c, b[1]) for (a, c), b in
                                           zip(got, batches)), type(got[0][0]).__name__ in ("Tensor", "OnXlaDevice"))
"""


def test_a_program_without_spmd_gets_its_batches_on_the_device(tmp_path):
    """torch_xla's single-device programs (no use_spmd) use MpDeviceLoader as a device loader."""
    program = tmp_path / "no_spmd.py"
    program.write_text(NO_SPMD)
    r = subprocess.run([sys.executable, "-m", "torchspmd.compat", str(program)], capture_output=True, text=True,
                       env=clean_env(OMP_NUM_THREADS=1), timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT 3 3 True True" in r.stdout, r.stdout  # plain tensors (put on the device: OnXlaDevice)
