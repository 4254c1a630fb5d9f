"""Changes to FSDP2 (``torch.distributed.fsdp._fully_shard``)."""

from __future__ import annotations

import functools
from typing import Callable

from torchspmd.patches import Patch, apply, parameters, replace_attribute, resolve

_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_GATHER = f"{_GROUP}:foreach_all_gather"
_COPY_OUT = f"{_GROUP}:foreach_all_gather_copy_out"
#: torch 2.15's copy-out takes the param group's own output function (``all_gather_output_fn``):
#: there each unit gathered through shared memory gets its own, and the module's copy-out stays
_COPY_OUT_WITH_HOOK = ("all_gather_result", "fsdp_params", "group", "all_gather_output_fn")

_DEFAULT_OUTPUT = "torch.distributed.fsdp._fully_shard._fsdp_collectives:_default_all_gather_output_fn"
_OUTPUT_PARAMETERS = ("fsdp_params", "all_gather_result", "world_size")


def _output_hook_as_verified() -> str | None:
    """Where the copy-out takes a unit's own output function (torch 2.15), that function is
    called as ``(fsdp_params, all_gather_result, world_size)``, as verified."""
    if parameters(resolve(_COPY_OUT)) != _COPY_OUT_WITH_HOOK:
        return None
    try:
        default = resolve(_DEFAULT_OUTPUT)
    except (ImportError, AttributeError):
        return f"{_COPY_OUT} takes all_gather_output_fn but {_DEFAULT_OUTPUT} is missing"
    if parameters(default) != _OUTPUT_PARAMETERS:
        return (f"{_DEFAULT_OUTPUT} takes ({', '.join(parameters(default) or ('?',))}), not "
                f"({', '.join(_OUTPUT_PARAMETERS)})")
    return None


SHARED_PARAMS = Patch(
    name="FSDP2 foreach_all_gather / foreach_all_gather_copy_out",
    library="torch",
    what="FSDP2's all-gather of a unit's parameters and its copy-out (torch 2.13-2.14: the module's "
         "foreach_all_gather_copy_out; torch 2.15: the unit's own FSDPParamGroup._all_gather_output_fn), and the "
         "free of a gathered parameter (FSDPParam.free_unsharded_param, per parameter); units "
         "gathered through shared memory (SharedParamsAllGather) point their parameters at one shared copy per host "
         "(UntypedStorage._swap_data_ptr_), every other unit goes to FSDP2's own with the arguments it was given",
    why="FSDP2's custom all-gather hook (set_custom_all_gather) copies into and out of its own buffers; on one "
        "host the gathered parameters can be one copy in shared memory instead of one per process",
    versions=">=2.13,<2.16",
    feature="FSDPv2's gathered parameters held once per machine (CPU, one host: collectives='shm')",
    needed=False,
    also=_output_hook_as_verified,
    targets=(_GATHER, _COPY_OUT, "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs",
             "torch.distributed.fsdp._fully_shard._fsdp_collectives:AllGatherResult",
             "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.free_unsharded_param",
             "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_all_gather_outputs",
             "torch:UntypedStorage._swap_data_ptr_", "torch:_C._construct_storage_from_data_pointer"),
    signatures={
        _GATHER: (("fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream", "device",
                   "all_gather_comm"),),
        _COPY_OUT: (("all_gather_result", "fsdp_params", "group"), _COPY_OUT_WITH_HOOK),
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.free_unsharded_param": (("self",),),
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_all_gather_outputs": (
            ("self", "all_gather_input_numels", "all_gather_input_dtypes", "world_size", "device"),),
        "torch.distributed.fsdp._fully_shard._fsdp_collectives:AllGatherResult": (
            ("all_gather_output", "all_gather_event", "all_gather_work", "param_all_gather_input_dtypes",
             "param_all_gather_input_numels", "all_gather_input_split_sizes"),),
    },
)


def output_hook_per_unit() -> bool:
    """Whether this torch's FSDP2 copy-out calls each unit's own output function (2.15)."""
    return parameters(resolve(_COPY_OUT)) == _COPY_OUT_WITH_HOOK


def route_all_gathers(gather: Callable, copy_out: Callable) -> bool:
    """``gather(original, *args, **kwargs)`` takes FSDP2's all-gathers, ``copy_out(original,
    *args, **kwargs)`` its copy-outs where the module's copy-out is replaced (torch 2.13-2.14;
    on 2.15 a unit's copy-out is given with :func:`set_output_function`). Returns whether the
    routing is in place: False where the patch cannot apply on this torch (one warning), and
    FSDP2's own all-gather runs."""
    def install():
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

        original_gather, original_copy_out = group_mod.foreach_all_gather, group_mod.foreach_all_gather_copy_out

        @functools.wraps(original_gather)
        def foreach_all_gather(*args, **kwargs):
            return gather(original_gather, *args, **kwargs)

        undo = [replace_attribute(group_mod, "foreach_all_gather", foreach_all_gather)]
        if not output_hook_per_unit():
            @functools.wraps(original_copy_out)
            def foreach_all_gather_copy_out(*args, **kwargs):
                return copy_out(original_copy_out, *args, **kwargs)

            undo.append(replace_attribute(group_mod, "foreach_all_gather_copy_out", foreach_all_gather_copy_out))
        return lambda: [u() for u in reversed(undo)]

    return apply(SHARED_PARAMS, install)


def can_set_output_function(param_group) -> bool:
    """Whether ``param_group`` (an FSDPParamGroup) holds its own output function as verified
    (torch 2.15's default, or one this module set: not one set by someone else)."""
    fn = getattr(param_group, "_all_gather_output_fn", None)
    return fn is not None and (getattr(fn, "_torchspmd_output", False) or fn is resolve(_DEFAULT_OUTPUT))


def set_output_function(param_group, fn: Callable) -> None:
    """torch 2.15: ``fn(original, fsdp_params, all_gather_result, world_size)`` copies out the
    gathered parameters of ``param_group`` (an FSDPParamGroup; ``original``: its own function)."""
    original = param_group._all_gather_output_fn
    if getattr(original, "_torchspmd_output", False):
        return

    @functools.wraps(original)
    def output_fn(*args, **kwargs):
        return fn(original, *args, **kwargs)

    output_fn._torchspmd_output = True
    replace_attribute(param_group, "_all_gather_output_fn", output_fn)


def before_free(fsdp_param, release: Callable) -> None:
    """``release(fsdp_param)`` runs first whenever FSDP2 frees ``fsdp_param``'s gathered
    parameter (its ``free_unsharded_param``, that FSDPParam only; set once)."""
    if "free_unsharded_param" in vars(fsdp_param):
        return
    free = fsdp_param.free_unsharded_param

    def free_unsharded_param(*args, **kwargs):
        release(fsdp_param)
        return free(*args, **kwargs)

    replace_attribute(fsdp_param, "free_unsharded_param", free_unsharded_param)


def available() -> bool:
    """Whether ``SHARED_PARAMS`` can apply on this torch."""
    return SHARED_PARAMS.problem() is None
