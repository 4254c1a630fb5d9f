"""``torch_xla.distributed.fsdp.wrap`` under ``--xla-compat``: the auto-wrap policies."""

from torchspmd import (  # noqa: F401
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torchspmd.compat import not_provided

__getattr__ = not_provided("torch_xla.distributed.fsdp.wrap")
