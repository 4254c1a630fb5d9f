"""Mesh shapes and partition specs whose HLO sharding text is compared with torch_xla's:
tests/xla/test_xla_compat_hlo.py asks torch_xla itself (in the torch_xla environment),
tests/test_xla_compat.py asks the layer on 4 processes. Each: (mesh_shape, axis names,
device ids in mesh order, tensor shape, partition spec)."""

CASES = [
    ((4,), ("data",), [0, 1, 2, 3], (8, 6), ("data", None)),
    ((4,), ("data",), [0, 1, 2, 3], (8, 6), (None, "data")),
    ((4,), ("data",), [0, 1, 2, 3], (8, 6), (None, None)),
    ((2, 2), ("data", "fsdp"), [0, 1, 2, 3], (8, 6), ("fsdp", None)),
    ((2, 2), ("data", "fsdp"), [0, 1, 2, 3], (8, 6), ("data", None)),
    ((2, 2), ("data", "fsdp"), [0, 1, 2, 3], (8, 6), ("data", "fsdp")),
    ((2, 2), ("data", "fsdp"), [0, 1, 2, 3], (8, 6), ("fsdp", "data")),
    ((2, 2), ("data", "fsdp"), [0, 1, 2, 3], (8, 6), (("data", "fsdp"), None)),
    ((2, 2), ("data", "fsdp"), [0, 1, 2, 3], (4, 6, 10), (None, "fsdp", None)),
    ((4, 1), ("fsdp", "model"), [0, 1, 2, 3], (8, 6), ("fsdp", None)),
    ((4, 1), ("fsdp", "model"), [0, 1, 2, 3], (8, 6), ("fsdp", "model")),
    ((1, 4), ("fsdp", "model"), [0, 1, 2, 3], (8, 6), (None, "model")),
    ((2, 2), ("fsdp", "model"), [3, 1, 2, 0], (8, 6), ("fsdp", None)),
    ((2, 2), ("fsdp", "model"), [3, 1, 2, 0], (8, 6), ("model", "fsdp")),
    ((4,), ("data",), [3, 2, 1, 0], (8, 6), ("data", None)),
    ((2, 2), ("data", "fsdp"), [0, 2, 1, 3], (8, 6), (("data", "fsdp"), None)),
]
