"""XLA's HLO sharding text, the one form torch_xla programs read a layout in.

``{devices=[t0,t1,...]d0,d1,...}``: ``t_i`` tiles along tensor dim ``i``, the device list the
tile assignment in C order; when some mesh axes split no dim, one more tile dim holds each
tile's copies (in ascending device order, as XLA lists them), marked
``last_tile_dim_replicate``. ``{replicated}`` when nothing is split; ``''`` for a tensor
without a sharding.

Used by both engines: the native engine writes the text of a DTensor's layout (what
``torch_xla._XLAC._get_xla_sharding_spec`` gives under ``--xla-compat``, and
``XLAShardedTensor.sharding_spec``); the torch_xla engine reads torch_xla's text back into a
partition spec; ``visualize_sharding`` draws a text.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

from torchspmd.errors import SpmdError

__all__ = ["text", "from_partition_spec", "partition_spec", "cells"]

REPLICATED = "{replicated}"
_COPIES = " last_tile_dim_replicate}"


def text(device_grid, dims_axes: Sequence[Sequence[int]]) -> str:
    """The text for a tensor whose dim ``i`` is split over the mesh axes ``dims_axes[i]``
    (outermost first) of the mesh whose devices are laid out as ``device_grid``."""
    grid = np.asarray(device_grid)
    shape = grid.shape
    used = [a for axes in dims_axes for a in axes]
    rest = [a for a in range(len(shape)) if a not in used]
    tiles = [int(np.prod([shape[a] for a in axes], dtype=np.int64)) for axes in dims_axes]
    copies = int(np.prod([shape[a] for a in rest], dtype=np.int64))
    if all(t == 1 for t in tiles):
        return REPLICATED
    # Tile assignment: each dim's axes together (in order), the replicating axes last.
    assignment = grid.transpose(used + rest).reshape(tiles + ([copies] if copies > 1 else []))
    if copies > 1:
        assignment = np.sort(assignment, axis=-1)
    out = "{devices=[" + ",".join(map(str, assignment.shape)) + "]" + ",".join(
        str(int(d)) for d in assignment.reshape(-1))
    return out + (_COPIES if copies > 1 else "}")


def from_partition_spec(device_grid, axis_names: Sequence[str], spec) -> str:
    """The text for a torch_xla-style partition spec (axis names or indices, tuples of them, None)."""
    index = {n: i for i, n in enumerate(axis_names or ())}

    def axis(e):
        return index[e] if isinstance(e, str) else int(e)

    dims = [() if e is None else tuple(axis(x) for x in e) if isinstance(e, (tuple, list)) else (axis(e),)
            for e in spec]
    return text(device_grid, dims)


def partition_spec(sharding: str, device_grid, axis_names: Sequence[str] | None, ndim: int) -> tuple | None:
    """The partition spec (axis names where the mesh has them) whose text on this mesh is
    ``sharding``, or None when none is. Axes of size 1 change nothing and are left out."""
    grid = np.asarray(device_grid)
    shape = grid.shape
    if "]" not in sharding:
        return None
    tiles = [int(x) for x in sharding.split("[", 1)[1].split("]", 1)[0].split(",")][:ndim]
    if len(tiles) != ndim:
        return None
    axes = [a for a in range(len(shape)) if shape[a] > 1]
    groups = [p for r in range(1, len(axes) + 1) for c in itertools.combinations(axes, r)
              for p in itertools.permutations(c)]
    # per tensor dim, only the axis groups whose sizes multiply to that dim's tile count
    choices = [[()] if t == 1 else [g for g in groups if math.prod(shape[a] for a in g) == t] for t in tiles]
    for combo in itertools.product(*choices):
        flat = [a for group in combo for a in group]
        if len(flat) != len(set(flat)) or text(grid, combo) != sharding:
            continue
        label = (lambda a: axis_names[a]) if axis_names else (lambda a: a)
        return tuple(None if not c else label(c[0]) if len(c) == 1 else tuple(label(a) for a in c) for c in combo)
    return None


def cells(sharding: str, devices: int, in_text_order: bool = False) -> dict[tuple, list[int]]:
    """The device grid of a text by its first two tile dims, ``{((row, 1), (col, 1)):
    devices}`` (what ``visualize_sharding`` draws); ``devices``: the job's device count. A
    cell's devices are sorted, or in the text's order with ``in_text_order``."""
    def bad(why: str) -> SpmdError:
        return SpmdError(f"visualize_sharding({sharding!r}): {why}; give a tensor, or a sharding text such as "
                         f"'{{devices=[2,1]0,1}}' (torch_xla._XLAC._get_xla_sharding_spec(t))")

    body = sharding.strip()
    if body in ("", REPLICATED):
        return {((0, 1), (0, 1)): list(range(devices))}
    if not (body.startswith("{devices=[") and body.endswith("}") and "]" in body):
        raise bad("not a sharding text")
    replicate = body.endswith(_COPIES)
    dims_text, ids_text = body[len("{devices=["):].split("]", 1)
    ids_text = ids_text[: -len(_COPIES)] if replicate else ids_text[:-1]
    try:
        dims = [int(d) for d in dims_text.split(",")]
        ids = [int(i) for i in ids_text.split(",")]
    except ValueError:
        raise bad("its tile dims and device ids must be integers") from None
    if math.prod(dims) != len(ids) or any(d < 1 for d in dims) or (replicate and len(dims) < 2):
        raise bad(f"{len(ids)} device ids for tile dims {dims}")
    tiles = dims[:-1] if replicate else dims
    grid = np.array(ids).reshape(tiles + [-1])  # the last axis: each tile's copies (one without)
    if len(tiles) == 1:
        grid = grid[None]  # a 1-D layout: one row
    rows, cols = grid.shape[0], grid.shape[1]
    grid = grid.reshape(rows, cols, -1)  # deeper tile dims: their devices in the cell of the first two
    order = list if in_text_order else sorted
    return {((r, 1), (c, 1)): order(int(d) for d in grid[r, c]) for r in range(rows) for c in range(cols)}
