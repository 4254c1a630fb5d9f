"""``torch_xla.distributed.fsdp.wrap`` under ``--xla-compat``: the auto-wrap policies."""

from torchspmd.compat.stand_ins import not_provided
from torchspmd.wrapping import (  # noqa: F401
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__getattr__ = not_provided("torch_xla.distributed.fsdp.wrap")
