"""Device-id layouts of meshes, engine-neutral: a hybrid mesh laid out host by host."""

from __future__ import annotations

import numpy as np

from torchspmd.errors import SpmdError

__all__ = ["hybrid_layout"]


def hybrid_layout(ici_mesh_shape, dcn_mesh_shape, total: int, per_host: int):
    """Device ids of a hybrid mesh laid out host by host: each host's ``per_host`` devices
    (numbered consecutively) fill an ``ici`` block, and the hosts tile the mesh by ``dcn``."""
    ici = tuple(int(s) for s in ici_mesh_shape)
    dcn = tuple(int(s) for s in dcn_mesh_shape) if dcn_mesh_shape is not None else (1,) * len(ici)
    if len(ici) != len(dcn):
        raise SpmdError(f"HybridMesh: ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have the same number of axes")
    hosts = max(1, total // per_host)
    if int(np.prod(dcn)) != hosts:
        raise SpmdError(
            f"HybridMesh(dcn_mesh_shape={dcn}): the job has {hosts} host(s) of {per_host} devices; "
            f"the product of dcn_mesh_shape must equal the number of hosts"
        )
    if int(np.prod(ici)) != per_host:
        raise SpmdError(
            f"HybridMesh(ici_mesh_shape={ici}): each host has {per_host} devices; "
            f"the product of ici_mesh_shape must equal it"
        )
    host_meshes = [np.arange(h * per_host, (h + 1) * per_host).reshape(ici) for h in range(hosts)]
    # Tile the per-host meshes by the dcn shape: host (i, j, ...) occupies block (i, j, ...).
    grid = np.arange(hosts).reshape(dcn)
    full = np.empty(tuple(a * b for a, b in zip(ici, dcn)), dtype=np.int64)
    for idx in np.ndindex(*dcn):
        block = tuple(slice(i * s, (i + 1) * s) for i, s in zip(idx, ici))
        full[block] = host_meshes[int(grid[idx])]
    return ici, dcn, full
