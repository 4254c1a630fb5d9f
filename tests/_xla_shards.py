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
    ("two axes, 9 rows: tiled flat", [0, 1, 2, 3], (2, 2), (9,), [[0, 1]]),
    ("two axes, 5 rows: tiled flat", [0, 1, 2, 3], (2, 2), (5, 2), [[0, 1], []]),
    ("two axes, flipped ids", [3, 2, 1, 0], (2, 2), (3, 9), [[], [0, 1]]),
    ("two axes out of mesh order", [0, 1, 2, 3], (2, 2), (9, 2), [[1, 0], []]),
    ("two axes out of mesh order, even", [0, 1, 2, 3], (2, 2), (8,), [[1, 0]]),
    ("an axis of size 1 only: replicated", [0, 1, 2, 3], (4, 1), (5, 3), [[], [1]]),
    ("an axis of size 1 on its own dim", [0, 1, 2, 3], (4, 1), (5, 3), [[0], [1]]),
    ("a size-1 axis in a tuple", [0, 1, 2, 3], (1, 4), (6, 3), [[0, 1], []]),
]


def random_cases(count: int, seed: int = 0):
    """Property-style cases: 1-D and 2-D meshes (sizes 1 included), device ids in order,
    flipped or permuted, tiny and uneven shapes, each mesh axis splitting a random dim or
    none (a dim split by several takes them in mesh order or reversed)."""
    rng = np.random.RandomState(seed)
    meshes = [(2,), (4,), (2, 2), (4, 1), (1, 4), (1, 2), (2, 1)]
    out = []
    for i in range(count):
        mesh_shape = meshes[rng.randint(len(meshes))]
        n = int(np.prod(mesh_shape))
        order = ["arange", "flip", "permute"][rng.randint(3)]
        ids = {"arange": np.arange(n), "flip": np.arange(n)[::-1],
               "permute": rng.permutation(n)}[order].tolist()
        ndim = rng.randint(1, 4)
        shape = tuple(int(v) for v in rng.randint(1, 10, size=ndim))
        dims: list[list[int]] = [[] for _ in range(ndim)]
        for a in range(len(mesh_shape)):
            d = rng.randint(-1, ndim)
            if d >= 0:
                dims[d].append(a)
        if rng.randint(2):  # a tuple's axes in another order than the mesh's
            dims = [axes[::-1] for axes in dims]
        out.append((f"random {i}: {order} ids on {mesh_shape}, {shape} split {dims}", ids, mesh_shape, shape, dims))
    return out


RANDOM_CASES = random_cases(60)


def spec_of(dims, names):
    """The partition spec (axis names) of ``dims``."""
    out = []
    for axes in dims:
        out.append(None if not axes else names[axes[0]] if len(axes) == 1 else tuple(names[a] for a in axes))
    return tuple(out)


def expected_shard(ids, mesh_shape, shape, dims, device):
    """(type, indices as (start, stop) per dim or None when replicated, padded shape, replica id).
    A dim split over several axes is tiled flat: ``ceil(size / product)`` per device, numbered
    along the axes in order (C order)."""
    grid = np.asarray(ids).reshape(mesh_shape)
    coord = [int(c) for c in np.argwhere(grid == device)[0]]
    split = {a for axes in dims for a in axes if mesh_shape[a] > 1}  # an axis of size 1 splits nothing
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
    if kind == "PARTIAL":  # the device's place among the devices holding the same block, by id
        same = grid[tuple(slice(None) if a in copies else coord[a] for a in range(len(mesh_shape)))]
        replica = sorted(int(d) for d in np.asarray(same).reshape(-1)).index(device)
    return kind, indices, tuple(padded), replica


def flat_tiled_values():
    """Plain PyTorch (no torchspmd): the inputs and expected values of
    tests/test_xla_semantics.py's flat-tiling checks."""
    import torch

    g = torch.Generator().manual_seed(0)
    x, w, r = torch.randn(9, 3, generator=g), torch.randn(3, 4, generator=g), torch.randn(9, 3, generator=g)
    xg = x.clone().requires_grad_(True)
    (xg.sin() * r).sum().backward()
    return dict(x=x, w=w, r=r, sin2=(x * 2).sin(), mm=x @ w, added=x + r, sin_grad=xg.grad)


def flat_tiled_training(steps: int = 3):
    """Plain PyTorch (no torchspmd): a two-layer model (9 hidden features) trained with SGD on
    random batches; the losses and final parameters tests/test_xla_semantics.py compares with
    FSDPv2 over a weight tiled flat."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for data, target in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, params={k: v.detach().clone() for k, v in model.state_dict().items()},
                batches=batches)
