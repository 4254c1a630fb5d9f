"""The XLA backend's tests: run in the torch_xla environment, on 4 CPU devices of one
process (torch_xla's PJRT CPU client), e.g.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=$PWD $(python3 .ci/envs.py python xla) -m pytest tests/xla

Everything in this process shares one XLA runtime in SPMD mode."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ts():
    import torchspmd

    torchspmd.use_spmd()
    return torchspmd
