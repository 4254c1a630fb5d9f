"""``torch_xla.distributed.spmd`` (``xs``) under ``--xla-compat``: torchspmd's meshes and
annotations. ``mark_sharding`` annotates a parameter or buffer in place (and returns the
sharded tensor: a DTensor on the native engine, where torch_xla returns an
``XLAShardedTensor``)."""

from torchspmd.compat import xla_tensors
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
    disable_manual_sharding,
    enable_manual_sharding,
    mark_sharding,
    mark_sharding_with_gradients,
)
from torchspmd.compat.torch_xla.distributed.spmd.xla_sharded_tensor import XLAShardedTensor  # noqa: F401
from torchspmd.sharding import clear_sharding as _clear_sharding
from torchspmd.layouts.xla_shards import ShardingType, XLAShard  # noqa: F401


def clear_sharding(t):
    """Drop the annotation of ``t`` in place, as torch_xla does: a sharded tensor becomes its
    whole value (a parameter or buffer is replaced in every module slot holding it); returns it."""
    return xla_tensors.clear_in_place(t, _clear_sharding(t))


def wrap_if_sharded(x):
    """``x`` as it is: a sharded tensor is a DTensor, which is an ``XLAShardedTensor`` here."""
    return x


def apply_backward_optimization_barrier(m) -> None:
    """Nothing: a barrier to XLA's fusion of the module's backward with others; the native
    engine runs operations as issued."""

__all__ = ["HybridMesh", "Mesh", "ShardingSpec", "ShardingType", "XLAShard", "apply_backward_optimization_barrier",
           "auto_policy", "convert_to_xla_mesh", "xla_distribute_module", "xla_distribute_tensor",
           "XLAShardedTensor", "wrap_if_sharded",
           "clear_sharding", "disable_manual_sharding", "enable_manual_sharding", "get_1d_mesh", "get_global_mesh",
           "mark_sharding", "mark_sharding_with_gradients", "set_global_mesh"]
__getattr__ = not_provided("torch_xla.distributed.spmd")
