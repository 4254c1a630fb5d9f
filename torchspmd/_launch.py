"""Starting one process per device on PyTorch's elastic launcher (torchrun), and saying
which process made a failed job fail.

torch.distributed.elastic gives each worker an error file (``$TORCHELASTIC_ERROR_FILE``)
and reads it back into ``ProcessFailure`` when the worker fails. ``record_failures()``,
called by ``use_spmd()`` in every worker, writes that file (torch's JSON format, plus the
exact time, type and place) for an uncaught exception. When the job fails, ``launch()``
names the process that failed first and lists the others as consequences
(``summarize``); the agent's own per-failure log lines are left out, the summary replaces
them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure
from torch.distributed.elastic.multiprocessing.api import SignalException

from torchspmd._errors import SpmdError

# torch.distributed.elastic's names: the worker's error file, the logger that reports
# worker failures and the signals it sends to the other workers.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
# Errors a process gets when a peer it communicates with has gone (or hangs): c10d's own
# error types, and gloo's transport errors (raised as plain RuntimeError, e.g.
# "[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer").
_ALL_RANKS_OUTPUT = "TORCHSPMD_ALL_RANKS_OUTPUT"


def _all_ranks_output() -> bool:
    """``TORCHSPMD_ALL_RANKS_OUTPUT`` set to anything but ``0`` (or empty): every rank prints."""
    return os.environ.get(_ALL_RANKS_OUTPUT, "").strip() not in ("", "0")
_LOST_CONNECTION_TYPES = {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "QueueEmptyError"}
_LOST_CONNECTION_TEXT = ("gloo/transport", "Connection closed by peer", "Connection reset by peer")


#: glibc malloc settings for the workers (``mallopt(3)``'s environment variables): blocks up
#: to 32 MiB (glibc's largest threshold) come from the heap rather than from a fresh
#: ``mmap`` each time, and freed heap memory is kept rather than returned to the system. An
#: FSDP step frees and allocates every layer's gathered parameters and gradients again;
#: with glibc's defaults each of those allocations is new memory that the kernel zeroes
#: page by page (page faults, system time); with these the process reuses its own memory.
#: The process's resident memory then stays near its peak between steps.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40),
              "MALLOC_TOP_PAD_": str(256 * 2**20)}
#: ``TORCHSPMD_MALLOC=default`` keeps glibc's own settings.
MALLOC_SWITCH = "TORCHSPMD_MALLOC"


def _allocator_env(environ) -> dict[str, str]:
    """The malloc variables to add to ``environ`` for the workers: :data:`MALLOC_ENV`, unless
    ``TORCHSPMD_MALLOC=default`` or the environment already sets glibc's malloc (a ``MALLOC_*``
    variable, or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``: the user's choice, kept as it is)."""
    switch = environ.get(MALLOC_SWITCH, "tuned")
    if switch not in ("tuned", "default"):
        raise SpmdError(f"{MALLOC_SWITCH}={switch!r}: expected 'tuned' (the default) or 'default' (glibc's own "
                        "malloc settings)")
    if switch == "default" or any(k.startswith("MALLOC_") for k in environ) \
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return dict(MALLOC_ENV)


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the system now (glibc's ``malloc_trim(0)``).

    Under :data:`MALLOC_ENV` freed memory is kept for reuse; that is right for the
    per-step buffers, but not for a one-off like the whole model a process builds before
    FSDPv2 keeps only its shard (the rest would stay resident for the whole run). FSDPv2
    calls this once it has sharded. Nothing happens where the C library has no
    ``malloc_trim`` (not glibc) or on other systems."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # another C library: it keeps no such reserve
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


# glibc's mallopt(3) parameter numbers for MALLOC_ENV's variables: a forked worker does not
# read the environment's malloc settings (glibc reads them once, at process start), so
# they are applied to it with mallopt.
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}


def _apply_malloc_settings(settings: dict[str, str]) -> None:
    """Set ``settings`` (:data:`MALLOC_ENV`'s variables) in this running process."""
    if not settings or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for name, value in settings.items():
        mallopt(_MALLOPT[name], min(int(value), 2**31 - 1))


#: ``TORCHSPMD_BIND_CORES=0`` leaves the forked workers free to run on any of the launcher's cores.
BIND_SWITCH = "TORCHSPMD_BIND_CORES"
#: OpenMP's own placement variables: a user who set one chose where threads run.
_PLACEMENT_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def _bind_switch(environ) -> bool:
    value = environ.get(BIND_SWITCH, "1")
    if value not in ("0", "1"):
        raise SpmdError(f"{BIND_SWITCH}={value!r}: expected '1' (the default: each worker runs on its own "
                        f"share of the launcher's cores) or '0' (workers may run on any of them)")
    return value == "1"


def worker_cores(cores: Sequence[int], local_rank: int, local_world: int) -> list[int]:
    """The cores local worker ``local_rank`` of ``local_world`` runs on: an equal share of
    ``cores`` (the launcher's), consecutive ones together; with more workers than cores,
    each core is shared by an equal number of workers (ranks 0 and 1 of 4 on the first of 2)."""
    cores = sorted(cores)
    n = len(cores)
    if local_world <= n:
        return cores[local_rank * n // local_world:(local_rank + 1) * n // local_world]
    return [cores[local_rank * n // local_world]]


def _bind_to_cores() -> None:
    """In a forked worker: run on :func:`worker_cores` (threads started later inherit it),
    unless ``TORCHSPMD_BIND_CORES=0``, OpenMP's placement variables are set, or
    ``OMP_NUM_THREADS`` asks for more threads than those cores."""
    if not hasattr(os, "sched_setaffinity") or not _bind_switch(os.environ) \
            or any(k in os.environ for k in _PLACEMENT_ENV):
        return
    try:
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return
    mine = worker_cores(os.sched_getaffinity(0), local_rank, local_world)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > len(mine):
        return
    os.sched_setaffinity(0, mine)


def _threads_per_process(nproc: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nproc)


# --- in each worker -------------------------------------------------------------------


class _Recorder(ErrorHandler):
    """torch's ErrorHandler, writing the exception it is given (not the one being handled:
    an excepthook runs outside any ``except``) with the exact time, its type and message
    apart, and where it was raised. The file is replaced atomically: the launcher may stop
    this process while it writes."""

    def record_exception(self, e: BaseException, handled: bool = False) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        frames = traceback.extract_tb(e.__traceback__)
        now = time.time()
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
                    "timestamp": str(int(now)),  # torch's field (whole seconds)
                    "time": now,
                    "type": type(e).__name__,
                    "text": str(e),
                    "where": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "",
                    "handled": handled,  # printed by the program as one line, without a traceback
                },
            }
        }
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)


def record_failures() -> None:
    """In a worker started by torchrun (``$TORCHELASTIC_ERROR_FILE`` set): record an
    uncaught exception into the error file before the traceback is printed, so the
    launcher can tell which process failed first and with what. Idempotent."""
    if not os.environ.get(ERROR_FILE_ENV) or getattr(sys.excepthook, "_torchspmd_records", False):
        return
    recorder = _Recorder()
    recorder.initialize()  # torch's: faulthandler, so a crash in native code prints Python stacks
    previous = sys.excepthook

    def hook(typ, value, tb):
        try:
            recorder.record_exception(value)
        except Exception:  # never hide the program's own error behind ours
            pass
        previous(typ, value, tb)

    hook._torchspmd_records = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def record_error(e: BaseException) -> None:
    """Record an error a worker handles itself (the CLI prints a setting error as one line
    and exits with status 2) for the launcher's summary, as an uncaught one would be."""
    if os.environ.get(ERROR_FILE_ENV):
        try:
            _Recorder().record_exception(e, handled=True)
        except Exception:
            pass


# --- in the launching process ---------------------------------------------------------


class _AgentLog(logging.Filter):
    """On torch.distributed.elastic's process logger: notes which workers the agent stopped
    ("Sending process %s closing signal %s") and, if ``quiet``, leaves out its per-failure
    lines (the summary says the same, naming the right process)."""

    def __init__(self, quiet: bool):
        super().__init__()
        self.quiet = quiet
        self.stopped: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("Sending process") and record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            if isinstance(args[0], int):
                self.stopped.add(args[0])
            return not self.quiet
        if msg.startswith("failed (exitcode") or msg.startswith("Closing process"):  # ... or, on Ctrl-C, one
            return not self.quiet  # line per worker (the launcher then says the workers were stopped)
        return True


@dataclass
class _Failure:
    rank: int
    exitcode: int
    error: str | None  # "Type: message" of the recorded exception, None without a record
    where: str
    time: float
    handled: bool  # the program printed the error itself (one line), not a traceback
    lost_connection: bool  # its error is a lost connection to a peer: a consequence
    stopped: bool  # stopped by the launcher (no record): a consequence

    @property
    def kind(self) -> int:
        """0: failed by itself; 1: lost its connection to a peer; 2: stopped by the launcher."""
        return 2 if self.stopped else 1 if self.lost_connection else 0

    def status(self) -> str:
        """'SIGKILL' for a process a signal ended, 'exit code 1' otherwise."""
        if self.exitcode >= 0:
            return f"exit code {self.exitcode}"
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


def _lost_connection(type_name: str, text: str) -> bool:
    return type_name in _LOST_CONNECTION_TYPES or any(t in text for t in _LOST_CONNECTION_TEXT)


def _failure(rank: int, f: ProcessFailure, stopped_pids: set[int]) -> _Failure:
    message = f.error_file_data.get("message") if isinstance(f.error_file_data, dict) else None
    if isinstance(message, dict):  # recorded (by record_failures, or torch's @record)
        extra = message.get("extraInfo", {})
        error = str(message.get("message", ""))
        type_name, _, text = error.partition(": ")
        type_name, text = extra.get("type", type_name), extra.get("text", text)
        when = float(extra.get("time", f.timestamp))
        return _Failure(rank, f.exitcode, error, extra.get("where", ""), when, bool(extra.get("handled")),
                        _lost_connection(type_name, text), False)
    if stopped_pids:
        stopped = f.pid in stopped_pids
    else:  # the agent's log lines were not seen: its signal is SIGTERM
        stopped = f.exitcode == -signal.SIGTERM
    return _Failure(rank, f.exitcode, None, "", float(f.timestamp), False, False, stopped)


def _short(text: str, n: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= n else line[: n - 3] + "..."


def _first_sentence(error: str) -> str:
    """'RuntimeError: [.../pair.cc:553] Connection closed by peer [127.0.0.1]:3294. This is
    typically ...' -> 'RuntimeError: Connection closed by peer [127.0.0.1]:3294'."""
    error = re.sub(r"^(\w+): \[[^\]]*\] ", r"\1: ", _short(error))
    return error.split(". ")[0]


def summarize(failures: dict[int, ProcessFailure], stopped_pids: set[int] = frozenset()) -> tuple[str, int]:
    """The summary of a failed job and its exit status.

    The process that failed first is the earliest (by its recorded time) of those that
    failed by themselves; processes that lost their connection to a peer (c10d / gloo
    transport errors) or were stopped by the launcher are consequences, and come first only
    when nothing else failed. The status is that process's exit code (128 + the signal
    number if a signal killed it)."""
    items = sorted((_failure(r, f, stopped_pids) for r, f in failures.items()),
                   key=lambda x: (x.kind, x.time, x.rank))
    root, others = items[0], sorted(items[1:], key=lambda x: x.rank)
    r = root.rank
    printed = root.handled and (r == 0 or any(o.rank == 0 and o.handled and o.error == root.error for o in others)
                                or _all_ranks_output())
    if printed:  # the program printed it as one line (rank 0 prints for all): not again
        lines = [f"torchspmd: rank {r} failed: {root.error.partition(':')[0]} (its message is printed above)"]
    elif root.error is not None:
        at = f" (at {root.where})" if root.where else ""
        shown = "" if root.handled else f"; its traceback is printed above, in lines starting [rank{r}]:"
        lines = [f"torchspmd: rank {r} failed: {_short(root.error, 1000)}{at}{shown}"]
        if root.lost_connection:
            lines.append(f"torchspmd: rank {r} lost its connection to another process: that process (on another "
                         f"host, or not started by this launcher) probably failed first")
    elif root.exitcode > 0:
        lines = [f"torchspmd: rank {r} exited with code {root.exitcode} and recorded no exception (os._exit, "
                 f"sys.exit, a crash in native code, or an error before use_spmd()); its output is above"]
    elif root.stopped:
        lines = [f"torchspmd: rank {r} was stopped ({root.status()})"]
    else:
        lines = [f"torchspmd: rank {r} was killed by {root.status()}"]
    for o in others:
        if o.kind == 0 and o.error is not None:
            what = "failed with the same error" if o.error == root.error else f"also failed: {_short(o.error)}"
        elif o.kind == 0:
            what = (f"also exited with code {o.exitcode}" if o.exitcode > 0 else f"was also killed by {o.status()}")
        elif o.kind == 1:
            what = f"failed after rank {r} failed: {_first_sentence(o.error or '')} (a lost connection)"
        else:
            what = f"was stopped ({o.status()}) after rank {r} failed"
        lines.append(f"torchspmd: rank {o.rank} {what}")
    if root.exitcode > 0:
        code = root.exitcode
    elif root.error is not None:
        # It recorded its error and was exiting when the launcher stopped it: the status of a
        # Python error (2 for one the CLI printed), not the launcher's signal.
        code = 2 if root.handled else 1
    else:
        code = 128 - root.exitcode
    return "\n".join(lines), code


#: ``TORCHSPMD_START_METHOD``: how ``torchspmd run`` starts its workers. ``fork`` (the
#: default on Linux where no CUDA device is visible): each worker is a fork of the launcher,
#: which has imported torch and torchspmd, and runs the program in that interpreter
#: (``runpy``), so the workers share the imported runtime's memory with each other and with
#: the launcher. ``subprocess``: torchrun's own way, a new Python per worker.
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
    import torch

    # A process that has initialised CUDA cannot be forked into CUDA workers.
    return "subprocess" if torch.cuda.is_available() else "fork"


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


def _run_program(program: str, *args: str) -> None:
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
    signal.signal(signal.SIGINT, _on_interrupt)
    _apply_malloc_settings({k: v for k, v in os.environ.items() if k in _MALLOPT and MALLOC_ENV.get(k) == v})
    _bind_to_cores()
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
        if not _INTERRUPTED:  # after Ctrl-C (or the launcher's SIGINT) the launcher's one line says it
            sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt) or _INTERRUPTED
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


#: Set in a worker once SIGINT reached it (Ctrl-C reaches every process of the terminal's
#: group, and torchrun's agent passes it on): what the program raises after that (the
#: KeyboardInterrupt, or a peer's lost connection) is not printed rank by rank.
_INTERRUPTED = False


def _on_interrupt(signum, frame):
    """A worker's SIGINT handler: KeyboardInterrupt, as Python's, once; a second SIGINT (the
    terminal's and the agent's arrive together) while the first is handled is ignored."""
    global _INTERRUPTED
    if _INTERRUPTED:
        return
    _INTERRUPTED = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether this worker has been interrupted (SIGINT)."""
    return _INTERRUPTED


def _every_failure(poll):
    """``MultiprocessContext._poll`` (torch's context for forked workers) reporting every
    worker that failed, as its context for subprocess workers does: torch's reports only
    the first one ``multiprocessing`` noticed, which is not always the one that failed first
    (``summarize`` orders them by their recorded times)."""

    def _poll(self):
        result = poll(self)
        processes = getattr(getattr(self, "_pc", None), "processes", None)
        if result is None or not result.failures or processes is None:
            return result
        for rank, proc in enumerate(processes):
            if rank not in result.failures and proc.exitcode not in (0, None):
                result.failures[rank] = ProcessFailure(local_rank=rank, pid=proc.pid, exitcode=proc.exitcode,
                                                       error_file=self.error_files[rank])
        return result

    _poll._torchspmd_every_failure = True  # type: ignore[attr-defined]
    return _poll


def _quick_rendezvous_names() -> None:
    """Make torch's dynamic rendezvous name its events without ``inspect.stack()``.

    ``dynamic_rendezvous.get_method_name`` (torch 2.9-2.13) calls ``inspect.stack()`` twice
    for each event it records, nine events in a launch: ``inspect.stack`` looks every frame's
    module up in ``sys.modules`` and reads its source lines; one ``get_method_name`` call took
    0.18 s here with torch, torch._dynamo and transformers imported, all before any worker
    starts. The replacement gives the same name (the function ``depth`` frames up; a
    negative depth, which torch never passes, is left to torch's) from the frame itself. It
    replaces only torch's definition as described (its code calls ``inspect.stack``): a
    changed one is left alone."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    except ImportError:  # nothing to speed up
        return
    original = getattr(rdzv, "get_method_name", None)
    code = getattr(original, "__code__", None)
    if (original is None or getattr(original, "_torchspmd_quick", False) or code is None
            or not {"stack", "function"} <= set(code.co_names) or original.__defaults__ != (2,)):
        return

    def get_method_name(depth: int = 2) -> str:
        if depth < 0:
            return original(depth)
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # the stack is not that deep
            return "no_method_name"

    get_method_name._torchspmd_quick = True  # type: ignore[attr-defined]
    get_method_name._torchspmd_original = original  # type: ignore[attr-defined]
    rdzv.get_method_name = get_method_name


def _forked(parsed) -> None:
    """Set ``parsed`` (torchrun's arguments) to start the workers as forks running
    :func:`_run_program`; prepare the launcher for being forked."""
    import gc

    # torch._dynamo (0.7 s to import) is imported by the first optimizer step, by FSDP2's
    # sharding and by DTensor in every training program: imported here, before the fork, its
    # pages are the launcher's, shared by the workers, and n workers on fewer cores do not
    # import it one after another.
    import torch._dynamo  # noqa: F401
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    if not getattr(MultiprocessContext._poll, "_torchspmd_every_failure", False):
        MultiprocessContext._poll = _every_failure(MultiprocessContext._poll)

    if parsed.module:
        parsed.training_script_args = [parsed.training_script, *parsed.training_script_args]
        parsed.training_script, parsed.module = "-m", False
    program, args = parsed.training_script, parsed.training_script_args
    if program == "-m" and args[:1] == ["torchspmd.compat"] and len(args) > 1 and args[1] != "-m":
        _preload(args[1], compat=True)
    elif program != "-m":
        _preload(program, compat=False)
    parsed.run_path, parsed.start_method = True, "fork"
    torchrun.run_script_path = _run_program  # the entry point torchrun's run_path starts
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
    _quick_rendezvous_names()
    # Restarted workers must not share the rendezvous store of the failed attempt: with it,
    # they can read the old attempt's peer addresses and fail to connect (pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        per_node = parsed.nproc_per_node
        n = int(per_node) if str(per_node).isdigit() else 1
        os.environ["OMP_NUM_THREADS"] = str(_threads_per_process(n))
    os.environ.update(_allocator_env(os.environ))
    _bind_switch(os.environ)  # a wrong value is an error here, not in every worker
    fork = _start_method(parsed) == "fork"
    if fork:
        entry = torchrun.run_script_path
        _forked(parsed)
    # With restarts allowed, the agent's lines are the only word of an attempt that failed.
    agent_log = _AgentLog(quiet=int(parsed.max_restarts) == 0)
    logger = logging.getLogger(_AGENT_LOGGER)
    logger.addFilter(agent_log)
    try:
        run(parsed)
    except ChildFailedError as e:
        text, code = summarize(e.failures, agent_log.stopped)
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
    from torchspmd import compat

    if compat.active():  # the children run under the layer too
        target = ["-m", "torchspmd.compat", *target]
    return launch(["--max-restarts=0", *target, *sys.argv[1:]], nproc)
