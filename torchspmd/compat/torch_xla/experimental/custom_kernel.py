"""``torch_xla.experimental.custom_kernel`` under ``--xla-compat``: ``flash_attention`` (torch_xla's
Pallas kernel) as PyTorch's ``scaled_dot_product_attention``, the same function of its inputs.

torch_xla's kernel computes ``softmax(q k^T * sm_scale + ab) v`` over ``(batch, heads, seq, dim)``
tensors, causally masked when ``causal``; ``partition_spec`` and ``mesh`` say how its inputs are
sharded (they are sharded already here: a DTensor carries its layout). Segment ids (packed
sequences) are not provided. The other kernels (paged, ragged, quantized matmuls) are TPU Pallas
kernels and fail at use.
"""

from __future__ import annotations

import torch.nn.functional as F

from torchspmd.compat.names import NotProvidedError, message
from torchspmd.compat.stand_ins import not_provided

__all__ = ["flash_attention"]


def flash_attention(q, k, v, causal: bool = False, q_segment_ids=None, kv_segment_ids=None, sm_scale: float = 1.0,
                    *, ab=None, partition_spec=None, mesh=None):
    """``softmax(q k^T * sm_scale + ab) v``, causal when ``causal`` (torch_xla's default scale is
    1.0, not 1/sqrt(dim), as here)."""
    if q_segment_ids is not None or kv_segment_ids is not None:
        raise NotProvidedError(message("torch_xla.experimental.custom_kernel.flash_attention(q_segment_ids=...)"))
    if causal and ab is not None:
        mask = ab.new_full((q.shape[-2], k.shape[-2]), float("-inf")).triu(1) + ab
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ab, is_causal=causal, scale=sm_scale)


__getattr__ = not_provided("torch_xla.experimental.custom_kernel")
