"""The CUDA path, structurally, on a machine without CUDA: ``torch.cuda`` is mocked
(``is_available``, ``device_count``, ``set_device``) and ``torch.accelerator`` finds it and ``init_process_group`` records its
arguments, then makes a one-process gloo group so that the rest of ``use_spmd()`` runs (no
NCCL is started). Each scenario runs in a fresh process (``_clean.run_clean``): the mocks,
``use_spmd()``'s module state (``torchspmd.runtime._STATE``) and its global view end with it.
"""

import os

from _clean import run_clean


def _mock_cuda(devices: int) -> list:
    """Mock CUDA with ``devices`` GPUs in this (fresh) process; return the list the mocks
    record their calls into."""
    import torch
    import torch.distributed as dist

    calls: list = []
    real_init = dist.init_process_group

    def init_process_group(backend=None, **kwargs):
        calls.append(("init_process_group", backend, sorted(kwargs)))
        real_init("gloo", store=dist.HashStore(), rank=0, world_size=1)

    torch.cuda.is_available = torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
    torch.cuda.device_count = torch.accelerator.device_count = lambda: devices
    torch.cuda.set_device = torch.accelerator.set_device_index = lambda device: calls.append(("set_device", device))
    dist.init_process_group = init_process_group
    return calls


def _launched_rank(env: dict):
    """``use_spmd()`` in a process torchrun started (``env``) on a machine with 4 GPUs."""
    os.environ.update(env)
    calls = _mock_cuda(4)
    import torchspmd as ts

    ts.use_spmd()
    return ts.backend(), str(ts.device()), ts.device_type(), calls


def test_cuda_is_chosen_when_available_with_nccl_and_the_local_rank_device():
    env = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")
    backend, device, device_type, calls = run_clean(_launched_rank, env, allow_torchspmd=True)
    assert (backend, device, device_type) == ("cuda", "cuda:1", "cuda")
    # torchrun's environment is the rendezvous: no store, rank or world size passed
    assert calls == [("init_process_group", "cpu:gloo,cuda:nccl", []), ("set_device", 1)]


def test_torchspmd_backend_cpu_overrides_cuda():
    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1", TORCHSPMD_BACKEND="cpu")
    backend, device, device_type, calls = run_clean(_launched_rank, env, allow_torchspmd=True)
    assert (backend, device, device_type) == ("cpu", "cpu", "cpu")
    assert calls == [("init_process_group", "gloo", [])]  # and no set_device


def _unlaunched(devices: int, env: dict):
    """``python train.py`` (no launcher) on a machine with ``devices`` GPUs: the number of
    processes ``use_spmd()`` relaunches the script with (None: it did not relaunch)."""
    os.environ.update(env)
    calls = _mock_cuda(devices)
    import torchspmd as ts
    from torchspmd.launch import launcher as _launch

    relaunched = []

    def relaunch_current_script(nproc):
        relaunched.append(nproc)
        return 0

    _launch.relaunch_current_script = relaunch_current_script
    counts = (ts.global_runtime_device_count(), ts.local_device_count())
    try:
        ts.use_spmd()
    except SystemExit as e:  # the parent exits with the children's status
        assert e.code == 0 and not calls, (e.code, calls)
        return relaunched, counts, None, calls
    return relaunched, counts, str(ts.device()), calls


def test_a_plain_run_relaunches_once_per_gpu():
    relaunched, counts, device, calls = run_clean(_unlaunched, 3, {}, allow_torchspmd=True)
    assert relaunched == [3] and counts == (3, 3) and device is None and calls == []


def test_one_gpu_or_torchspmd_num_devices_1_runs_in_process():
    for devices, env in ((1, {}), (4, {"TORCHSPMD_NUM_DEVICES": "1"})):
        relaunched, counts, device, calls = run_clean(_unlaunched, devices, env, allow_torchspmd=True)
        assert relaunched == [] and counts == (1, 1) and device == "cuda:0"
        # a one-process group of its own (no launcher, so no rendezvous)
        assert calls == [("init_process_group", "cpu:gloo,cuda:nccl", ["rank", "store", "world_size"]),
                         ("set_device", 0)]


def _collective_choices():
    """``collectives.choose`` for each ``collectives=`` setting, for an FSDP2 unit (its state
    as ``choose`` reads it) with its parameters on a CUDA device, and on the CPU, over a real
    one-process gloo group."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from torchspmd import SpmdError
    from torchspmd.engines.native.communication import collectives

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        group = SimpleNamespace(mesh_info=SimpleNamespace(shard_process_group=dist.group.WORLD), device=device)
        unit = SimpleNamespace(_get_fsdp_state=lambda group=group: SimpleNamespace(_fsdp_param_groups=[group]))
        for choice in collectives.CHOICES:
            try:
                out[device.type, choice] = collectives.choose(choice, unit)
            except SpmdError as e:
                out[device.type, choice] = f"SpmdError: {e}"
    return out


def test_fsdpv2_keeps_fsdp2_collectives_on_nccl():
    out = run_clean(_collective_choices, allow_torchspmd=True)
    assert out["cuda", "auto"] == "native"  # NCCL: FSDP2's own all-gather and reduce-scatter
    assert out["cuda", "native"] == "native" and out["cuda", "allreduce"] == "allreduce"
    assert out["cuda", "shm"].startswith("SpmdError: FSDPv2(collectives='shm'): shared-memory collectives need CPU")
    # the same group with the parameters on the CPU (gloo): the shared-memory collectives
    assert out["cpu", "auto"] == "shm" and out["cpu", "shm"] == "shm"


def _privateuse1_rank(env: dict, pg_backend: str | None):
    """``use_spmd()`` in a process torchrun started, on a machine whose accelerator is a PrivateUse1
    device (named ``'tpu'``, as TorchTPU names its own) with 4 devices: its device module is a
    stand-in registered the way such a backend registers its own (``torch._register_device_module``),
    whose counts and device setters refuse callers outside torch as TorchTPU's do on torch >= 2.11
    (reached through ``torch.accelerator``, mocked here, instead)."""
    import types

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    if pg_backend:
        os.environ["TORCHSPMD_PG_BACKEND"] = pg_backend
    calls: list = []
    torch.utils.rename_privateuse1_backend("tpu")
    module = types.ModuleType("fake_tpu")

    def internal(name):
        def refuse(*args):
            raise RuntimeError(f"{name} is internal to TorchTPU and can only be called by the PyTorch framework "
                               f"(torch and torch_tpu). Use torch.accelerator.{name} instead.")
        return refuse

    for name in ("is_available", "device_count", "set_device", "current_device", "synchronize", "get_rng_state"):
        setattr(module, name, internal(name))
    module.default_generators = tuple(torch.Generator().manual_seed(i) for i in range(4))
    torch._register_device_module("tpu", module)
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("tpu")
    torch.accelerator.is_available = lambda: True
    torch.accelerator.device_count = lambda: 4
    torch.accelerator.set_device_index = lambda i: calls.append(("set_device", i))
    torch.accelerator.current_device_index = lambda: 1
    real_init = dist.init_process_group

    def init_process_group(backend=None, **kwargs):
        calls.append(("init_process_group", backend))
        real_init("gloo", store=dist.HashStore(), rank=0, world_size=1)

    dist.init_process_group = init_process_group
    import torchspmd as ts
    from torchspmd import accelerators

    try:
        ts.use_spmd()
    except ts.SpmdError as e:
        return "SpmdError", str(e), calls
    state = accelerators.rng_state("tpu")  # the current device's generator, not the refused get_rng_state
    accelerators.set_rng_state("tpu", module.default_generators[3].get_state(), 1)
    rng = (torch.equal(state, torch.Generator().manual_seed(1).get_state()),
           torch.equal(module.default_generators[1].get_state(), module.default_generators[3].get_state()))
    return (ts.backend(), str(ts.device()), accelerators.pg_spec("tpu"), rng), None, calls


def test_a_privateuse1_accelerator_is_found_and_its_process_group_backend_named():
    """A device that is neither CPU nor CUDA needs no edit in the package: found through
    torch.accelerator, its devices counted and set through its device module; its process-group
    backend is c10d's for its type, else named ($TORCHSPMD_PG_BACKEND), else the error says how."""
    env = dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")
    got, error, calls = run_clean(_privateuse1_rank, env, "tpu_pg", allow_torchspmd=True)
    assert error is None, error
    assert got == ("tpu", "tpu:1", "cpu:gloo,tpu:tpu_pg", (True, True))
    assert calls == [("init_process_group", "cpu:gloo,tpu:tpu_pg"), ("set_device", 1)]
    kind, error, calls = run_clean(_privateuse1_rank, env, None, allow_torchspmd=True)
    assert kind == "SpmdError", (kind, error)
    assert "no process-group backend is known for device type 'tpu'" in error and "TORCHSPMD_PG_BACKEND" in error
    assert calls == []  # nothing started
