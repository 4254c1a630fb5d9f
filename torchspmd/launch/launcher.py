"""Starting one process per device on PyTorch's elastic launcher (torchrun).

``launch`` runs torchrun's agent in this process with the workers as forks of it (sharing
its imported torch and the program's leading imports) or as new Pythons
(``TORCHSPMD_START_METHOD=subprocess``); ``relaunch_current_script`` is what ``use_spmd()``
does for ``python script.py`` with several devices. When the job fails, the launcher prints
the summary of ``failures``; Ctrl-C gives one line and status 130.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from torchspmd import patches
from torchspmd.launch import failures
from torchspmd.launch.failures import AgentLog, on_interrupt, summarize
from torchspmd.launch.host import (
    MALLOC_ENV,
    MALLOPT,
    allocator_env,
    apply_malloc_settings,
    bind_switch,
    bind_to_cores,
    threads_per_process,
)
from torchspmd.errors import SpmdError
from torchspmd.patches import elastic as elastic_patches
from torchspmd.patches import imports as import_patches

START_METHOD_ENV = "TORCHSPMD_START_METHOD"
_START_METHODS = ("fork", "subprocess")


def _start_method(parsed) -> str:
    method = os.environ.get(START_METHOD_ENV, "")
    if method and method not in _START_METHODS:
        raise SpmdError(f"{START_METHOD_ENV}={method!r}: expected 'fork' (a fork of the launcher runs the program; "
                        "the default on Linux without CUDA) or 'subprocess' (torchrun's: a new Python per worker)")
    if parsed.no_python or parsed.run_path:  # torchrun's own ways of running the program: kept
        return "subprocess"
    if method:
        return method
    if not sys.platform.startswith("linux"):
        return "subprocess"
    from torchspmd import accelerators

    # A process that has initialised an accelerator (CUDA's runtime) cannot be forked into its workers.
    return "subprocess" if accelerators.current() is not None else "fork"


#: Libraries whose import a forked worker would repeat (1-3 s and 40-170 MB each per process):
#: the launcher runs a program's leading imports of them before it forks (``_preload``).
PRELOAD = ("transformers", "trl", "peft", "datasets", "accelerate")
PRELOAD_SWITCH = "TORCHSPMD_PRELOAD"
_COMPAT_PREFIXES = ("torch_xla", "optimum.tpu")


def _leading_imports(path: str, compat: bool) -> list:
    """The import statements of :data:`PRELOAD`'s libraries at the top of the program at
    ``path``, in order, up to its first statement that could change what an import does
    (anything but a docstring, ``from __future__``, or an import of a module already loaded
    here, of the standard library, of a :data:`PRELOAD` library, or under ``--xla-compat`` of
    ``torch_xla`` / ``optimum.tpu``). A library the program's own directory shadows is not
    taken."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    here = os.path.dirname(os.path.abspath(path))

    def kind(name: str) -> str:
        top = name.split(".")[0]
        if compat and any(name == p or name.startswith(p + ".") for p in _COMPAT_PREFIXES):
            return "pass"
        if top in PRELOAD:
            shadowed = os.path.exists(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top))
            return "stop" if shadowed else "preload"
        if top in sys.modules or top in sys.stdlib_module_names:
            return "pass"
        return "stop"

    out = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.Import):
            kinds = [kind(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            kinds = [kind(node.module)]
        else:
            break
        if "stop" in kinds:
            break
        if "preload" in kinds:
            out.append(node)
    return out


def _preload(path: str, compat: bool) -> list[str]:
    """Import what the program at ``path`` imports first from :data:`PRELOAD`'s libraries
    (``_leading_imports``), here, before the workers are forked: they find those modules
    loaded, their pages shared, instead of each importing them (as the launcher's torch).
    ``from m import a`` also reads ``m.a`` (transformers loads its model classes at that
    point). The first failure ends it, silently: the workers then meet it themselves, as
    the program would. ``TORCHSPMD_PRELOAD=0`` turns it off. Returns the modules imported."""
    import ast
    import importlib

    if os.environ.get(PRELOAD_SWITCH, "1") == "0":
        return []
    done = []
    for node in _leading_imports(path, compat):
        try:
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name == "*":
                        continue
                    try:
                        getattr(module, alias.name)
                    except AttributeError:
                        importlib.import_module(f"{node.module}.{alias.name}")
                done.append(node.module)
            else:
                for alias in node.names:
                    if alias.name.split(".")[0] in PRELOAD:
                        importlib.import_module(alias.name)
                        done.append(alias.name)
        except Exception:  # noqa: BLE001 - the worker's own import raises it, as in the program
            break
    return done


def run_program(program: str, *args: str) -> None:
    """A forked worker's entry point (``TORCHSPMD_START_METHOD=fork``): run the program as
    ``python -u program args...`` (``program`` ``"-m"``: ``python -u -m module args...``)
    would: as ``__main__``, with that ``sys.argv`` and ``sys.path[0]``, the signal handlers
    and malloc settings of a new process, line-buffered output (one write per line, so the
    lines of ranks that print at once do not mix, as ``python -u``'s can), and at the end its non-daemon
    threads waited for, then its ``atexit`` handlers run. An uncaught exception goes to ``sys.excepthook`` (where ``use_spmd()`` records
    it for the summary and torch prints it with its ``[rankN]:`` prefix) and exits with
    status 1, as in a new process."""
    import atexit
    import runpy

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)  # the agent's handlers (its SignalException) are not the program's
    signal.signal(signal.SIGINT, on_interrupt)
    apply_malloc_settings({k: v for k, v in os.environ.items() if k in MALLOPT and MALLOC_ENV.get(k) == v})
    bind_to_cores()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # OpenMP read the launcher's environment when torch loaded
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):
        # Not write-through: print() writes its text and its end separately, and unbuffered
        # (python -u, PYTHONUNBUFFERED) each is a write of its own, so the output of ranks
        # printing at the same time interleaves mid-line. Held until the newline (or "\r", or a
        # flush), a line is one write.
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):
            pass
    code, interrupted = 0, False
    try:
        if program == "-m":
            sys.argv = list(args)
            sys.path[0] = os.getcwd()
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [program, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(program))
            runpy.run_path(program, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # noqa: BLE001 - printed and recorded as Python would, then exit 1
        if not failures.interrupted():  # after Ctrl-C (or the launcher's SIGINT) the launcher's one line says it
            sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt) or failures.interrupted()
    finally:
        import threading

        # as the interpreter ends: wait for the program's non-daemon threads, then atexit
        getattr(threading, "_shutdown", lambda: None)()
        atexit._run_exitfuncs()
    if interrupted:
        # Python ends a program that a KeyboardInterrupt ended by SIGINT, so that whoever
        # started it sees the interrupt (exit status 128 + 2 in a shell)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code not in (0, None):
        raise SystemExit(code)


def _forked(parsed) -> None:
    """Set ``parsed`` (torchrun's arguments) to start the workers as forks running
    :func:`run_program`; prepare the launcher for being forked."""
    import gc

    # torch._dynamo (0.7 s to import) is imported by the first optimizer step, by FSDP2's
    # sharding and by DTensor in every training program: imported here, before the fork, its
    # pages are the launcher's, shared by the workers, and n workers on fewer cores do not
    # import it one after another.
    import torch._dynamo  # noqa: F401
    import torch.distributed.run as torchrun

    elastic_patches.report_every_failure(failures.every_failure)

    if parsed.module:
        parsed.training_script_args = [parsed.training_script, *parsed.training_script_args]
        parsed.training_script, parsed.module = "-m", False
    program, args = parsed.training_script, parsed.training_script_args
    if program == "-m" and args[:1] == ["torchspmd.compat"] and len(args) > 1 and args[1] != "-m":
        _preload(args[1], compat=True)
    elif program != "-m":
        _preload(program, compat=False)
    parsed.run_path, parsed.start_method = True, "fork"
    torchrun.run_script_path = run_program  # the entry point torchrun's run_path starts
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()
    gc.freeze()  # the collector does not touch (copy) the launcher's objects in the workers


def launch(torchrun_args: list[str], nproc: int | None) -> int:
    """Run torchrun with ``torchrun_args`` (its own options, then the program and its
    arguments); return the exit status. Single-host runs get a private rendezvous
    (``--standalone``) unless the arguments name one. Workers are forks of this process
    unless ``TORCHSPMD_START_METHOD=subprocess`` (:data:`START_METHOD_ENV`). On failure,
    print the summary (``summarize``) on stderr."""
    import torch.distributed.run as torchrun
    from torch.distributed.run import get_args_parser, run

    args = list(torchrun_args)
    opts = {a.split("=")[0].replace("_", "-") for a in args if a.startswith("--")}
    if nproc is not None:
        args = [f"--nproc-per-node={nproc}"] + args
    if not opts & {"--standalone", "--rdzv-endpoint", "--master-addr", "--nnodes", "--rdzv-backend"}:
        args = ["--standalone"] + args
    parsed = get_args_parser().parse_args(args)
    elastic_patches.quick_rendezvous_names()
    # Restarted workers must not share the rendezvous store of the failed attempt: with it,
    # they can read the old attempt's peer addresses and fail to connect (pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        per_node = parsed.nproc_per_node
        n = int(per_node) if str(per_node).isdigit() else 1
        os.environ["OMP_NUM_THREADS"] = str(threads_per_process(n))
    os.environ.update(allocator_env(os.environ))
    bind_switch(os.environ)  # a wrong value is an error here, not in every worker
    fork = _start_method(parsed) == "fork"
    if fork:
        entry = torchrun.run_script_path
        _forked(parsed)
    # With restarts allowed, the agent's lines are the only word of an attempt that failed.
    agent_log = AgentLog(quiet=int(parsed.max_restarts) == 0)
    logger = logging.getLogger(failures.AGENT_LOGGER)
    logger.addFilter(agent_log)
    oom_at_start = failures.oom_kills()
    try:
        run(parsed)
    except ChildFailedError as e:
        text, code = summarize(e.failures, agent_log.stopped, oom_at_start)
        print(text, file=sys.stderr, flush=True)
        return code
    except SignalException as e:  # Ctrl-C, or a signal to the launcher: its workers were stopped
        name = getattr(e.sigval, "name", str(e.sigval))
        print(f"torchspmd: interrupted ({name}): the workers were stopped", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        logger.removeFilter(agent_log)
        if fork:
            torchrun.run_script_path = entry
            # The launcher's objects were frozen for the forks (gc.freeze): let the collector
            # have them again, so that what extension modules (triton, imported by torch._dynamo
            # in torch's CUDA builds) hold is freed before the interpreter ends instead of being
            # reported as leaked there ("nanobind: leaked ...").
            import gc

            gc.unfreeze()
            gc.collect()
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
    if patches.is_active(import_patches.XLA_MODULES.name):  # under --xla-compat: the children run under it too
        target = ["-m", "torchspmd.compat", *target]
    return launch(["--max-restarts=0", *target, *sys.argv[1:]], nproc)
