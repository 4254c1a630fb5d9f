"""Changes to the Python process itself: its standard output and warnings filter."""

from __future__ import annotations

import os
import sys
import warnings

from torchspmd.patches import Patch, apply, replace_attribute

QUIET_REPLICAS = Patch(
    name="sys.stdout and the warnings filter (processes other than rank 0)",
    library="python",
    what="on every process but rank 0, sys.stdout writes to os.devnull and the warnings filter ignores every "
         "warning (stderr, and so errors and tracebacks, stays)",
    why="the global view: N processes are one program, which prints once, as one process would "
        "(TORCHSPMD_ALL_RANKS_OUTPUT=1 keeps every process's output)",
    versions=">=3.10",  # sys.stdout and warnings.filters: public, stable Python API
    feature="a program's output printed once (the native engine)",
)


def silence_output() -> None:
    """Send this process's ``print`` output to ``os.devnull`` and ignore its warnings."""
    def install():
        sink = open(os.devnull, "w")
        filters = warnings.filters[:]
        undo = replace_attribute(sys, "stdout", sink)
        warnings.simplefilter("ignore")

        def restore():
            warnings.filters[:] = filters
            undo()
            sink.close()

        return restore

    apply(QUIET_REPLICAS, install)
