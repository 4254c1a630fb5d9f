"""torchspmd on a device that is neither the CPU nor CUDA: simdev (tests/simdev/), a compiled
PrivateUse1 device installed as a plugin (a ``torch.backends`` entry point, as out-of-tree
devices install themselves), with its own allocator, device guard, generators, host
allocator and process-group backend. Nothing in torchspmd names it: ``use_spmd()`` finds it
as the accelerator (``torch.accelerator.current_accelerator()``), takes its process-group
backend from c10d's map, and runs Pattern 1, FSDPv2 (nested, uneven shards) and a checkpoint
round trip on it at 2 and 4 processes, exact against plain PyTorch in one process.

The extension is built in a subprocess (loading it here would make simdev this test process's
accelerator), once per torch version, into ~/.cache/torchspmd/simdev/ (about 25 s; 35 s against
torch 2.15's CUDA build, where the 2-process case runs in CI's smoke subset)."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _helpers import ROOT, clean_env

TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS / "simdev"))
import program  # noqa: E402  (the program's model and batches; it imports torchspmd only to run)

RTOL, ATOL = 1e-5, 1e-6  # fp32: the sharded run sums each gradient in another order


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict[str, str]:
    """An environment whose ``import torch`` loads simdev (built here once)."""
    root = tmp_path_factory.mktemp("simdev_plugin")
    info = root / "simdev_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: simdev-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nsimdev = simdev:load\n")
    env = clean_env(PYTHONPATH=f"{root}:{TESTS}:{ROOT}")
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    built = subprocess.run([sys.executable, "-c", "import torch; print(torch.accelerator.current_accelerator())"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0 and built.stdout.split() == ["simdev"], built.stderr[-3000:]
    return env


def oracle() -> dict:
    """Both patterns in one process on the CPU, plain PyTorch (no torchspmd)."""
    out = {}
    for name, make_opt, steps in (("pattern1", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), program.STEPS),
                                  ("pattern2", lambda p: torch.optim.AdamW(p, lr=0.01), program.STEPS + 1)):
        model = program.make_model()
        optimizer = make_opt(model.parameters())
        losses = []
        for step in range(steps):
            x, y = program.batch(step)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[name] = {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return out


@pytest.mark.parametrize("processes", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_patterns_and_a_checkpoint_round_trip_on_a_privateuse1_device(plugin, tmp_path, processes):
    run = subprocess.run([sys.executable, str(TESTS / "simdev" / "program.py"), str(tmp_path)],
                         env={**plugin, "TORCHSPMD_NUM_DEVICES": str(processes)}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    # found, not named: the accelerator PyTorch reports, with the backend simdev declared for it
    assert (got["device"], got["devices"], got["process_group"]) == ("simdev:0", processes, "cpu:gloo,simdev:simgloo")
    assert got["pattern1"]["param_device"] == "simdev:0"
    # FSDPv2 keeps each process's shard on the device: 7 rows, uneven (4 + 3 at 2 processes, 2+2+2+1 at 4)
    assert (got["pattern2"]["shard_device"], got["pattern2"]["shard_rows"]) == ("simdev:0", -(-7 // processes))
    assert got["pattern2"]["placements"] == "(Shard(dim=0),)" and got["pattern2"]["allocated"] > 0
    want = oracle()
    for name in ("pattern1", "pattern2"):
        torch.testing.assert_close(torch.tensor(got[name]["losses"]), torch.tensor(want[name]["losses"]),
                                   rtol=RTOL, atol=ATOL, msg=name)
        assert got[name]["params"].keys() == want[name]["params"].keys()
        for key, value in want[name]["params"].items():
            torch.testing.assert_close(got[name]["params"][key], value, rtol=RTOL, atol=ATOL, msg=f"{name} {key}")
    # the round trip: loaded into a fresh model and optimizer, the same step gives the same loss and weights
    assert got["resumed"]["state"] == {"step": program.STEPS}
    assert got["resumed"]["losses"] == got["pattern2"]["losses"][-1:]
    for key, value in got["pattern2"]["params"].items():
        assert torch.equal(got["resumed"]["params"][key], value), key
