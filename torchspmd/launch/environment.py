"""The variables a launch reads and sets: how many processes, whether a launcher started this
process, whether every rank prints."""

from __future__ import annotations

import os

from torchspmd.errors import SpmdError

ENV_NUM_DEVICES = "TORCHSPMD_NUM_DEVICES"  # local processes to use, any device type
XLA_CPU_NUM_DEVICES = "CPU_NUM_DEVICES"  # torch_xla's name, honoured on CPU too
ALL_RANKS_OUTPUT = "TORCHSPMD_ALL_RANKS_OUTPUT"


def all_ranks_output() -> bool:
    """``TORCHSPMD_ALL_RANKS_OUTPUT`` set to anything but ``0`` (or empty): every rank prints."""
    return os.environ.get(ALL_RANKS_OUTPUT, "").strip() not in ("", "0")


def launched() -> bool:
    """True when a launcher (torchrun, torchspmd run) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def parse_count(value: str, source: str, unset: str = "set it to the number of processes to run, or unset it") -> int:
    """``value`` (of ``source``, an option or a variable) as a number of devices, at least 1."""
    try:
        n = int(value)
    except ValueError:
        raise SpmdError(f"{source}={value!r} is not an integer; set it to the number of devices") from None
    if n < 1:
        raise SpmdError(f"{source}={n}: the number of devices must be at least 1; {unset}")
    return n
