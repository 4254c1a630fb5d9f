"""Changes to FSDP2 (``torch.distributed.fsdp._fully_shard``)."""

from __future__ import annotations

from typing import Callable

from torchspmd.patches import Patch, apply, replace_attribute

SHARED_PARAMS = Patch(
    name="FSDP2 foreach_all_gather / foreach_all_gather_copy_out",
    library="torch",
    what="FSDP2's all-gather and copy-out of a unit's parameters; units gathered through shared memory "
         "(SharedParamsAllGather) point their parameters at one shared copy per host "
         "(UntypedStorage._swap_data_ptr_), every other unit goes to FSDP2's own",
    why="FSDP2's custom all-gather hook (set_custom_all_gather) copies into and out of its own buffers; on one "
        "host the gathered parameters can be one copy in shared memory instead of one per process",
    checked="2.13.0, 2.14.1",
    feature="FSDPv2(collectives='shm') with shared parameters (CPU, one host)",
    targets=("torch.distributed.fsdp._fully_shard._fsdp_param_group:foreach_all_gather",
             "torch.distributed.fsdp._fully_shard._fsdp_param_group:foreach_all_gather_copy_out",
             "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs",
             "torch:UntypedStorage._swap_data_ptr_", "torch:_C._construct_storage_from_data_pointer"),
)


def route_all_gathers(gather: Callable, copy_out: Callable) -> None:
    """``gather(original, *args)`` and ``copy_out(original, *args)`` take FSDP2's calls."""
    def install():
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

        original_gather, original_copy_out = group_mod.foreach_all_gather, group_mod.foreach_all_gather_copy_out

        def foreach_all_gather(*args):
            return gather(original_gather, *args)

        def foreach_all_gather_copy_out(*args):
            return copy_out(original_copy_out, *args)

        undo = [replace_attribute(group_mod, "foreach_all_gather", foreach_all_gather),
                replace_attribute(group_mod, "foreach_all_gather_copy_out", foreach_all_gather_copy_out)]
        return lambda: [u() for u in reversed(undo)]

    apply(SHARED_PARAMS, install)


def available() -> bool:
    """Whether this torch has what ``SHARED_PARAMS`` touches."""
    try:
        SHARED_PARAMS.check()
    except Exception:
        return False
    return True
