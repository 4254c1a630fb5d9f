"""torch_xla's rule for a device's shard of a sharded tensor (what ``XLAShardedTensor.local_shards``
reports): the oracle tests/xla/test_xla_semantics.py checks against torch_xla itself and
tests/test_xla_semantics.py against torchspmd's processes."""

import numpy as np

# (name, device ids in mesh order, mesh shape, tensor shape, mesh axes splitting each tensor dim)
CASES = [
    ("tiled rows", [0, 1, 2, 3], (4,), (7, 5), [[0], []]),
    ("replicated", [0, 1, 2, 3], (4,), (7, 5), [[], []]),
    ("reordered ids", [3, 2, 1, 0], (4,), (7, 5), [[0], []]),
    ("partially replicated", [0, 1, 2, 3], (2, 2), (7, 5), [[0], []]),
    ("partially replicated, second axis", [0, 1, 2, 3], (2, 2), (7, 5), [[1], []]),
    ("tiled both dims", [0, 1, 2, 3], (2, 2), (7, 5), [[0], [1]]),
    ("two axes on one dim", [0, 1, 2, 3], (2, 2), (7, 5), [[0, 1], []]),
    ("two devices", [0, 1], (2,), (3, 5), [[], [0]]),
]


def spec_of(dims, names):
    """The partition spec (axis names) of ``dims``."""
    out = []
    for axes in dims:
        out.append(None if not axes else names[axes[0]] if len(axes) == 1 else tuple(names[a] for a in axes))
    return tuple(out)


def expected_shard(ids, mesh_shape, shape, dims, device):
    """(type, indices as (start, stop) per dim or None when replicated, padded shape, replica id)."""
    grid = np.asarray(ids).reshape(mesh_shape)
    coord = [int(c) for c in np.argwhere(grid == device)[0]]
    split = {a for axes in dims for a in axes}
    copies = [a for a in range(len(mesh_shape)) if a not in split]
    if not split:
        return "REPLICATED", None, tuple(shape), device
    kind = "PARTIAL" if any(mesh_shape[a] > 1 for a in copies) else "TILED"
    indices, padded = [], []
    for d, axes in enumerate(dims):
        tiles = int(np.prod([mesh_shape[a] for a in axes])) if axes else 1
        tile = -(-shape[d] // tiles)
        place = int(np.ravel_multi_index([coord[a] for a in axes], [mesh_shape[a] for a in axes])) if axes else 0
        indices.append((min(place * tile, shape[d]), min((place + 1) * tile, shape[d])))
        padded.append(tile)
    replica = 0
    if kind == "PARTIAL":
        replica = int(np.ravel_multi_index([coord[a] for a in copies], [mesh_shape[a] for a in copies]))
    return kind, indices, tuple(padded), replica
