"""Changes to core torch objects: module registration and forward hooks, the global
function mode, optimizers' step wrapper, and (``--xla-compat``) the ``'xla'`` device."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn

from torchspmd.patches import Patch, applied, apply, replace_attribute

MODULE_SLOTS = Patch(
    name="torch.nn.Module registration hooks",
    library="torch",
    what="global parameter and buffer registration hooks record which module slots hold each tensor",
    why="mark_sharding annotates in place, as torch_xla: the sharded tensor goes into every slot that held the "
        "old one, found without walking the garbage collector",
    versions=">=2.13,<2.16",
    feature="mark_sharding in place",
    targets=("torch.nn.modules.module:register_module_parameter_registration_hook",
             "torch.nn.modules.module:register_module_buffer_registration_hook"),
)


def record_registrations(parameter: Callable, buffer: Callable) -> None:
    """``parameter(module, name, p)`` / ``buffer(module, name, b)`` on every registration."""
    from torch.nn.modules import module

    def install():
        handles = [module.register_module_parameter_registration_hook(parameter),
                   module.register_module_buffer_registration_hook(buffer)]
        return lambda: [h.remove() for h in handles]

    apply(MODULE_SLOTS, install)


GLOBAL_VIEW_MODE = Patch(
    name="torch function mode: implicit replication",
    library="torch",
    what="a TorchFunctionMode, entered for the process, lifts plain tensors that meet DTensors to replicated "
         "DTensors (GSPMD's unannotated means replicated) and makes host reads of sharded values whole",
    why="the global view: a program written for one device mixes its plain tensors with the global batches",
    versions=">=2.13,<2.16",
    feature="the global view (use_spmd on the native engine)",
    targets=("torch.overrides:TorchFunctionMode",),
)


def enter_mode(mode) -> None:
    """Enter ``mode`` for the rest of the process (until the patch is removed)."""
    def install():
        mode.__enter__()
        return lambda: mode.__exit__(None, None, None)

    apply(GLOBAL_VIEW_MODE, install)


OPTIMIZER_STEPS = Patch(
    name="torch.optim.Optimizer.profile_hook_step",
    library="torch",
    what="the wrapper torch puts around every optimizer class's step; classes already built are wrapped again",
    why="a data-parallel program's optimizer step (plain parameters only) runs outside the global view's "
        "function mode: no Python call per operation, as under DDP",
    versions=">=2.13,<2.16",
    feature="the automatic data-parallel path's optimizer step outside the function mode",
    needed=False,
    targets=("torch.optim:Optimizer.profile_hook_step",),
)


def wrap_optimizer_steps(outer: Callable[[Callable], Callable]) -> None:
    """``Optimizer.profile_hook_step`` becomes ``outer(step)`` then torch's own."""
    def install():
        original = torch.optim.Optimizer.__dict__["profile_hook_step"]
        torch_hook = original.__func__

        def hook_step(func):
            return torch_hook(outer(func))

        undo = [replace_attribute(torch.optim.Optimizer, "profile_hook_step", staticmethod(hook_step))]
        # optimizer classes already built once (before use_spmd(), or in the process this one
        # was forked from) had their step wrapped by torch's hook: wrap it again by this one
        pending = list(torch.optim.Optimizer.__subclasses__())
        while pending:
            cls = pending.pop()
            pending.extend(cls.__subclasses__())
            step = cls.__dict__.get("step")
            if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
                new = hook_step(step.__wrapped__)
                new.hooked = True
                undo.append(replace_attribute(cls, "step", new))
        return lambda: [u() for u in reversed(undo)]

    apply(OPTIMIZER_STEPS, install)


MODULE_FORWARD_HOOKS = Patch(
    name="torch.nn.Module global forward hooks",
    library="torch",
    what="global forward pre- and post-hooks on every module call",
    why="the automatic data-parallel path finds the outermost module a program calls on global batches",
    versions=">=2.13,<2.16",
    feature="the automatic data-parallel path",
    targets=("torch.nn.modules.module:register_module_forward_pre_hook",
             "torch.nn.modules.module:register_module_forward_hook",
             "torch.nn.modules.module:_global_forward_pre_hooks",
             "torch.nn.modules.module:_global_forward_hooks"),
)


def global_forward_hooks(pre: Callable, post: Callable) -> list:
    """Register ``pre`` and ``post`` (``with_kwargs``, ``always_call``) for every module;
    returns their handles (the path sets them aside while a module computes locally)."""
    from torch.nn.modules import module

    handles: list = []

    def install():
        handles.append(module.register_module_forward_pre_hook(pre))
        handles.append(module.register_module_forward_hook(post, with_kwargs=True, always_call=True))
        return lambda: [h.remove() for h in handles]

    apply(MODULE_FORWARD_HOOKS, install)
    return handles


def global_forward_hook_tables() -> tuple[dict, dict]:
    """torch's tables of global forward pre-hooks and hooks (ordered dicts by handle id)."""
    from torch.nn.modules import module

    return module._global_forward_pre_hooks, module._global_forward_hooks


PARAMETERS_ON_META = Patch(
    name="torch.nn.Module.register_parameter (meta)",
    library="torch",
    what="parameters registered while a model is built go to the meta device; buffers stay real",
    why="a model too large for one process is built without memory, then materialised shard by shard",
    versions=">=2.13,<2.16",
    feature="torchspmd train's model.meta_init",
    targets=("torch.nn:Module.register_parameter",),
)


def parameters_on_meta():
    """A context: parameters created inside it are on the meta device."""
    def install():
        original = nn.Module.register_parameter

        def register(module, name, param):
            original(module, name, param)
            if param is not None and param.device.type != "meta":
                p = module._parameters[name]
                module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

        return replace_attribute(nn.Module, "register_parameter", register)

    return applied(PARAMETERS_ON_META, install)


XLA_DEVICE = Patch(
    name="torch: the 'xla' device",
    library="torch",
    what="Tensor.to, Tensor.new_*, every torch.* factory with a device argument and torch.autocast take 'xla' "
         "(or 'xla:N', torch.device('xla')) to mean this process's device; a plain tensor they put there, or "
         "that Tensor.to puts on that device named as xm.xla_device() names it, comes back as an OnXlaDevice (a "
         "plain tensor whose object has DTensor's layout); nn.Parameter of one is a plain tensor's parameter",
    why="--xla-compat: torch_xla programs name the 'xla' device, which PyTorch cannot use without torch_xla",
    versions=">=2.13,<2.16",
    feature="--xla-compat",
    targets=("torch:Tensor.to", "torch:autocast", "torch.amp:autocast", "torch.utils._device:_device_constructors",
             "torch.nn:Parameter.__new__"),
)


def map_device(is_xla: Callable, native: Callable, placed: Callable = lambda source, t: t,
               is_native: Callable = lambda d: False, was_placed: Callable = lambda t: False,
               is_program_device: Callable = lambda d: False) -> None:
    """Calls given a device for which ``is_xla(d)`` holds get ``native()`` instead; their result
    is ``placed(source, result)`` (``source``: the tensor ``.to`` was called on, else None).
    ``Tensor.to`` given a device for which ``is_native(d)`` holds (the native device itself,
    as ``xm.xla_device()`` names it) places its result too, and so does a factory given the
    device object ``xm.xla_device()`` returned (``is_program_device(d)``: that object itself,
    not any equal device). ``nn.Parameter(t)`` of a tensor for which ``was_placed(t)`` holds is
    the parameter of a plain tensor over its data."""
    def wrap_device_kwarg(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            d = kwargs.get("device")
            if d is not None and is_xla(d):
                kwargs["device"] = native()
                return placed(None, fn(*args, **kwargs))
            if d is not None and is_program_device(d):
                return placed(None, fn(*args, **kwargs))
            return fn(*args, **kwargs)

        return call

    def wrap_to(fn):
        @functools.wraps(fn)
        def to(self, *args, **kwargs):
            xla = False
            if args and is_xla(args[0]):
                args, xla = (native(),) + args[1:], True
            elif args and is_native(args[0]):
                xla = True
            d = kwargs.get("device")
            if d is not None and is_xla(d):
                kwargs["device"], xla = native(), True
            elif d is not None and is_native(d):
                xla = True
            return placed(self, fn(self, *args, **kwargs)) if xla else fn(self, *args, **kwargs)

        return to

    class Autocast(torch.amp.autocast):
        def __init__(self, device_type, *args, **kwargs):  # (torch.autocast's own signature)
            if is_xla(device_type):
                device_type = native().type
            super().__init__(device_type, *args, **kwargs)

    def install():
        # torch.device('meta') as a context manager (and set_default_device) gives a device to
        # the factories found in a set of functions that torch builds once, when first asked,
        # from the torch.* attributes: built after the wrapping it would hold the wrappers, never
        # the functions the mode is called with, and factories would ignore the context
        # (transformers then initializes a model's non-persistent buffers on meta and loads
        # them as garbage). Build it now, from torch's own functions.
        from torch.utils import _device as torch_device

        torch_device._device_constructors()
        undo = [replace_attribute(torch.Tensor, "to", wrap_to(torch.Tensor.to))]
        for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided"):
            undo.append(replace_attribute(torch.Tensor, name, wrap_device_kwarg(getattr(torch.Tensor, name))))
        for name in _factories():
            undo.append(replace_attribute(torch, name, wrap_device_kwarg(getattr(torch, name))))
        undo.append(replace_attribute(torch, "autocast", Autocast))
        undo.append(replace_attribute(torch.amp, "autocast", Autocast))
        parameter_new = torch.nn.Parameter.__new__

        def new_parameter(cls, data=None, requires_grad=True):
            if data is not None and was_placed(data):  # (a subclass's Parameter would need its own detach())
                data = torch.Tensor._make_subclass(torch.Tensor, data, False)
            return parameter_new(cls, data, requires_grad)

        undo.append(replace_attribute(torch.nn.Parameter, "__new__", staticmethod(new_parameter)))
        return lambda: [u() for u in reversed(undo)]

    apply(XLA_DEVICE, install)


def _factories() -> list[str]:
    """Functions in ``torch`` documented with a ``device`` argument (the factories)."""
    names = []
    for name in dir(torch):
        if name.startswith("_"):
            continue
        fn = getattr(torch, name, None)
        if not callable(fn) or isinstance(fn, type):
            continue
        doc = getattr(fn, "__doc__", None) or ""
        if "device (:class:`torch.device`" in doc or "device=None" in doc:
            names.append(name)
    names += [n for n in ("normal", "scalar_tensor") if hasattr(torch, n)]
    return sorted(set(names))


PROCESS_GROUP_XLA = Patch(
    name="torch.distributed.init_process_group",
    library="torch",
    what="torch.distributed.init_process_group (and distributed_c10d's) is wrapped by a function given its "
         "arguments first, which may change them or answer the call itself",
    why="--xla-compat: torch_xla programs ask for the 'xla' backend and the 'xla://' init method, which PyTorch "
        "lacks without torch_xla, and call init_process_group after use_spmd() has started the process group, "
        "which PyTorch refuses (torch has no extension point for a second call)",
    versions=">=2.13,<2.16",
    feature="--xla-compat",
    targets=("torch.distributed:init_process_group", "torch.distributed.distributed_c10d:init_process_group"),
)


def wrap_init_process_group(outer: Callable[[Callable], Callable]) -> None:
    """``torch.distributed.init_process_group`` becomes ``outer(init_process_group)``."""
    def install():
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        original = distributed_c10d.init_process_group
        wrapped = functools.wraps(original)(outer(original))
        undo = [replace_attribute(distributed_c10d, "init_process_group", wrapped),
                replace_attribute(dist, "init_process_group", wrapped)]
        return lambda: [u() for u in reversed(undo)]

    apply(PROCESS_GROUP_XLA, install)


ATTENTION_HEADS = Patch(
    name="nn.MultiheadAttention.forward (per module, 'model' axis)",
    library="torch",
    what="the forward of an nn.MultiheadAttention whose projections are split over 'model' (that instance only) "
         "computes this process's heads and sums the output projection over 'model'",
    why="torch's parallel styles split Linear layers; nn.MultiheadAttention keeps its projections in one fused "
        "parameter and calls F.multi_head_attention_forward, which has no tensor-parallel form",
    versions=">=2.13,<2.16",
    feature="tensor parallelism of nn.MultiheadAttention over 'model'",
    targets=("torch.nn:MultiheadAttention.forward",),
    signatures={"torch.nn:MultiheadAttention.forward": (
        ("self", "query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
         "is_causal"),)},
)


def replace_attention_forward(mha: nn.MultiheadAttention, forward: Callable) -> None:
    """``mha.forward`` (this instance only) becomes ``forward``, which takes its arguments."""
    apply(ATTENTION_HEADS, lambda: None)
    replace_attribute(mha, "forward", forward)
