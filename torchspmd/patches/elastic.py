"""Changes to torchelastic (``torch.distributed.elastic``, torchrun's agent)."""

from __future__ import annotations

import sys
from typing import Callable

from torchspmd.patches import Patch, apply, replace_attribute, skip

EVERY_FAILURE = Patch(
    name="torchelastic MultiprocessContext._poll",
    library="torch",
    what="the poll of forked workers reports every worker that failed, as its context for subprocess workers does",
    why="torch's reports only the first failure multiprocessing noticed, not always the first that happened: the "
        "launcher's summary names the process that failed first",
    versions=">=2.13,<2.16",
    feature="forked workers' failure summary",
    needed=False,
    targets=("torch.distributed.elastic.multiprocessing.api:MultiprocessContext._poll",),
    signatures={"torch.distributed.elastic.multiprocessing.api:MultiprocessContext._poll": (("self",),)},
)


def report_every_failure(poll: Callable[[Callable], Callable]) -> None:
    """``MultiprocessContext._poll`` becomes ``poll(original)``."""
    def install():
        from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

        return replace_attribute(MultiprocessContext, "_poll", poll(MultiprocessContext._poll))

    apply(EVERY_FAILURE, install)


QUICK_RENDEZVOUS_NAMES = Patch(
    name="torchelastic dynamic_rendezvous.get_method_name",
    library="torch",
    what="the rendezvous names its events from the calling frame instead of inspect.stack()",
    why="inspect.stack() reads every frame's source: 0.18 s per call with transformers imported, nine calls "
        "before any worker starts (the same names result)",
    versions=">=2.13,<2.16",
    feature="launch start-up time",
    needed=False,
    targets=("torch.distributed.elastic.rendezvous.dynamic_rendezvous:get_method_name",),
)


def quick_rendezvous_names() -> None:
    """Replace torch's ``get_method_name`` where it is the one described (its code calls
    ``inspect.stack``, default depth 2); a changed one is left alone."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    except ImportError:
        skip(QUICK_RENDEZVOUS_NAMES, "not needed on this version: torch has no dynamic rendezvous module")
        return
    original = getattr(rdzv, "get_method_name", None)
    code = getattr(original, "__code__", None)
    if original is None or code is None or not {"stack", "function"} <= set(code.co_names) \
            or original.__defaults__ != (2,):
        skip(QUICK_RENDEZVOUS_NAMES, "not needed on this version: torch's get_method_name does not read "
                                     "inspect.stack() (left as it is)")
        return

    def get_method_name(depth: int = 2) -> str:
        if depth < 0:
            return original(depth)
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # the stack is not that deep
            return "no_method_name"

    apply(QUICK_RENDEZVOUS_NAMES, lambda: replace_attribute(rdzv, "get_method_name", get_method_name))
