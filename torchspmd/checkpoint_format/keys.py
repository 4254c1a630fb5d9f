"""State-dict keys: the unwrapped module's names under an FSDPv2 wrapper, and a whole
state dict matched to a model's keys (both engines' ``load_full_state_dict``).

Both engines' FSDPv2 keep the wrapped module as ``_orig_module``: the wrapper's parameter
names and state-dict keys are the unwrapped module's, so that a state dict loads into the
plain model and the plain model's into the wrapper.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from torchspmd.errors import SpmdError

__all__ = ["PREFIX", "clean", "strip_prefix_hook", "add_prefix_hook", "match"]

PREFIX = "_orig_module."
_PREFIX_RE = re.compile(r"(^|\.)_orig_module\.")


def clean(name: str) -> str:
    """``name`` without the wrappers' ``_orig_module.`` parts."""
    return _PREFIX_RE.sub(r"\1", name)


def strip_prefix_hook(module, state_dict, prefix, local_metadata):
    """A state-dict hook: the wrapper's keys without ``_orig_module.``."""
    for key in list(state_dict.keys()):
        if key.startswith(prefix) and PREFIX in key[len(prefix):]:
            state_dict[prefix + clean(key[len(prefix):])] = state_dict.pop(key)
    return state_dict


def add_prefix_hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """A load-state-dict pre-hook: the unwrapped module's keys under ``_orig_module.``."""
    for key in list(state_dict.keys()):
        if key.startswith(prefix) and not key.startswith(prefix + PREFIX):
            state_dict[prefix + PREFIX + key[len(prefix):]] = state_dict.pop(key)


def _aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters: each extra name of a shared parameter -> its first name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = clean(name)
        if id(p) in first and first[id(p)] != name:
            out[name] = first[id(p)]
        else:
            first.setdefault(id(p), name)
    return out


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """When the state dict's names are the model's with a prefix added or taken away
    (``module.``, ``_orig_mod.``, ``model.``), say which."""
    for extra, short, verb in ((unexpected, missing, "strip the prefix {!r} from"),
                               (missing, unexpected, "add the prefix {!r} to")):
        prefixes = {long[: -len(k)] for long in extra for k in short if long.endswith("." + k)}
        if len(prefixes) == 1:
            prefix, known = prefixes.pop(), set(short)
            renamed = sum(long.startswith(prefix) and long[len(prefix):] in known for long in extra)
            if renamed == min(len(extra), len(short)):
                return "the names differ by a prefix: " + verb.format(prefix) + " the state dict's keys"
    return ""


def match(model: nn.Module, current: dict, state_dict: dict, strict: bool):
    """Pair each of the model's entries with its value in ``state_dict`` (a tied parameter
    under any of its names): ``[(key, current, value)]`` and the keys without one. Values
    must be tensors of the model's shapes; with ``strict`` no key may be missing or left
    over. Nothing is loaded when a check fails; each error names every key at fault."""
    aliases = _aliases(model)
    pairs, missing, wrong = [], [], []
    for key, cur in current.items():
        names = [key, aliases.get(key)] + [other for other, first in aliases.items() if first == key]
        name = next((n for n in names if n is not None and n in state_dict), None)
        if name is None:
            missing.append(key)
            continue
        src = state_dict[name]
        if not isinstance(src, torch.Tensor):
            raise SpmdError(f"load_full_state_dict: the value of {name!r} is a {type(src).__name__}, not a tensor; "
                            f"give tensors (torch.as_tensor(value))")
        if tuple(src.shape) != tuple(cur.shape):
            wrong.append(f"{name!r} has shape {tuple(src.shape)} in the state dict and {tuple(cur.shape)} in the model")
        pairs.append((key, cur, src))
    if wrong:
        raise SpmdError(f"load_full_state_dict: {', '.join(wrong)}; the state dict comes from a model of another "
                        f"shape: build the model with the same configuration")
    unexpected = sorted(set(state_dict) - set(current) - set(aliases)) if strict else []
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"the state dict has no value for {len(missing)} of the model's keys: {_names(missing)}")
        if unexpected:
            parts.append(f"{'and it' if missing else 'the state dict'} has {len(unexpected)} keys the model lacks: "
                         f"{_names(unexpected)}")
        if missing and unexpected:
            fix = _prefix_hint(missing, unexpected) or (
                "pass strict=False to keep the model's own values for the first and ignore the others")
        elif missing:
            fix = "pass strict=False to keep the model's own values for them"
        else:
            fix = "pass strict=False to ignore them"
        raise SpmdError(f"load_full_state_dict: {'; '.join(parts)}; {fix}")
    return pairs, missing
