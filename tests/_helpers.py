"""Helpers shared by the tests: the repository root, a clean environment for subprocesses."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Variables a launcher or the test pool sets, which a fresh job must not inherit.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "CPU_NUM_DEVICES", "TORCHSPMD_NUM_DEVICES", "TORCHSPMD_BACKEND",
               "TORCHSPMD_ALL_RANKS_OUTPUT", "PJRT_DEVICE", "TORCHELASTIC_ERROR_FILE")


def clean_env(**extra) -> dict[str, str]:
    """``os.environ`` without the launch variables, plus ``extra`` (as strings)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


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
