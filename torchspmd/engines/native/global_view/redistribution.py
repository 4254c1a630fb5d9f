"""Redistributions DTensor cannot do, done in two exact steps instead of failing.

DTensor's sharding propagation picks layouts that its own redistribution then refuses to
move. On a 2D mesh, Pattern 1 (parameters annotated over ``'model'``, the batch over
``'data'``, no wrapper) meets one in backward: a gradient whose flattened (batch x sequence)
dim is split over both axes (``_StridedShard`` on each) must become whole for a matrix
product, torch 2.13 merges the two per-axis gathers into one over the flattened mesh, and
then refuses to run the merged step (``AssertionError: _StridedShard redistribute assumes
no flattened transforms``).

Every redistribution goes through ``redistribute`` (``torchspmd.patches.dtensor.
REDISTRIBUTION_FALLBACK``). DTensor's own plan runs first; where it raises, the local tensor
is gathered to ``Replicate`` on every mesh axis, one axis at a time (DTensor's per-axis steps,
merging off), and then split to the target (a local slice, or a zero-filled share of a pending
sum): each step is one DTensor does for any layout, and the value is exact. Each fallback is
recorded where it happened (the op whose argument it was, the placements, DTensor's message);
``torchspmd.explain`` lists those of its step, and the first of each kind warns
(``RedistributionFallbackWarning``).

The fallback is taken only where every process takes it: for what DTensor refuses itself (its
assertions, "not supported" errors, errors raised by its own Python code), decided from the global
layout, the same on every process, so every process raises at the same step and the collectives
stay matched. A collective's failure (``torch.distributed.DistError``) and an error of a local op
(raised in C++, which could happen on some processes only) are not retried: they propagate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import os
import sys
import warnings
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from torchspmd.engines.native.global_view import flat_tiling
from torchspmd.patches import dtensor as dtensor_patches

__all__ = ["Fallback", "RedistributionFallbackWarning", "redistribute", "watching", "seen", "install"]


class RedistributionFallbackWarning(UserWarning):
    """DTensor could not redistribute a value; torchspmd gathered it whole and split it again."""


@dataclasses.dataclass(frozen=True)
class Fallback:
    """One redistribution DTensor refused, done as a gather to Replicate and a split."""

    op: str  # the op whose argument was redistributed ("aten.mm.default"); "redistribute": an explicit call
    source: str  # placements before, as torch writes them
    target: str  # placements asked for
    shape: tuple[int, ...]  # the global shape
    error: str  # DTensor's exception: its type and the first line of its message
    phase: str = ""  # "forward" / "backward", where a watcher (explain) knows it
    module: str = ""  # the module running, where a watcher (explain) knows it

    def __str__(self) -> str:
        where = f" in {self.module} ({self.phase})" if self.module else ""
        return (f"{self.op}{where}: {self.source} -> {self.target} of a {'x'.join(map(str, self.shape)) or 'scalar'} "
                f"tensor: DTensor raised {self.error}; gathered to Replicate and split again")


# What DTensor raises for a redistribution it refuses: its assertions and "not supported" errors
# anywhere, and errors it raises itself (a ``raise`` in torch.distributed.tensor). Not retried: a
# collective's failure (DistError: a peer gone, a timeout) and errors of the local ops it runs (raised
# in C++), which could differ between processes, where a fallback on some processes only would leave
# the collectives out of step.
_REFUSALS = (AssertionError, NotImplementedError, ValueError, RuntimeError)

_SEEN: dict[tuple, int] = {}  # (op, source, target, shape, error) -> how often, in this process
_WARNED: set[tuple] = set()
_WATCHERS: list[tuple[Callable[[], tuple[str, str]], list]] = []  # (where, events) of each open watching()


def _op_name() -> str:
    """The op whose argument is being redistributed: DTensor's dispatcher holds it in its
    locals a few frames up (``op_info.schema``, or the ``suggested_input_schema`` where the
    first is not kept), torchspmd's op handlers (exact_ops) in their argument ``op``;
    "redistribute" for an explicit ``DTensor.redistribute`` outside both."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            break
        found = frame.f_locals
        for schema in (getattr(found.get("op_info"), "schema", None), found.get("suggested_input_schema")):
            if getattr(schema, "op", None) is not None:
                return str(schema.op)
        op = frame.f_locals.get("op")
        if isinstance(op, torch._ops.OpOverload):
            return str(op)
        frame = frame.f_back
    return "redistribute"


def _refused(e: BaseException) -> bool:
    if hasattr(dist, "DistError") and isinstance(e, dist.DistError):
        return False
    if isinstance(e, (AssertionError, NotImplementedError)):
        return True
    return isinstance(e, _REFUSALS) and _raised_by_dtensor(e)


def _raised_by_dtensor(e: BaseException) -> bool:
    """Whether ``e`` comes from a ``raise`` statement of DTensor's own Python code."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
    return "torch/distributed/tensor/" in filename and linecache.getline(filename, tb.tb_lineno).lstrip().startswith(
        "raise ")


def _special_partial(current: DTensorSpec, target: DTensorSpec) -> bool:
    """Whether the target holds a pending value of a kind of DTensor's own (a subclass of
    ``Partial``: an embedding's masked partial, which only an index tensor made from a whole
    one means) where the source is not whole: the fallback's split could not know what such a
    share holds, so DTensor's refusal stands."""
    return any(isinstance(t, Partial) and type(t) is not Partial and not c.is_replicate()
               for c, t in zip(current.placements, target.placements))


def _replicated(spec: DTensorSpec) -> DTensorSpec:
    return DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta)


def _per_axis():
    """DTensor's per-axis steps, its merging of them into collectives over flattened meshes off
    (torch 2.9 does not merge: nothing to turn off)."""
    off = getattr(dtensor_redistribute, "disable_redistribute_transform_optimization", None)
    return off() if off is not None else contextlib.nullcontext()


def redistribute(original: Callable, local, current_spec: DTensorSpec, target_spec: DTensorSpec, *args, **kwargs):
    """DTensor's ``redistribute_local_tensor(local, current_spec, target_spec, ...)``
    (``original``); where it raises, the same redistribution as a gather to Replicate on
    every mesh axis followed by a split to the target. Between a mesh and one of its tiling
    meshes (``flat_tiling``: a gradient reaching a flat-tiled tensor from an op computed on
    the mesh), the value is gathered on one and split on the other."""
    if current_spec.mesh != target_spec.mesh and flat_tiling.same_devices(current_spec.mesh, target_spec.mesh):
        whole = original(local, current_spec, _replicated(current_spec))
        return original(whole, _replicated(target_spec), target_spec)
    try:
        return original(local, current_spec, target_spec, *args, **kwargs)
    except _REFUSALS as e:
        if not _refused(e) or current_spec.mesh != target_spec.mesh or _special_partial(current_spec, target_spec):
            raise
        refusal = e
    whole_spec = _replicated(current_spec)
    try:
        with _per_axis():
            whole = original(local, current_spec, whole_spec)
            out = original(whole, whole_spec, target_spec)
    except _REFUSALS as e:
        raise refusal from e  # not a layout problem after all: DTensor's own error, with what the fallback met
    message = str(refusal).strip().splitlines()
    fallback = Fallback(_op_name(), str(tuple(current_spec.placements)), str(tuple(target_spec.placements)),
                        tuple(current_spec.shape), type(refusal).__name__ + (f": {message[0]}" if message else ""))
    _record(fallback)
    return out


def _record(fallback: Fallback) -> None:
    key = dataclasses.astuple(fallback)
    _SEEN[key] = _SEEN.get(key, 0) + 1
    for where, events in list(_WATCHERS):
        phase, module = where()
        events.append(dataclasses.replace(fallback, phase=phase, module=module))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"torchspmd: {fallback} (exact, but it moves the whole tensor; ts.explain lists where)",
                      RedistributionFallbackWarning, stacklevel=2)


def seen() -> dict[Fallback, int]:
    """Every fallback this process took so far, with how often."""
    return {Fallback(*key): n for key, n in _SEEN.items()}


@contextlib.contextmanager
def watching(where: Callable[[], tuple[str, str]] = lambda: ("", "")) -> Iterator[list[Fallback]]:
    """The fallbacks taken inside the block (backward's included, whichever thread runs it), in
    order, each with ``where()``'s (phase, module) at the time."""
    events: list[Fallback] = []
    entry = (where, events)
    _WATCHERS.append(entry)
    try:
        yield events
    finally:
        _WATCHERS.remove(entry)


def install() -> None:
    """Route DTensor's redistributions through ``redistribute`` (the engine's start does it)."""
    dtensor_patches.redistribute_through(redistribute)
