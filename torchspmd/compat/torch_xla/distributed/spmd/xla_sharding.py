"""``torch_xla.distributed.spmd.xla_sharding`` (where torch_xla defines ``xs``'s names) under
``--xla-compat``: the same names as ``torch_xla.distributed.spmd``."""

from torchspmd.compat import not_provided
from torchspmd.compat.torch_xla.distributed.spmd import (  # noqa: F401
    HybridMesh,
    Mesh,
    ShardingSpec,
    ShardingType,
    XLAShard,
    apply_backward_optimization_barrier,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    get_1d_mesh,
    get_global_mesh,
    mark_sharding,
    mark_sharding_with_gradients,
    set_global_mesh,
)

__getattr__ = not_provided("torch_xla.distributed.spmd.xla_sharding")
