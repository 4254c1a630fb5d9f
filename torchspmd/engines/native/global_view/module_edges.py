"""The boundary of a wrapped module: global DTensors outside, local tensors inside.

Inputs arrive as global batches (DTensors sharded on dim 0 over the data axes, or plain
tensors holding the whole global value); the module computes on this process's rows;
its outputs leave as global DTensors sharded the same way.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torchspmd.layouts.blocks import chunk as _chunk
from torchspmd.layouts.blocks import contiguous_stride as _contiguous_stride
from torchspmd.engines.native.start import rng as _rng
from torchspmd.errors import SpmdError
from torchspmd.tree import map_tensors, walk_tensors


@dataclass
class BatchLayout:
    """How the current batch is split: over which mesh axes, how many rows in all and here."""

    device_mesh: Any
    placements: list[Placement]  # Shard(0) on the data axes, Replicate elsewhere
    global_rows: int
    local_rows: int
    local_start: int


def _coord(device_mesh) -> list[int]:
    return list(device_mesh.get_coordinate())


def shares(rows: int, device_mesh, data_dims: list[int]) -> list[int]:
    """The rows each process holds of a batch of ``rows`` split over ``data_dims``."""
    lengths = [rows]
    for d in data_dims:
        ways = device_mesh.size(d)
        lengths = [_chunk(n, ways, i)[1] for n in lengths for i in range(ways)]
    return lengths


def inputs_to_local(args: tuple, kwargs: dict, device_mesh, data_dims: list[int], who: str):
    """Turn global inputs into this process's rows; return (args, kwargs, BatchLayout)."""
    rows: list[int] = []

    def seen(t: torch.Tensor):
        if t.dim() > 0:
            rows.append(int(t.shape[0]))

    walk_tensors((args, kwargs), seen)
    if not rows:
        layout = None
    else:
        if len(set(rows)) > 1:
            raise SpmdError(
                f"{who}: the batch tensors disagree on dim 0 (sizes {sorted(set(rows))}); every tensor "
                f"input must have the global batch on dim 0"
            )
        n = rows[0]
        placements: list[Placement] = [Replicate()] * device_mesh.ndim
        for d in data_dims:
            placements[d] = Shard(0)
        coord = _coord(device_mesh)
        start, length = 0, n
        for d in data_dims:
            s, length = _chunk(length, device_mesh.size(d), coord[d])
            start += s
        layout = BatchLayout(device_mesh, placements, n, length, start)

    def local(t: torch.Tensor):
        if isinstance(t, DTensor):
            if t.device_mesh != device_mesh:
                raise SpmdError(f"{who}: an input is sharded over another mesh than the module's")
            if t.dim() > 0 and tuple(t.placements) != tuple(layout.placements):
                t = t.redistribute(device_mesh, layout.placements)
            # Over a data axis each process used the value on its own rows: its gradient is
            # a share of a sum. Over the other axes (a 'model' axis) the processes computed
            # the same rows, and each holds the whole gradient.
            grad_placements = [Partial() if p.is_replicate() and i in data_dims else p
                               for i, p in enumerate(t.placements)]
            return t.to_local(grad_placements=grad_placements)
        if t.dim() == 0 or layout is None:
            return t
        return t.narrow(0, layout.local_start, layout.local_rows)

    args = map_tensors(args, local)
    kwargs = map_tensors(kwargs, local)
    return args, kwargs, layout


def output_to_global(t: torch.Tensor, layout: BatchLayout | None, who: str) -> torch.Tensor:
    """A local output with this process's rows on dim 0, as the global DTensor."""
    if layout is None or t.dim() == 0 or t.shape[0] != layout.local_rows:
        raise SpmdError(
            f"{who}: cannot tell how the output of shape {tuple(t.shape)} is split across devices "
            f"(expected this process's {layout.local_rows if layout else '?'} batch rows on dim 0); "
            f"pass shard_output=fn(output, mesh) that marks its sharding"
        )
    gshape = (layout.global_rows, *t.shape[1:])
    return DTensor.from_local(
        t, layout.device_mesh, layout.placements, run_check=False,
        shape=torch.Size(gshape), stride=_contiguous_stride(gshape),
    )


def outputs_to_global(output: Any, layout: BatchLayout | None, who: str) -> Any:
    return map_tensors(output, lambda t: t if isinstance(t, DTensor) else output_to_global(t, layout, who))


# -- shard_output callables written for torch_xla: mark_sharding(output.logits, mesh, spec)
# annotates in place there. Here, while such a callable runs, mark_sharding on a local
# output records the global DTensor it stands for, and the output is rebuilt with them.

_MARKING = threading.local()


@contextlib.contextmanager
def marking_outputs(layout: BatchLayout | None, output: Any = None):
    """Around a ``shard_output`` callable given ``output``: what it marks (``mark_sharding``
    on this process's blocks) is collected, by the marked tensor's ``id``."""
    held: set[int] = set()
    walk_tensors(output, lambda t: held.add(id(t)))
    if not isinstance(output, (torch.Tensor, dict, list, tuple)) and hasattr(output, "__dict__"):
        walk_tensors(list(vars(output).values()), lambda t: held.add(id(t)))
    _MARKING.state = (layout, {}, held)
    try:
        yield _MARKING.state[1]
    finally:
        _MARKING.state = None


def taken_by_wrapper(marked: torch.Tensor) -> bool:
    """Whether ``marked`` (``mark_sharding``'s result) is one of the wrapped module's outputs
    marked inside its ``shard_output`` callable: the wrapper returns it in place of the
    output, whether the callable keeps it or not."""
    state = getattr(_MARKING, "state", None)
    if state is None:
        return False
    _, collected, held = state
    return any(out is marked and key in held for key, out in collected.items())


def mark_local_output(t: torch.Tensor, device_mesh, placements) -> DTensor | None:
    """Inside ``marking_outputs``: this process's block ``t`` as the global DTensor."""
    state = getattr(_MARKING, "state", None)
    if state is None:
        return None
    layout, marked, _ = state
    gshape = list(t.shape)
    for d in range(t.dim()):
        axes = [i for i, p in enumerate(placements) if p.is_shard(d)]
        if not axes:
            continue
        if (layout is not None and d == 0 and t.shape[0] == layout.local_rows
                and [i for i, p in enumerate(layout.placements) if p.is_shard(0)] == axes):
            gshape[0] = layout.global_rows
        else:
            for i in axes:  # other dims: even splits
                gshape[d] *= device_mesh.size(i)
    out = DTensor.from_local(t, device_mesh, placements, run_check=False, shape=torch.Size(gshape),
                             stride=_contiguous_stride(gshape))
    marked[id(t)] = out
    return out


def replace_marked(output: Any, marked: dict) -> Any:
    """``output`` with the tensors ``shard_output`` marked replaced by their global values.
    An output object of a class of its own (not a tensor, container, named tuple, dataclass
    or ``ModelOutput``) has its attributes replaced in place, as torch_xla's in-place
    annotation would leave it."""
    swap = lambda t: marked.get(id(t), t)  # noqa: E731
    new = map_tensors(output, swap)
    if new is output and not isinstance(output, (torch.Tensor, dict, list, tuple)) and hasattr(output, "__dict__"):
        for k, v in list(vars(output).items()):
            mapped = map_tensors(v, swap)
            if mapped is not v:
                setattr(output, k, mapped)
    return new


_LOCAL = threading.local()


def in_local_compute() -> bool:
    """Inside a wrapped module's local compute (FSDPv2's forward, ``ts.replicate``, the
    automatic data-parallel path's local calls): tensors there are this process's share."""
    return getattr(_LOCAL, "depth", 0) > 0


@contextlib.contextmanager
def local_rows_stream(layout: BatchLayout | None, data_dims: list[int]):
    """The local compute of a wrapped module. Random operations on this process's rows
    (dropout) draw from the rows' own stream, not the one every process shares (see
    torchspmd/engines/native/start/rng.py); without a batch every process computes the same and shares it."""
    if not in_local_compute():
        _rng.discard_split_stream()
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        if layout is None:
            try:
                yield
            finally:
                _rng.exit_split_stream()  # a tensor-parallel pair left open (its partner never ran)
            return
        mesh = layout.device_mesh
        index = _rng.shard_index(_coord(mesh), list(mesh.shape), data_dims)
        with _rng.local_stream(index, mesh.device_type):
            try:
                yield
            finally:
                _rng.exit_split_stream()
    finally:
        _LOCAL.depth -= 1