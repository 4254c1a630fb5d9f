"""``torch_xla.distributed.spmd.debugging`` under ``--xla-compat``: the visualizations, and
``construct_v1_sharding_str`` (torch_xla after 2.9; its tests use it)."""

import torch

from torchspmd import engines, runtime
from torchspmd.layouts import hlo, sharding_table
from torchspmd.compat.stand_ins import not_provided


def visualize_sharding(sharding, use_color: bool = True, scale: float = 1.0, min_width: int = 9,
                       max_width: int = 80):
    """torch_xla's table of a sharding text (a sharded tensor is taken too): one cell per tile of
    its first two tile dims, labelled with the devices that hold it, as torch_xla draws it
    (``scale`` and ``min_width`` change nothing in its drawing either)."""
    if isinstance(sharding, torch.Tensor):
        sharding = engines.planned().sharding_string(sharding)
    print(f"Visualizing {sharding} (showing up to the first two dimensions)")
    cells = hlo.cells(sharding, runtime.global_runtime_device_count(), in_text_order=True)
    return sharding_table.render_as_torch_xla(cells, runtime.device_type().upper(), use_color, max_width)


def visualize_tensor_sharding(t, **kwargs):
    """``visualize_sharding`` of ``t``'s sharding text."""
    return visualize_sharding(engines.planned().sharding_string(t), **kwargs)


def construct_v1_sharding_str(t) -> str:
    """The HLO sharding text of ``t`` in XLA's V1 form (``{devices=[2,1,2]0,1,2,3
    last_tile_dim_replicate}``, ``{replicated}``; ``''`` without a sharding): the text
    ``torch_xla._XLAC._get_xla_sharding_spec`` gives, which is always V1 here."""
    return engines.planned().sharding_string(t)


__getattr__ = not_provided("torch_xla.distributed.spmd.debugging")
