"""The public API on the XLA backend: each call reaches torch_xla, and the shardings torch_xla
records (its debugging API, ``_get_xla_sharding_spec``) are the partition specs asked for.

Oracle for values: the same model and batches in plain PyTorch on the CPU, one device."""

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.distributed.spmd as xs  # noqa: E402
from torch_xla.distributed.parallel_loader import MpDeviceLoader as XlaLoader  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as XlaFSDPv2,
)

RTOL, ATOL = 1e-5, 1e-6  # fp32: XLA's CPU kernels against PyTorch's


def seen(t) -> str:
    """The sharding torch_xla records for ``t``."""
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def expected(mesh_shape, names, spec) -> str:
    """XLA's text for ``spec`` on a mesh with device ids 0..n-1, built device by device: each
    device's tile index per tensor dim is the mixed-radix number of its coordinates on the
    axes that split that dim (first axis outermost); the axes left replicate."""
    axis = {n: i for i, n in enumerate(names)}
    per_dim = [tuple(axis[a] for a in ((e,) if isinstance(e, str) else e)) if e is not None else () for e in spec]
    used = [a for d in per_dim for a in d]
    rest = tuple(a for a in range(len(mesh_shape)) if a not in used)
    tiles = [int(np.prod([mesh_shape[a] for a in d], dtype=int)) for d in per_dim]
    reps = int(np.prod([mesh_shape[a] for a in rest], dtype=int))
    if all(t == 1 for t in tiles):
        return "{replicated}"
    dims = tiles + ([reps] if reps > 1 else [])
    assignment = np.empty(dims, dtype=int)
    for device, coord in enumerate(np.ndindex(*mesh_shape)):
        def index(axes):
            i = 0
            for a in axes:
                i = i * mesh_shape[a] + coord[a]
            return i
        assignment[tuple([index(d) for d in per_dim] + ([index(rest)] if reps > 1 else []))] = device
    text = "{devices=[" + ",".join(map(str, dims)) + "]" + ",".join(map(str, assignment.reshape(-1)))
    return text + (" last_tile_dim_replicate}" if reps > 1 else "}")


def test_the_backend_is_torch_xla(ts):
    import torch_xla.runtime as xr

    assert ts.backend() == "xla" and ts.device_type() == "xla"
    assert ts.device() == torch_xla.device()
    assert ts.global_runtime_device_count() == xr.global_runtime_device_count() == 4
    assert ts.addressable_runtime_device_count() == 4
    assert ts.process_index() == 0 and ts.process_count() == 1
    with ts.step():
        x = torch.ones(3, device=ts.device()) * 2
    assert x.sum().item() == 6 and ts.current_step() >= 1


def test_mesh_is_torch_xla_mesh(ts):
    mesh = ts.Mesh(np.arange(4), (2, 2), ("data", "fsdp"))
    assert isinstance(mesh, xs.Mesh) and isinstance(mesh, ts.Mesh)
    assert mesh.shape() == {"data": 2, "fsdp": 2} and mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3]]
    one = ts.get_1d_mesh("x")
    assert isinstance(one, xs.Mesh) and one.mesh_shape == (4,)
    ts.set_global_mesh(mesh)
    assert ts.get_global_mesh() is mesh and xs.get_global_mesh() is mesh
    hybrid = ts.HybridMesh(ici_mesh_shape=(2, 2), axis_names=("data", "fsdp"))  # one host of 4 CPU devices
    assert isinstance(hybrid, xs.Mesh) and isinstance(hybrid, ts.HybridMesh) and isinstance(hybrid, ts.Mesh)
    assert hybrid.get_logical_mesh().tolist() == [[0, 1], [2, 3]] and hybrid.ici_mesh_shape == (2, 2)
    assert not isinstance(mesh, ts.HybridMesh)
    with pytest.raises(ts.SpmdError, match=r"each host has 4 devices"):
        ts.HybridMesh(ici_mesh_shape=(2, 1))
    with pytest.raises(ts.SpmdError, match=r"not mappable over 4 devices"):
        ts.Mesh(np.arange(2), (2,), ("x",))
    with pytest.raises(ts.SpmdError, match=r"Axis names must be unique, got: \('a', 'a'\): .* repeats 'a'"):
        ts.Mesh(np.arange(4), (2, 2), ("a", "a"))


MESHES = {"4x1": ((4, 1), ("fsdp", "model")), "2x2": ((2, 2), ("data", "fsdp")),
          "4-axes": ((2, 1, 2, 1), ("a", "b", "c", "d"))}
CASES = [
    ("4x1", (8, 6), ("fsdp", None)), ("4x1", (7, 5), (None, "fsdp")), ("4x1", (7, 5), ("model", None)),
    ("4x1", (6,), (None,)), ("4x1", (9, 3), (("fsdp", "model"), None)),
    ("2x2", (8, 6), ("data", None)), ("2x2", (7, 5), (None, "fsdp")), ("2x2", (7, 5), (("data", "fsdp"), None)),
    ("2x2", (6, 7), (("fsdp", "data"), None)), ("2x2", (5, 3, 7), ("fsdp", None, "data")), ("2x2", (9,), ("data",)),
    ("4-axes", (3, 4, 5, 2), ("c", ("b", "d"), "a", None)), ("4-axes", (6, 2, 3, 5), (("c", "a"), None, None, "d")),
]


@pytest.mark.parametrize("mesh_name,shape,spec", CASES, ids=[f"{m}-{s}-{p}" for m, s, p in CASES])
def test_mark_sharding_records_the_spec(ts, mesh_name, shape, spec):
    mesh_shape, names = MESHES[mesh_name]
    mesh = ts.Mesh(np.arange(4), mesh_shape, names)
    value = torch.randn(shape)
    t = ts.mark_sharding(value, mesh, spec)  # a CPU tensor is moved to the device
    assert t.device.type == "xla"
    assert seen(t) == expected(mesh_shape, names, spec)
    torch.testing.assert_close(t.cpu(), value, rtol=0, atol=0)
    # get_sharding reads the spec back (where the axes used have more than one device)
    ts.set_global_mesh(mesh)
    sizes = dict(zip(names, mesh_shape))
    split = [[a for a in ((e,) if isinstance(e, str) else e or ()) if sizes[a] > 1] for e in spec]
    want = tuple(None if not s else s[0] if len(s) == 1 else tuple(s) for s in split)
    assert ts.get_sharding(t) == (None if all(e is None for e in want) else want)


def test_sharding_spec_and_loader_shard_the_inputs(ts):
    mesh = ts.Mesh(np.arange(4), (2, 2), ("data", "fsdp"))
    spec = ts.ShardingSpec(mesh, (("data", "fsdp"), None))
    assert isinstance(spec, xs.ShardingSpec) and isinstance(spec, ts.ShardingSpec)
    batches = [(torch.randn(10, 3), torch.arange(10)) for _ in range(2)]  # 10 rows over 4 devices
    loader = ts.MpDeviceLoader(batches, ts.device(), input_sharding=spec)
    assert isinstance(loader, XlaLoader) and isinstance(loader, ts.MpDeviceLoader)
    got = list(loader)
    assert len(got) == 2
    for (x, y), (x0, y0) in zip(got, batches):
        assert seen(x) == expected((2, 2), ("data", "fsdp"), (("data", "fsdp"), None))
        assert seen(y) == "{replicated}"  # torch_xla leaves a tensor the spec doesn't fit replicated
        torch.testing.assert_close(x.cpu(), x0, rtol=0, atol=0)
        assert y.cpu().tolist() == y0.tolist()
    with pytest.raises(ts.SpmdError, match=r"fixed_batch_size=True\) is not available on the torch_xla engine"):
        ts.MpDeviceLoader(batches, ts.device(), input_sharding=spec, fixed_batch_size=True)
    with pytest.raises(ts.SpmdError, match=r"no None values"):
        ts.shard_batch({"a": torch.randn(6, 2)}, {"a": None})
    both = ts.shard_batch({"a": torch.randn(6, 2), "b": torch.randn(6)},
                          {"a": ts.ShardingSpec(mesh, ("fsdp", None)), "b": ts.ShardingSpec(mesh, ("data",))})
    assert seen(both["a"]) == expected((2, 2), ("data", "fsdp"), ("fsdp", None))
    assert seen(both["b"]) == expected((2, 2), ("data", "fsdp"), ("data",))


def test_visualize_and_clear_sharding(ts, capsys):
    mesh = ts.Mesh(np.arange(4), (2, 2), ("data", "fsdp"))
    t = ts.mark_sharding(torch.randn(4, 6), mesh, ("data", "fsdp"))
    ts.visualize_tensor_sharding(t, use_color=False)
    shown = capsys.readouterr().out
    assert all(f"CPU {i}" in shown for i in range(4))  # torch_xla's table: one block per device
    ts.visualize_sharding(seen(t), use_color=False)  # the HLO text, as torch_xla's visualize_sharding takes
    assert capsys.readouterr().out.count("CPU ") == 4
    assert ts.clear_sharding(t) is t and seen(t) == ""


def test_bad_partition_specs_are_named(ts):
    mesh = ts.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    x = torch.randn(4, 4)
    with pytest.raises(ts.SpmdError, match=r"Partition spec length \(1\) should be equal to the input rank \(2\)"):
        ts.mark_sharding(x, mesh, ("fsdp",))
    with pytest.raises(ts.SpmdError, match=r"axis name 'data' is not defined in the mesh"):
        ts.mark_sharding(x, mesh, ("data", None))
    with pytest.raises(ts.SpmdError, match=r"mesh axis 'fsdp' appears in partition_spec\[0\] and partition_spec\[1\]"):
        ts.mark_sharding(x, mesh, ("fsdp", "fsdp"))
    with pytest.raises(ts.SpmdError, match=r"axis name 'x' is not defined"):
        ts.ShardingSpec(mesh, ("x", None))


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Uneven sizes everywhere: 5 -> 6 -> (6 -> 10 -> 6) x 2 -> 3 classes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList([Block(6, 10), Block(6, 10)])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h), h


def _wrap(ts, model, how):
    mesh = ts.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    if how == "policy":
        return ts.FSDPv2(model, mesh, auto_wrap_policy=functools.partial(
            ts.transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    if how == "by-hand":  # nested: inner units first, then the root
        for i, b in enumerate(model.blocks):
            model.blocks[i] = ts.FSDPv2(ts.checkpoint_module(b), mesh)
        return ts.FSDPv2(model, mesh)
    return ts.FSDPv2(model, mesh)


def _batches(n=3, rows=10):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("how", ["root", "policy", "by-hand"])
def test_fsdpv2_matches_one_device(ts, how):
    torch.manual_seed(0)
    ref = Net()
    model = _wrap(ts, copy.deepcopy(ref), how)
    assert isinstance(model, XlaFSDPv2) and isinstance(model, ts.FSDPv2)
    names = [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == list(ref.state_dict())
    # Parameters: torch_xla's FSDPv2 rule, the largest dim over 'fsdp' (uneven sizes padded)
    for n, p in model.named_parameters():
        spec = [None] * p.dim()
        spec[list(p.shape).index(max(p.shape))] = "fsdp"
        assert seen(p) == expected((4, 1), ("fsdp", "model"), spec), n
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.05), torch.optim.Adam(ref.parameters(), lr=0.05)
    spec = ts.ShardingSpec(ts.Mesh(np.arange(4), (4, 1), ("fsdp", "model")), ("fsdp", None))
    for (x, y), (x0, y0) in zip(ts.MpDeviceLoader(_batches(), ts.device(), input_sharding=spec), _batches()):
        with ts.step():
            logits, hidden = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            norm = ts.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
        # every output tensor with the batch on dim 0 is split like the batch
        assert seen(logits) == seen(hidden) == expected((4, 1), ("fsdp", "model"), ("fsdp", None))
        ref_logits, _ = ref(x0)
        ref_loss = F.cross_entropy(ref_logits, y0)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(norm.cpu(), ref_norm, rtol=RTOL, atol=ATOL)
    full = ts.full_state_dict(model)
    for n, p in ref.state_dict().items():
        torch.testing.assert_close(full[n], p, rtol=RTOL, atol=ATOL)


def test_fsdpv2_refuses_what_torch_xla_lacks(ts):
    mesh = ts.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    for kwargs, match in [({"cpu_offload": True}, r"cpu_offload=True\) is not available on the torch_xla engine"),
                          ({"collectives": "shm"}, r"collectives='shm'\) is not available"),
                          ({"reshard_after_forward": False}, r"reshard_after_forward=False\) is not available"),
                          ({"mixed_precision": "fp16"}, r"mixed_precision='fp16'\) on the torch_xla engine"),
                          ({"compile": {"mode": "max-autotune"}}, r"compile=\{...\}\)")]:
        with pytest.raises(ts.SpmdError, match=match):
            ts.FSDPv2(Net(), mesh, **kwargs)
    with pytest.raises(ValueError, match="'fsdp'"):
        ts.FSDPv2(Net(), ts.Mesh(np.arange(4), (4,), ("data",)))
    with pytest.raises(ts.SpmdError, match=r"'context' axis of 2 is the native engine's.*backend='native'"):
        ts.FSDPv2(Net(), ts.Mesh(np.arange(4), (2, 2), ("fsdp", "context")))
    wrapped = ts.FSDPv2(Net(), mesh)
    with pytest.raises(ts.SpmdError, match="apply checkpoint_module before FSDPv2"):
        ts.checkpoint_module(wrapped)
    with pytest.raises(RuntimeError, match="already wrapped"):
        ts.FSDPv2(wrapped, mesh)


def test_bf16_maps_to_autocast(ts):
    mesh = ts.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    model = ts.FSDPv2(Net(), mesh, mixed_precision="bf16")
    logits, _ = model(torch.randn(8, 5).to(ts.device()))
    assert logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    loss = F.cross_entropy(logits.float(), torch.zeros(8, dtype=torch.long, device=ts.device()))
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_full_state_dict_round_trip_keeps_the_sharding(ts):
    mesh = ts.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    model = _wrap(ts, Net(), "policy")
    before = {n: seen(p) for n, p in model.named_parameters()}
    new = {k: torch.randn_like(v) for k, v in ts.full_state_dict(model).items()}
    assert ts.load_full_state_dict(model, new) == []
    for n, p in model.named_parameters():
        assert seen(p) == before[n], n
        torch.testing.assert_close(p.cpu(), new[n], rtol=0, atol=0)
    with pytest.raises(ts.SpmdError, match=r"'head.weight' has shape \(4, 6\) in the state dict"):
        ts.load_full_state_dict(model, {**new, "head.weight": torch.zeros(4, 6)})
    del mesh


def test_checkpoints_save_and_load_in_place(ts, tmp_path):
    from torchspmd import checkpoint as ckpt

    torch.manual_seed(0)
    model = _wrap(ts, Net(), "policy")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)

    def train_step(x, y):
        with ts.step():
            F.cross_entropy(model(x.to(ts.device()))[0], y.to(ts.device())).backward()
            opt.step()
            opt.zero_grad()

    (x, y), (x2, y2), _ = _batches()
    train_step(x, y)
    path = ckpt.save(tmp_path, 1, model, opt, {"step": 1}, "")
    assert path.name == "step-00000001" and ckpt.latest_checkpoint(tmp_path) == path
    params = {n: p.cpu() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].cpu() for n, p in model.named_parameters()}
    shardings = {n: seen(p) for n, p in model.named_parameters()}
    train_step(x2, y2)
    assert ckpt.load(path, model, opt)["step"] == 1
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.cpu(), params[n], rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg"].cpu(), moments[n], rtol=0, atol=0)
        assert seen(p) == shardings[n]
    # a fresh model and optimizer (no state yet) load it too
    torch.manual_seed(5)
    fresh = _wrap(ts, Net(), "policy")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05, weight_decay=0.1)
    ckpt.load(path, fresh, fresh_opt)
    for n, p in fresh.named_parameters():
        torch.testing.assert_close(p.cpu(), params[n], rtol=0, atol=0)
        torch.testing.assert_close(fresh_opt.state[p]["exp_avg"].cpu(), moments[n], rtol=0, atol=0)
    # the next step from the loaded state is the next step of the original
    train_step(x2, y2)
    with ts.step():
        F.cross_entropy(fresh(x2.to(ts.device()))[0], y2.to(ts.device())).backward()
        fresh_opt.step()
        fresh_opt.zero_grad()
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        torch.testing.assert_close(q.cpu(), p.cpu(), rtol=RTOL, atol=ATOL)


def test_checkpoint_of_another_model_is_refused(ts, tmp_path):
    from torchspmd import checkpoint as ckpt

    model = _wrap(ts, Net(), "root")
    opt = torch.optim.Adam(model.parameters())
    path = ckpt.save(tmp_path, 3, model, opt, {"step": 3}, "")

    class Wider(Net):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(6, 4)

    other = _wrap(ts, Wider(), "root")
    with pytest.raises(ts.SpmdError, match=r"'head.weight' has shape \(3, 6\) there and \(4, 6\) in this model"):
        ckpt.load(path, other, torch.optim.Adam(other.parameters()))


def test_replicate_is_data_parallel_under_gspmd(ts):
    torch.manual_seed(0)
    ref = Net()
    model = ts.replicate(copy.deepcopy(ref))
    assert next(model.parameters()).device.type == "xla"
    mesh = ts.Mesh(np.arange(4), (4,), ("data",))
    (x, y), *_ = _batches()
    xd = ts.mark_sharding(x, mesh, ("data", None))
    loss = F.cross_entropy(model(xd)[0], y.to(ts.device()))
    loss.backward()
    ref_loss = F.cross_entropy(ref(x)[0], y)
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=RTOL, atol=ATOL)
    with pytest.raises(ts.SpmdError, match=r"replicate\(bucket_cap_mb=...\)"):
        ts.replicate(Net(), bucket_cap_mb=10)


def test_a_device_count_pjrt_does_not_show_names_its_source():
    import subprocess
    import sys

    from _helpers import clean_env

    env = clean_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TORCHSPMD_NUM_DEVICES="2")
    r = subprocess.run([sys.executable, "-c", "import torchspmd as ts; ts.use_spmd()"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "TORCHSPMD_NUM_DEVICES = 2: torch_xla drives all 4 devices of this host from one process" in r.stderr


def test_the_native_engine_refuses_this_torch(tmp_path):
    """This environment's torch (2.9, for torch_xla 2.9) lacks DTensor rules the native engine
    relies on: without PJRT_DEVICE, use_spmd() refuses to start, once, before any process is
    launched, naming the torch versions the engine supports and the XLA way."""
    import subprocess
    import sys

    import torch
    from _helpers import clean_env

    env = clean_env(TORCHSPMD_NUM_DEVICES="2")
    script = tmp_path / "p.py"
    script.write_text("import torchspmd as ts\nts.use_spmd()\nprint('ran', ts.backend())\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "ran" not in r.stdout, r.stderr[-3000:]
    want = f"the native engine (cpu) supports torch>=2.13,<2.16, and this is torch {torch.__version__}"
    assert r.stderr.count(want) == 1, r.stderr[-3000:]
    assert "PJRT_DEVICE set or TORCHSPMD_BACKEND=xla" in r.stderr


def test_pipeline_stages_are_refused_naming_the_native_engine(ts):
    """torch_xla has no pipeline stages: ts.pipeline says so, and what runs them."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mesh = ts.Mesh(np.arange(4), (2, 2), ("pipeline", "fsdp"))
    with pytest.raises(ts.SpmdError, match="the xla engine has no pipeline stages; run on the native engine"):
        ts.pipeline(model, mesh, split=nn.Linear, microbatches=2)
