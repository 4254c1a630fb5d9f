"""``python -m torchspmd.compat script.py [args...]`` (or ``-m module [args...]``): run a
torch_xla program under the ``--xla-compat`` layer. ``torchspmd run --xla-compat`` starts
each process this way; so can ``torchrun ... -m torchspmd.compat script.py``."""

from __future__ import annotations

import os
import runpy
import sys

from torchspmd import compat
from torchspmd.errors import SpmdError

USAGE = ("usage: python -m torchspmd.compat script.py [args...]\n"
         "       python -m torchspmd.compat -m module [args...]\n"
         "Run a torch_xla SPMD program unchanged on torchspmd: `import torch_xla ...` resolves to torchspmd.")


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)

    try:
        compat.install()
    except SpmdError as e:  # e.g. a torch the layer's patches were not verified on: said once, no traceback
        print(f"torchspmd --xla-compat: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.isfile(script):
        print(f"torchspmd.compat: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
