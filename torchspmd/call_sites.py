"""What the code that called a function does with its result, read from the caller's bytecode.

Used where an API's meaning depends on it: ``mark_sharding(t, ...)`` whose result is dropped
cannot shard a plain tensor ``t`` (a DTensor is another Python object), and says so."""

from __future__ import annotations

import dis
import sys

__all__ = ["result_discarded"]


def result_discarded(depth: int = 1) -> bool:
    """Whether the call running ``depth`` frames above the caller of this function has its
    result thrown away (the next instruction after the call is ``POP_TOP``, as for a call
    written as a statement). False when the bytecode cannot be read."""
    try:
        frame = sys._getframe(depth + 1)
        # f_lasti is the call instruction, or (Python 3.11) within its inline caches, which
        # get_instructions skips: the next instruction is the first one past it
        for ins in dis.get_instructions(frame.f_code):
            if ins.offset > frame.f_lasti:
                return ins.opname == "POP_TOP"
    except (AttributeError, ValueError):
        pass
    return False
