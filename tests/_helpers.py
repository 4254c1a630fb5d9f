"""Helpers shared by the tests: the repository root, a clean environment for subprocesses and
a free port, a reader of DCP checkpoints that shares nothing with torchspmd, and tiny random
Llama models. Standard library only at import time (transformers and torch are imported where
used): clean processes and oracles that must not import torchspmd import it too."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Variables a launcher (torchrun), the test pools or torchspmd set, which a fresh job must not inherit.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "CPU_NUM_DEVICES",
               "TORCHSPMD_NUM_DEVICES", "TORCHSPMD_BACKEND", "TORCHSPMD_ALL_RANKS_OUTPUT", "PJRT_DEVICE")


def clean_env(**extra) -> dict[str, str]:
    """``os.environ`` without the launch variables (``LAUNCH_VARS``), plus ``extra`` (as strings)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def native_python() -> str:
    """The Python of the native engine's environment (torch 2.13 or newer), for tests that run in
    another one (tests/xla's torch 2.9, which the native engine refuses) and compare with it:
    $TORCHSPMD_NATIVE_PYTHON (.ci/run sets it), else the clone's .venv."""
    python = os.environ.get("TORCHSPMD_NATIVE_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists():
        raise AssertionError(f"no native-engine Python at {python}: set TORCHSPMD_NATIVE_PYTHON to a Python with "
                             "torch 2.13-2.15 and the [test] extra (the README's test command makes .venv)")
    return python


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_on_every_rank(results: list):
    """The one result every rank returned (errors included: each rank must raise the same)."""
    assert all(r == results[0] for r in results[1:]), f"the ranks disagree: {results!r}"
    return results[0]


def example_losses(stdout: str) -> dict[int, float]:
    """The examples' printed global losses ("Step N, Loss: L") by step."""
    return {int(s): float(v) for s, v in re.findall(r"Step (\d+), Loss: ([0-9.]+)", stdout)}


def interrupt_when(cmd, ready, cwd, env) -> tuple[int, str, str]:
    """Start ``cmd`` in a session of its own; as soon as ``ready(lines)`` holds for the lines
    its stdout has shown, send SIGINT to its whole process group, as Ctrl-C in a terminal
    does. Returns the exit status, stdout and stderr."""
    import signal
    import subprocess

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                         start_new_session=True)
    seen: list[str] = []
    for line in p.stdout:
        seen.append(line)
        if ready(seen):
            break
    else:
        raise AssertionError(f"{cmd} ended before it was ready:\n{''.join(seen)}\n{p.stderr.read()}")
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return p.returncode, "".join(seen) + out, err


# --- DCP checkpoints, read by torch's own code ---------------------------------------------

_DCP_TO_TORCH = """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
for checkpoint, part in zip(sys.argv[1::2], sys.argv[2::2]):
    dcp_to_torch_save(checkpoint, part)
assert not any(m.startswith("torchspmd") for m in sys.modules), "the checkpoint reader imported torchspmd"
"""


def dcp_states(*checkpoints) -> list[dict]:
    """DCP checkpoints' whole (unsharded) states, as torch's own format utility
    (``dcp_to_torch_save``) assembles them from the shards in one fresh interpreter that never
    imports torchspmd: for a torchspmd checkpoint ``{'model': {name: tensor}, 'optim':
    {'state': ..., 'param_groups': ...}}``, in the order given."""
    import subprocess
    import sys
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        parts = [Path(tmp) / f"state-{i}.pt" for i in range(len(checkpoints))]
        pairs = [str(x) for c, p in zip(checkpoints, parts) for x in (c, p)]
        r = subprocess.run([sys.executable, "-c", _DCP_TO_TORCH, *pairs], capture_output=True, text=True,
                           env=clean_env(), timeout=300, cwd="/")
        assert r.returncode == 0, r.stderr[-4000:]
        return [torch.load(p, weights_only=False) for p in parts]


def dcp_state(checkpoint, keep=None) -> dict:
    """One DCP checkpoint's whole state (``dcp_states``). With ``keep`` (a file), the assembled
    state is kept there and later calls read it back (it is written whole: test runners may
    share it)."""
    import torch

    if keep is not None and Path(keep).exists():
        return torch.load(keep, weights_only=False)
    state = dcp_states(checkpoint)[0]
    if keep is not None:
        part = Path(f"{keep}.{os.getpid()}")
        torch.save(state, part)
        os.replace(part, keep)
    return state


def assert_identical(a, b, where="") -> None:
    """``a`` and ``b`` (states: tensors in dicts, lists, tuples, and plain values) are equal bit
    for bit: the same keys, types, dtypes and values."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def dcp_keys(checkpoint) -> set[str]:
    """The keys a DCP checkpoint's metadata lists (its state dict as DCP flattened it)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)


# --- tiny random Llama models --------------------------------------------------------------

TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)


def tiny_llama_config(**overrides):
    """A ``transformers.LlamaConfig`` of ``TINY_LLAMA``'s sizes, with ``overrides`` (a test's own
    sizes and settings)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_llama(seed=0, **overrides):
    """A random ``transformers.LlamaForCausalLM`` of ``tiny_llama_config(**overrides)``,
    initialised after ``torch.manual_seed(seed)`` (``seed=None``: from the RNG's state)."""
    import torch
    from transformers import LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))
