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
