"""DTensor's split rule, shared by every module that lays tensors out."""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor import Placement, Shard


def chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` when ``length`` rows are split into ``parts``
    like ``torch.chunk``: pieces of ``ceil(length/parts)``, the last ones shorter or empty."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, max(0, min(size, length - start))


def block_of(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coord: Sequence[int]):
    """The ``(start, length)`` per tensor dim held by the device at mesh ``coord``
    (mesh axes split a dim in order, each like ``torch.chunk``)."""
    block = [(0, int(s)) for s in shape]
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            start, length = block[p.dim]
            sub_start, sub_len = chunk(length, mesh_shape[axis], coord[axis])
            block[p.dim] = (start + sub_start, sub_len)
    return block


def tile_shape(shape: Sequence[int], mesh_shape: Sequence[int], dims: Sequence[Sequence[int]]) -> list[int]:
    """torch_xla's padded shard shape: ``ceil(size / tiles)`` along each dim split over the
    mesh axes ``dims[d]``. (A dim split over several axes is split like torch.chunk over each
    in turn here, over their product at once in XLA; the pieces differ only for some uneven
    sizes, and never exceed this.)"""
    out = []
    for size, axes in zip(shape, dims):
        tiles = 1
        for a in axes:
            tiles *= int(mesh_shape[a])
        out.append(-(-int(size) // tiles))
    return out


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))
