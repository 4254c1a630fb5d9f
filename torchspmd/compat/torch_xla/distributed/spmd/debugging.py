"""``torch_xla.distributed.spmd.debugging`` under ``--xla-compat``: the visualizations, and
``construct_v1_sharding_str`` (torch_xla after 2.9; its tests use it)."""

from torchspmd.compat.stand_ins import not_provided
from torchspmd.engines.native.sharded_view import sharding_string
from torchspmd.sharding import visualize_sharding, visualize_tensor_sharding  # noqa: F401


def construct_v1_sharding_str(t) -> str:
    """The HLO sharding text of ``t`` in XLA's V1 form (``{devices=[2,1,2]0,1,2,3
    last_tile_dim_replicate}``, ``{replicated}``; ``''`` without a sharding): the text
    ``torch_xla._XLAC._get_xla_sharding_spec`` gives, which is always V1 here."""
    return sharding_string(t)


__getattr__ = not_provided("torch_xla.distributed.spmd.debugging")
