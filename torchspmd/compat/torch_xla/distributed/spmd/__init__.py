"""``torch_xla.distributed.spmd`` (``xs``) under ``--xla-compat``: torchspmd's meshes and
annotations. ``mark_sharding`` annotates a parameter or buffer in place (and returns the
sharded tensor: a DTensor on the native engine, where torch_xla returns an
``XLAShardedTensor``)."""

from torchspmd.compat.stand_ins import not_provided
from torchspmd.compat.torch_xla.distributed.spmd import debugging  # noqa: F401
from torchspmd.compat.torch_xla.distributed.spmd.api import (  # noqa: F401
    auto_policy,
    convert_to_xla_mesh,
    xla_distribute_module,
    xla_distribute_tensor,
)
from torchspmd.mesh import (  # noqa: F401
    HybridMesh,
    Mesh,
    get_1d_mesh,
    get_global_mesh,
    set_global_mesh,
)
from torchspmd.sharding import (  # noqa: F401
    ShardingSpec,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    mark_sharding,
    mark_sharding_with_gradients,
)
from torchspmd.xla_shards import ShardingType, XLAShard  # noqa: F401


def apply_backward_optimization_barrier(m) -> None:
    """Nothing: a barrier to XLA's fusion of the module's backward with others; the native
    engine runs operations as issued."""

__all__ = ["HybridMesh", "Mesh", "ShardingSpec", "ShardingType", "XLAShard", "apply_backward_optimization_barrier",
           "auto_policy", "convert_to_xla_mesh", "xla_distribute_module", "xla_distribute_tensor",
           "clear_sharding", "disable_manual_sharding", "enable_manual_sharding", "get_1d_mesh", "get_global_mesh",
           "mark_sharding", "mark_sharding_with_gradients", "set_global_mesh"]
__getattr__ = not_provided("torch_xla.distributed.spmd")
