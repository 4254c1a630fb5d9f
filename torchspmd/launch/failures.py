"""Saying which process made a failed job fail.

torch.distributed.elastic gives each worker an error file (``$TORCHELASTIC_ERROR_FILE``)
and reads it back into ``ProcessFailure`` when the worker fails. ``record_failures()``,
called by the native engine's start in every worker, writes that file (torch's JSON format,
plus the exact time, type and place) for an uncaught exception. When the job fails, the
launcher names the process that failed first and lists the others as consequences
(``summarize``); the agent's own per-failure log lines are left out, the summary replaces
them. A worker interrupted (SIGINT) prints nothing of what it raises from then on.
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
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import (
    ErrorHandler,
    ProcessFailure,
)

from torchspmd.launch.environment import all_ranks_output
from torchspmd.errors import PeerLost

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
# Errors a process gets when a peer it communicates with has gone (or hangs): c10d's own
# error types, torchspmd's (shared_sums), and gloo's transport errors (raised as plain RuntimeError, e.g.
# "[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer").
_LOST_CONNECTION_TYPES = {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "QueueEmptyError",
                          PeerLost.__name__}
_LOST_CONNECTION_TEXT = ("gloo/transport", "Connection closed by peer", "Connection reset by peer")

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


class AgentLog(logging.Filter):
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


MEMORY_EVENTS = "/sys/fs/cgroup/memory.events"  # cgroup v2: how often this group's OOM killer killed


def oom_kills() -> int | None:
    """The count of processes the kernel's out-of-memory killer ended in this cgroup, or None
    where the machine does not say (cgroup v1, no /sys)."""
    try:
        with open(MEMORY_EVENTS) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def out_of_memory_hint(known: bool) -> str:
    """What to say of a worker the kernel killed (SIGKILL): ``known`` when the cgroup's OOM-kill
    count rose during the run."""
    first = ("the kernel's out-of-memory killer ended it" if known else
             "most likely the kernel's out-of-memory killer (nothing else here sends SIGKILL)")
    return (f"torchspmd: {first}: the processes together needed more memory than the machine (or its container) "
            f"has. The native engine runs eagerly and keeps every layer's activations for backward, where "
            f"torch_xla's compiled graph can free or recompute them, so a program that fits under torch_xla may "
            f"not fit here at the same batch. Fixes: activation checkpointing (checkpoint_module on each decoder "
            f"layer, before FSDPv2), a smaller batch per device, fewer processes per host; `torchspmd plan` "
            f"predicts the memory per process of a train job, and docs/memory.md says what a step holds.")


def summarize(failures: dict[int, ProcessFailure], stopped_pids: set[int] = frozenset(),
              oom_kills_at_start: int | None = None) -> tuple[str, int]:
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
                                or all_ranks_output())
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
    if any(x.error is None and not x.stopped and x.exitcode == -signal.SIGKILL for x in items):
        now = oom_kills()
        lines.append(out_of_memory_hint(now is not None and oom_kills_at_start is not None and now > oom_kills_at_start))
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

#: Set in a worker once SIGINT reached it (Ctrl-C reaches every process of the terminal's
#: group, and torchrun's agent passes it on): what the program raises after that (the
#: KeyboardInterrupt, or a peer's lost connection) is not printed rank by rank.
_INTERRUPTED = False


def on_interrupt(signum, frame):
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



def every_failure(poll):
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

    return _poll
