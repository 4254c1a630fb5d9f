"""Changes to Python's import system: the ``--xla-compat`` module layer."""

from __future__ import annotations

import sys

from torchspmd.patches import Patch, apply

XLA_MODULES = Patch(
    name="sys.meta_path: the torch_xla module layer",
    library="python",
    what="a finder first on sys.meta_path resolves torch_xla.* and optimum.tpu.* to torchspmd's layer and patches "
         "transformers.trainer when it loads",
    why="--xla-compat: torch_xla programs run unchanged, their imports answered by torchspmd",
    versions=">=3.10",  # sys.meta_path finders (PEP 451): public, stable Python API
    feature="--xla-compat",
)


def add_finder(finder) -> None:
    def install():
        sys.meta_path.insert(0, finder)
        return lambda: sys.meta_path.remove(finder)

    apply(XLA_MODULES, install)
