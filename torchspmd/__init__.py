"""torchspmd: PyTorch/XLA's SPMD programming model on PyTorch's own distributed engine,
and on torch_xla itself on TPUs (the torch_xla engine, ``torchspmd/engines/xla/``).

Write the program for one device, annotate shardings on a named mesh, run it on every
device. The public API lives here; see README.md and docs/.
"""

from torchspmd import device_plugins

device_plugins.check()  # before torch: a device plugin that would abort `import torch` is named instead


from torchspmd.data import MpDeviceLoader, shard_batch
from torchspmd.errors import SpmdError
from torchspmd.explain import explain
from torchspmd.mesh import (
    HybridMesh,
    Mesh,
    get_1d_mesh,
    get_global_mesh,
    set_global_mesh,
)
from torchspmd.parallel import (
    FSDPv2,
    SpmdFullyShardedDataParallel,
    always_wrap_policy,
    auto_path,
    checkpoint_module,
    clip_grad_norm_,
    full_state_dict,
    lambda_auto_wrap_policy,
    load_full_state_dict,
    pipeline,
    replicate,
    set_auto_replicate,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torchspmd.runtime import (
    addressable_device_count,
    addressable_runtime_device_count,
    backend,
    current_step,
    device,
    device_type,
    global_device_count,
    global_ordinal,
    global_runtime_device_count,
    is_spmd,
    local_device_count,
    local_ordinal,
    process_count,
    process_index,
    step,
    use_spmd,
    world_size,
)
from torchspmd.sharding import (
    ShardingSpec,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    get_sharding,
    mark_sharding,
    mark_sharding_with_gradients,
    visualize_sharding,
    visualize_tensor_sharding,
)
from torchspmd.version import __version__  # noqa: F401
from torchspmd.layouts.xla_shards import ShardingType, XLAShard

__all__ = [
    "SpmdError",
    "set_auto_replicate",
    "auto_path",
    "use_spmd",
    "is_spmd",
    "backend",
    "device",
    "device_type",
    "global_runtime_device_count",
    "global_device_count",
    "addressable_runtime_device_count",
    "addressable_device_count",
    "local_device_count",
    "global_ordinal",
    "local_ordinal",
    "process_index",
    "process_count",
    "world_size",
    "step",
    "current_step",
    "Mesh",
    "HybridMesh",
    "get_1d_mesh",
    "set_global_mesh",
    "get_global_mesh",
    "mark_sharding",
    "mark_sharding_with_gradients",
    "enable_manual_sharding",
    "disable_manual_sharding",
    "ShardingType",
    "XLAShard",
    "explain",
    "clear_sharding",
    "get_sharding",
    "ShardingSpec",
    "visualize_sharding",
    "visualize_tensor_sharding",
    "MpDeviceLoader",
    "shard_batch",
    "replicate",
    "pipeline",
    "SpmdFullyShardedDataParallel",
    "FSDPv2",
    "checkpoint_module",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]
