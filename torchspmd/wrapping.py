"""Auto-wrap policies and the recursive wrapper, with torch_xla's signatures
(``torch_xla.distributed.fsdp.wrap``): a policy is called as
``policy(module=m, recurse=bool, unwrapped_params=int)``; with ``recurse=True`` it says
whether to look inside ``m``, with ``recurse=False`` whether to wrap ``m`` itself."""

from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn

from torchspmd.errors import SpmdError

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "recursive_wrap",
]


def always_wrap_policy(*args, **kwargs) -> bool:
    """Wrap every submodule (that has parameters left to wrap)."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, lambda_fn: Callable) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, transformer_layer_cls: Iterable[type]
) -> bool:
    """Wrap every instance of the given layer classes (e.g. ``{DecoderLayer}``)."""
    if isinstance(transformer_layer_cls, type):
        name = transformer_layer_cls.__name__
        raise SpmdError(f"transformer_auto_wrap_policy(transformer_layer_cls={name}): give a set of layer classes, "
                        f"e.g. transformer_layer_cls={{{name}}}")
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


DEFAULT_FORCE_LEAF_MODULES = {nn.MultiheadAttention}
DEFAULT_EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type] | None = None,
    exclude_wrap_modules: set[type] | None = None,
) -> bool:
    """Wrap a module once the parameters not yet wrapped below it reach ``min_num_params``;
    never look inside ``force_leaf_modules``, never wrap ``exclude_wrap_modules``."""
    force_leaf = tuple(DEFAULT_FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    exclude = tuple(DEFAULT_EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, force_leaf)
    return is_large and not isinstance(module, exclude)


def recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable,
    wrapper_cls: Callable,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
    only_wrap_children: bool = False,
    **wrapper_kwargs,
) -> tuple[nn.Module, int]:
    """Wrap ``module``'s subtree bottom-up as the policy says; return the (possibly
    wrapped) module and the number of parameters wrapped."""
    ignored_modules = set(ignored_modules)
    ignored_params = set(ignored_params)
    unwrapped = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not auto_wrap_policy(module=module, recurse=True, unwrapped_params=unwrapped):
        return module, 0
    wrapped_total = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        new_child, n = recursive_wrap(
            child, auto_wrap_policy, wrapper_cls, ignored_modules, ignored_params, False, **wrapper_kwargs
        )
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_total += n
    remainder = unwrapped - wrapped_total
    if not only_wrap_children and auto_wrap_policy(module=module, recurse=False, unwrapped_params=remainder):
        return wrapper_cls(module, **wrapper_kwargs), unwrapped
    return module, wrapped_total
