"""``torch_xla.utils.checkpoint`` under ``--xla-compat``: ``checkpoint``."""

from __future__ import annotations

import torch.utils.checkpoint

from torchspmd.compat.stand_ins import not_provided


def checkpoint(function, *args, use_reentrant: bool = True, **kwargs):
    """``torch.utils.checkpoint.checkpoint``, reentrant by default as torch_xla's (its copy
    of torch's, with XLA's optimization barriers, which have nothing to bar here)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


__getattr__ = not_provided("torch_xla.utils.checkpoint")
