"""The CPU-only shortcuts, and the one switch that turns every one of them off.

On CPUs the native engine takes shortcuts no accelerator takes, each with a switch of its own:
FSDPv2's shared-memory all-gather and reduce-scatter (``FSDPv2(collectives='auto')`` picks
them for a gloo group on one machine; the gathered parameters themselves in shared memory:
``TORCHSPMD_SHARED_PARAMS``), the replicated parameters' gradient sums through shared memory
(``TORCHSPMD_SHARED_GRADIENTS``), the small sums (losses, token counts, the global-mean
loss's pending sums) through a shared-memory board (``TORCHSPMD_SHARED_SUMS``), the loader
making batches in the program's own thread, and replica digests hashed on the host.

``TORCHSPMD_ACCELERATOR_PATH=1`` turns them all off at once: the program takes the code path
a GPU or a TPU takes — FSDP2's own all-gather and reduce-scatter, DDP's reducer summing
through the backend's all-reduce, every sum through the backend, the loader's background
thread, digests computed by tensor kernels — on gloo, on this machine. CI runs the oracle
subset (the ``smoke`` marker) a second time with it. Every process of a run must see the same
value (the launcher's workers inherit it). A program's explicit ``FSDPv2(collectives='shm')``
is its own choice, not a shortcut, and stays.

What the switch leaves alone is not a shortcut but the CPU's own kernels made exact: the CPU
flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, which DTensor
has no rule for) computed per row, and the recurrent layers run with oneDNN off for the call
(DTensor has no rule for oneDNN's fused layer). An accelerator's attention kernels go to
DTensor's own rules; they cannot run on a CPU.
"""

from __future__ import annotations

import os

SWITCH = "TORCHSPMD_ACCELERATOR_PATH"


def allowed() -> bool:
    """Whether the CPU-only shortcuts may run: not under ``TORCHSPMD_ACCELERATOR_PATH=1``."""
    return os.environ.get(SWITCH, "0").strip() in ("", "0")
