"""Starting one process per device on PyTorch's elastic launcher (torchrun)."""

from __future__ import annotations

import os
import sys

from torchspmd._errors import SpmdError


def _threads_per_process(nproc: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nproc)


def launch(torchrun_args: list[str], nproc: int | None) -> int:
    """Run torchrun with ``torchrun_args`` (its own options, then the program and its
    arguments); return the exit status. Single-host runs get a private rendezvous
    (``--standalone``) unless the arguments name one."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = list(torchrun_args)
    opts = {a.split("=")[0].replace("_", "-") for a in args if a.startswith("--")}
    if nproc is not None:
        args = [f"--nproc-per-node={nproc}"] + args
    if not opts & {"--standalone", "--rdzv-endpoint", "--master-addr", "--nnodes", "--rdzv-backend"}:
        args = ["--standalone"] + args
    parsed = get_args_parser().parse_args(args)
    # Restarted workers must not share the rendezvous store of the failed attempt: with it,
    # they can read the old attempt's peer addresses and fail to connect (pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        per_node = parsed.nproc_per_node
        n = int(per_node) if str(per_node).isdigit() else 1
        os.environ["OMP_NUM_THREADS"] = str(_threads_per_process(n))
    try:
        run(parsed)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        first = sorted(e.failures.items())[0]
        print(
            f"torchspmd: rank {first[0]} failed with exit code {first[1].exitcode} "
            f"(its traceback is printed above)",
            file=sys.stderr,
        )
        code = next((c for c in codes if c > 0), 1)
        return code
    return 0


def relaunch_current_script(nproc: int) -> int:
    """Re-run the running script (``python script.py`` or ``python -m pkg.mod``)
    once per device, the way Lightning Fabric does; return the exit status."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        target = ["-m", spec.name]
    else:
        path = getattr(__main__, "__file__", None)
        if not path or not os.path.exists(path):
            raise SpmdError(
                f"use_spmd(): {nproc} devices are configured but this program is not a script "
                f"file that can be started again (interactive or `python -c`); run it with "
                f"`torchspmd run --nproc {nproc} script.py`, or set TORCHSPMD_NUM_DEVICES=1"
            )
        target = [os.path.abspath(path)]
    return launch(["--max-restarts=0", *target, *sys.argv[1:]], nproc)
