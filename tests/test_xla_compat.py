"""``--xla-compat``: torch_xla SPMD programs, unchanged, on the native engine.

The seed document's Patterns 1-4 and optimum-tpu's fsdp_v2 program (tests/xla_compat/,
their lines copied verbatim) run under ``torchspmd run --xla-compat`` on 2 and 4 CPU
processes and must give the losses of the same training in plain PyTorch (the stock
transformers / trl trainer for the optimum program) on one device, in a process that never
imports torchspmd (tests/xla_compat/oracle.py). fp32, rtol 1e-5."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import ROOT, clean_env

HERE = ROOT / "tests" / "xla_compat"
SEEDS = ROOT.parent / "shared" / "seeds"
RTOL = 1e-5
TIMEOUT = 600


def _losses(stdout: str) -> list[float]:
    lines = [l for l in stdout.splitlines() if l.startswith("LOSSES ")]
    assert len(lines) == 1, f"expected one LOSSES line (printed once for the program), got {len(lines)}:\n{stdout}"
    return json.loads(lines[0][len("LOSSES "):])


def _params(stdout: str) -> dict:
    return json.loads(next(l for l in stdout.splitlines() if l.startswith("PARAMS "))[len("PARAMS "):])


def _compat(program, world, *args, cwd=None, **env):
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "run", "--xla-compat", "--nproc", str(world),
                        str(program), *map(str, args)],
                       capture_output=True, text=True, env=clean_env(OMP_NUM_THREADS=1, **env), timeout=TIMEOUT,
                       cwd=cwd or HERE)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def _oracle(*args):
    r = subprocess.run([sys.executable, str(HERE / "oracle.py"), *map(str, args)], capture_output=True, text=True,
                       env=clean_env(OMP_NUM_THREADS=2), timeout=TIMEOUT, cwd=HERE)
    assert r.returncode == 0, r.stderr[-4000:]
    return _losses(r.stdout)


_ORACLES: dict = {}


def _oracle_once(*args):
    if args not in _ORACLES:
        _ORACLES[args] = _oracle(*args)
    return _ORACLES[args]


@pytest.fixture(scope="session")
def seed_oracle(once):
    """The oracle's losses for a seed program, computed once for all the test runners."""
    return lambda program: once(f"oracle-{program}", lambda _: _oracle(program))[1]


@pytest.mark.smoke
# Each program at one world size (2 and 4 both taken): the compat layer is the same at either, and
# the native suite checks every pattern's engine path at 2 and 4 (test_one_program, test_fsdp).
@pytest.mark.parametrize("program,world", [("pattern1", 4), ("pattern3", 2), ("pattern4", 4)])
def test_seed_patterns_give_one_devices_losses(program, world, seed_oracle):
    out = _compat(HERE / f"{program}.py", world)
    expected = seed_oracle(program)
    got = _losses(out)
    assert got == pytest.approx(expected, rel=RTOL), (got, expected)
    if program != "pattern1":  # FSDPv2: each process keeps a part of the parameters
        p = _params(out)
        assert p["types"] == ["DTensor"] and p["local"] < p["total"] / world * 1.5, p


@pytest.mark.parametrize("world", [2])
def test_seed_pattern2_full_example_gives_one_devices_losses(world, seed_oracle):
    out = _compat(HERE / "pattern2.py", world)
    first, last = seed_oracle("pattern2")
    printed = re.findall(r"Step 0, Loss: ([0-9.]+)", out)
    assert printed == [f"{first:.4f}"], (printed, first)  # the program's own line, printed once
    assert _losses(out) == pytest.approx([last], rel=RTOL)
    p = _params(out)
    assert p["types"] == ["DTensor"] and p["local"] < p["total"] / world * 1.5, p


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The tiny Llama under the program's model name, made once (the programs' processes
    would race to write it)."""
    home = tmp_path_factory.mktemp("hf_home")
    r = subprocess.run([sys.executable, "-c", f"import _setup; _setup.local_hub({str(home)!r})"], cwd=HERE,
                       env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    return home


@pytest.mark.parametrize("world", [4])
def test_optimum_tpu_program_trains_sharded_like_the_stock_trainer(hub, tmp_path, world):
    out = _compat(HERE / "optimum_fsdp_v2.py", world, hub, tmp_path / "out")
    assert _losses(out) == pytest.approx(_oracle_once("optimum", hub, tmp_path.parent / "oracle"), rel=RTOL)
    p = _params(out)
    assert p["types"] == ["DTensor"] and p["local"] < p["total"] / world * 1.5, p


def test_optimum_tpu_program_with_sft_trainer(hub, tmp_path):
    """The block's own alternative, as its comments say: trl's SFTTrainer."""
    text = (HERE / "optimum_fsdp_v2.py").read_text()
    text = text.replace("# from trl import SFTTrainer", "from trl import SFTTrainer", 1)
    text = text.replace("trainer = Trainer(  # or SFTTrainer", "trainer = SFTTrainer(", 1)
    text = text.replace("    data_collator=data_collator,\n", "", 1)  # SFTTrainer brings its own
    assert "from trl import SFTTrainer\n" in text and "trainer = SFTTrainer(" in text
    program = HERE / f"_sft_{tmp_path.name}.py"
    program.write_text(text)
    try:
        out = _compat(program, 2, hub, tmp_path / "out")
    finally:
        program.unlink()
    assert _losses(out) == pytest.approx(_oracle_once("optimum", hub, tmp_path.parent / "oracle_sft", "sft"),
                                         rel=RTOL)
    assert _params(out)["types"] == ["DTensor"]


def _verbatim(path: Path) -> list[str]:
    return re.findall(r"# ---- VERBATIM: [^\n]*\n(.*?)# ---- END VERBATIM ----", path.read_text(), re.S)


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the seed documents are beside the project, not in a clone of it")
def test_the_programs_lines_are_the_seeds_lines():
    xla_doc = next(SEEDS.glob("000_*.txt")).read_text()
    optimum_doc = next(SEEDS.glob("002_*.txt")).read_text()
    for name in ("pattern1", "pattern2", "pattern3", "pattern4"):
        (block,) = _verbatim(HERE / f"{name}.py")
        assert "```python\n" + block + "```" in xla_doc, name
    basic, trainer = _verbatim(HERE / "optimum_fsdp_v2.py")
    assert basic in optimum_doc
    assert trainer.replace("    data_collator=data_collator,\n", "    ...\n") in optimum_doc


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    _compat(HERE / "api_checks.py", 4, d / "out.json", d / "ck")
    return json.loads((d / "out.json").read_text())


def test_counts_and_devices_are_torch_xlas_spmd_view(api):
    # (addressable: the one device each process drives, so that a minibatch share sized by it is one
    # device's; real_devices: the host's)
    assert api["counts"] == dict(global_runtime=4, world_size=1, global_device_count=1, process_count=4,
                                 device_type="CPU", is_spmd=True, addressable_runtime=1, addressable=1,
                                 real_devices=4)
    assert api["device"] == "cpu" and api["xla_device"] == ["cpu"] * 7
    assert api["meta_context"] == ["meta"] * 3
    assert api["autocast_dtype"] == "torch.bfloat16"


def test_steps_run_closures_after_the_step(api):
    assert api["closures"] == [["in step", 0], ["closure", 1], ["after step", 0], ["mark_step", 2]]
    # step(), mark_step(), then compile(fn) (one step), optimizer_step(barrier=True) and sync()
    assert api["optimizer_step_ok"] and api["steps_after_compile_sync"] == 5
    assert api["rate"] and api["samples"] == 3
    assert "Steps ended: 5" in api["metrics"] and api["counter_names"] == []


def test_sharding_strings_follow_xlas_text(api):
    """The layer's strings on 4 processes are those of the XLA text for each case; the same
    cases are checked against torch_xla itself in tests/xla/test_xla_compat_hlo.py."""
    import importlib.util

    import numpy as np

    from torchspmd.layouts import hlo

    spec = importlib.util.spec_from_file_location("sharding_cases", HERE / "sharding_cases.py")
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    want = [hlo.from_partition_spec(np.array(ids).reshape(shape), names, pspec)
            for shape, names, ids, _, pspec in cases.CASES]
    assert api["strings"] == want
    # the sharding type of each, as XLA's OpSharding type reads from the text: replicated (0), tiled (3),
    # tiled with the last dim's tiles replicated (5, torch_xla's PARTIAL); none for a plain tensor
    assert api["plain_type"] is None
    assert api["types"] == [0 if w == "{replicated}" else 5 if "last_tile_dim_replicate" in w else 3 for w in want]


def test_mark_sharding_with_gradients_under_the_switch(api):
    spec, gradient_ok = api["with_gradients"]
    # the text of the first sharding case (the same mesh and spec), which torch_xla's own is checked against
    assert gradient_ok and spec == api["strings"][0], (spec, api["strings"][0])
    assert api["plain_spec"] == "" and api["imported_spec"] == ""
    assert api["fsdp_param_specs"] == ["{devices=[4,1]0,1,2,3}", "{devices=[4]0,1,2,3}"]
    assert api["in_place"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"


def test_checkpoints_saves_and_profiler(api):
    assert api["saved"] == [False, True, False, True, False, True, False]
    assert api["steps"] == [4, 6] and api["restored_ok"] and api["xm_save_ok"]
    assert api["trace_files"] >= 1


def test_libraries_are_not_misled_and_trainers_are_torchspmds(api):
    assert api["transformers_probe"] is False and api["accelerate_probe"] is False
    assert api["trainer_is_ours"] and api["sft_is_ours"]


def test_smaller_names_programs_use(api):
    # a name torch_xla 2.9's xs has is there (a stand-in, failing at use); one it lacks is absent to a probe
    # (wrap_as_sharded_tensor is xla_sharding's, not xs's)
    assert api["probes"] == [True, False, "default", False]
    assert api["initialize_cache"] is None
    assert api["device_count"] == [4, ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]]  # torch_xla's under SPMD: the host's
    assert api["xla_sharding_names"] == [True, True]
    assert api["rendezvous"] == [f"rank {r}" for r in range(4)]  # each process's payload, in rank order
    assert api["checkpoint_grad_equal"]
    assert api["visualized"] == [2, 1]  # dim 0 in 2 tiles (over 'b'), each on 2 devices: 2 rows, 1 column


EQUIVALENT = {
    "xmp.spawn": "torchspmd run --xla-compat --nproc N",
    "torch_xla.launch": "torchspmd run --xla-compat --nproc N",
    "xm.all_reduce": "torch.distributed.all_reduce",
    "from xm import all_gather": "torch.distributed.all_gather",
    "xla_backend.ProcessGroupXla": "init_process_group('xla')",
    "ParallelLoader": "MpDeviceLoader",
    "XlaFullyShardedDataParallel": "SpmdFullyShardedDataParallel",
    "syncfree": "torch.optim",
    "use_spmd(auto=True)": "xs.mark_sharding",
    "_XLAC._xla_get_default_device": None,
    "profiler.trace": "start_trace",
    "xm.set_rng_state": "torch.manual_seed(seed)",
    "a stand-in class's attribute": "SpmdFullyShardedDataParallel",
}
ATTRIBUTE_READ = {"a stand-in class's attribute"}  # an AttributeError: hasattr() is False


@pytest.mark.parametrize("api_name", sorted(EQUIVALENT))
def test_each_unprovided_api_imports_then_fails_at_use_naming_itself_and_its_equivalent(api, api_name):
    """The import succeeded (api_checks.py imports each before using it); the use raised, on every
    process alike."""
    errors = [rank_errors[api_name] for rank_errors in api["errors_by_rank"]]
    assert len(errors) == 4 and all(e == errors[0] for e in errors), errors
    kind, is_import_error, is_attribute_error, text = errors[0]
    assert "is not provided under --xla-compat" in text, text
    if api_name in ATTRIBUTE_READ:
        assert kind == "NotProvidedAttributeError" and is_attribute_error, kind
    else:  # an ImportError too, as torch_xla's missing names: a program's `except ImportError` takes it
        assert kind == "NotProvidedError" and is_import_error, kind
    if EQUIVALENT[api_name]:
        assert EQUIVALENT[api_name] in text, text
    assert api["private_is_attribute_error"]


def test_a_rendezvous_of_some_processes_is_refused(api):
    kind, _, _, text = api["errors_by_rank"][0]["rendezvous of some"]
    assert kind == "SpmdError" and "rendezvous(replicas=[0])" in text and "leave replicas empty" in text, text


def test_torch_xlas_environment_and_topology_names(api):
    assert api["xla_use_spmd"] == "1"  # as torch_xla's use_spmd sets it
    assert api["xenv"] == ["PJRT_DEVICE", "PJRT_LOCAL_PROCESS_COUNT"]  # torch_xla's constants, as they are
    for rank, seen in enumerate(api["topology_by_rank"]):
        real = [f"CPU:{rank}"]
        assert seen == [real, real, real, 4, 4, rank, rank == 0, rank == 0, rank, False, True], (rank, seen)


def test_sharded_tensors_are_xla_sharded_tensors(api):
    is_sharded, plain_is_sharded, text, through, gradient_ok, leaf = api["sharded_tensor"]
    assert is_sharded and not plain_is_sharded
    assert text == "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"  # torch_xla's V1 text for ('a', None)
    assert through == "{devices=[2,2]0,2,1,3}" and gradient_ok and leaf == ""  # MarkShardingFunction: a copy
    is_sharded, kind, leaf_grad, tiled, again = api["constructed"]
    assert is_sharded and kind == "REPLICATED" and leaf_grad
    assert tiled == [[4], [0, None], True] and again == [[2, 2], [0, 1], True, True], (tiled, again)


def test_init_process_group_after_use_spmd_reuses_the_group(api):
    same, world, backend, mismatch, refused = api["process_group"]
    assert same and world == 4 and backend == "gloo"
    kind, _, _, text = mismatch
    assert kind == "SpmdError" and "world_size=5, the group has 4 processes" in text, text
    # the 'xla' backend under SPMD: refused with torch_xla's message, as torch_xla's assert refuses it
    kind, _, _, text = refused
    assert kind == "SpmdError" and "XLA backend is not supported with SPMD" in text, text


def _device_data(world: int) -> dict:
    out = _compat(HERE / "device_data.py", world)
    return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


def test_device_data_tables_and_the_save_planners_index_as_torch_xla():
    """What torch_xla reports (checked against torch_xla itself in tests/xla/test_xla_compat_hlo.py):
    data the loader sent, and a tensor put on the device before a sync, is ``{replicated}``; a
    pending one ``''``; its table draws torch_xla's cells; a write item indexes local_shards."""
    got = _device_data(2)
    assert got["loader_batch"] == "{replicated}" and got["placed_then_synced"] == "{replicated}", got
    assert got["placed"] == "" and got["op_result"] == "", got
    assert got["placed_then_marked"] == "{devices=[2,1]0,1}", got
    assert got["write_items_resolve_to_their_local_shard"] is True
    replicated = got["table {replicated}"]
    assert "CPU [0, 1]" in replicated and replicated.count("CPU") == 1, replicated
    flipped = got["table {devices=[1,2]1,0}"]
    assert flipped.index("CPU 1") < flipped.index("CPU 0"), flipped
    rows = got["table {devices=[8,1,2]0,1,4,5,8,9,12,13,2,3,6,7,10,11,14,15 last_tile_dim_replicate}"]
    assert [l.strip(" │") for l in rows.splitlines() if "CPU" in l][:3] == ["CPU [0, 1]", "CPU [4, 5]", "CPU [8, 9]"]


def test_every_module_and_name_imports_and_what_is_missing_fails_at_use(tmp_path):
    """Every module and name of torch_xla 2.9's manifest under the switch (one process): each
    imports and is one object however imported; every stand-in fails when used, naming its API;
    constants are torch_xla's; what torch_xla lacks raises what torch_xla would."""
    from torchspmd.compat import manifest

    program, result = HERE / "every_name.py", tmp_path / "o.json"
    r = subprocess.run([sys.executable, "-m", "torchspmd.compat", str(program), str(result)], capture_output=True,
                       text=True, env=clean_env(OMP_NUM_THREADS=1), timeout=TIMEOUT, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["import_failures"] == [] and out["same_object"] == [] and out["constants"] == []
    assert out["modules"] == len(manifest.modules())
    assert out["names"] == sum(len(manifest.names(m)) for m in manifest.modules())
    assert len(out["use"]) > 500  # (most of torch_xla's names are XLA's own)
    for api_name, (stands_for, errors) in out["use"].items():
        assert stands_for == api_name
        message = f"{api_name} is not provided under --xla-compat"
        if out["kinds"][api_name] == "class":
            made, subclass_made, attribute, is_instance = errors
            assert made[0] == "NotProvidedError" and made[1].startswith(message), (api_name, made)
            assert subclass_made[0] == "NotProvidedError" and subclass_made[1].startswith(message), api_name
            assert attribute[0] == "NotProvidedAttributeError" and attribute[1].startswith(f"{api_name}.some_attribute")
            assert is_instance is False
        else:
            (called,) = errors
            assert called[0] == "NotProvidedError" and called[1].startswith(message), (api_name, called)
    lacking = out["lacking"]
    assert lacking["name"][:3] == ["AttributeError", False, True]
    assert lacking["from"][:2] == ["ImportError", True] and "cannot import name 'no_such_name'" in lacking["from"][3]
    assert lacking["module"] == ["ModuleNotFoundError", True, False, "No module named 'torch_xla.no_such_module'"]
    # torch_xla's private modules (its tests import torch_xla._internal.tpu) import; a name fails at use
    used = lacking["private module's name used"]
    assert used[0] == "NotProvidedError" and used[3].startswith("torch_xla._internal.tpu.version is not provided")
    assert lacking["private module's dunder"][:3] == ["AttributeError", False, True]
    assert lacking["private _XLAC name"][:3] == ["AttributeError", False, True]
    assert out["xenv"] == ["PJRT_DEVICE", "TPU_MESH_CONTROLLER_ADDRESS", "CPU_NUM_DEVICES"]
    # init_process_group('xla', init_method='xla://') before use_spmd, no launcher: a group of this process,
    # which use_spmd() and a second call then use
    assert out["process_group"] == ["gloo", 1, 0, "gloo", 1]


INIT_FIRST = """
import torch, torch.distributed as dist
import torch_xla.distributed.xla_backend
import torch_xla.runtime as xr
import torch_xla.core.xla_model as xm
dist.init_process_group('xla', init_method='xla://')
group = dist.group.WORLD
xr.use_spmd()
t = torch.ones(1) * (xr.process_index() + 1)
dist.all_reduce(t)
xm.master_print('INIT_FIRST', dist.get_backend(), dist.get_world_size(), dist.group.WORLD is group, float(t))
"""


def test_init_process_group_xla_before_use_spmd_under_a_launcher(tmp_path):
    """A program that starts the 'xla' process group itself (``xla://``), as torch_xla's
    documentation shows, then turns SPMD on: the native backend's group of the launched
    processes, which torchspmd then uses."""
    program = tmp_path / "init_first.py"
    program.write_text(INIT_FIRST)
    out = _compat(program, 2, cwd=tmp_path)
    assert [line for line in out.splitlines() if line.startswith("INIT_FIRST")] == ["INIT_FIRST gloo 2 True 3.0"], out


def test_the_documented_names_are_the_codes():
    """docs/xla_compat.md's tables of torch_xla's names are what ``python -m
    torchspmd.compat.name_table`` makes from the manifest and the layer."""
    r = subprocess.run([sys.executable, "-m", "torchspmd.compat.name_table", "--check"], capture_output=True,
                       text=True, env=clean_env(OMP_NUM_THREADS=1), timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_without_the_switch_nothing_changes():
    code = (
        "import sys, torch\n"
        "before = (list(sys.meta_path), torch.Tensor.to, torch.zeros)\n"
        "import torchspmd, torchspmd.compat\n"
        "assert (list(sys.meta_path), torch.Tensor.to, torch.zeros) == before\n"
        "assert not torchspmd.compat.active()\n"
        "import transformers.utils\n"
        "assert transformers.utils.is_torch_xla_available() is False\n"
        "try:\n"
        "    import torch_xla\n"
        "except ModuleNotFoundError as e:\n"
        "    print('absent', e.name)\n"
        "try:\n"
        "    from optimum.tpu import fsdp_v2\n"
        "except ModuleNotFoundError as e:\n"
        "    print('absent', e.name)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["absent torch_xla", "absent optimum"]


@pytest.mark.parametrize("devices", [1, 2])
def test_python_m_form(tmp_path, devices, seed_oracle):
    """``python -m torchspmd.compat script.py`` (what torchrun ``-m torchspmd.compat`` runs): one
    process, or with CPU_NUM_DEVICES=2 the program started again once per device, under the
    layer too (torch_xla's own way to say how many devices): Pattern 1, one device's losses."""
    env = clean_env(OMP_NUM_THREADS=1, **({"CPU_NUM_DEVICES": devices} if devices > 1 else {}))
    r = subprocess.run([sys.executable, "-m", "torchspmd.compat", str(HERE / "pattern1.py")], capture_output=True,
                       text=True, env=env, timeout=TIMEOUT, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(r.stdout) == pytest.approx(seed_oracle("pattern1"), rel=RTOL)
