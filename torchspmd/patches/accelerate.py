"""Changes to accelerate objects: the ``Accelerator`` a sharded Trainer holds."""

from __future__ import annotations

from typing import Callable

from torchspmd.patches import Patch, apply, replace_attribute

GLOBAL_GATHER = Patch(
    name="accelerate Accelerator.gather / gather_for_metrics (per trainer)",
    library="accelerate",
    what="a sharded trainer's own Accelerator (that instance only) gathers by returning the value: every process "
         "holds the global values already",
    why="gathering global values over the processes would repeat them once per process",
    versions=">=1.15,<1.17",
    feature="torchspmd.hf.Trainer with the FSDPv2 arguments",
    targets=("accelerate:Accelerator.gather", "accelerate:Accelerator.gather_for_metrics"),
)


def gather_globally(accelerator, gather: Callable, gather_for_metrics: Callable) -> None:
    """Set the gathers of ``accelerator`` (the patch is recorded once per process; each
    trainer's accelerator gets its own)."""
    GLOBAL_GATHER.check()
    apply(GLOBAL_GATHER, lambda: None)
    replace_attribute(accelerator, "gather", gather)
    replace_attribute(accelerator, "gather_for_metrics", gather_for_metrics)
