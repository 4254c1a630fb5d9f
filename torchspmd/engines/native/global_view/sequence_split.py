"""A sequence split across devices (a batch annotated on its sequence dim, the ``'context'``
axis): linear layers on each process's positions, and attention of each process's queries
against every key: keys and values split like the queries go around the axis's ring
(``ring_attention``); others are gathered per call (what GSPMD does).

``multi_head_attention``: ``nn.MultiheadAttention``'s self-attention (its packed projection,
no key padding mask, no weights returned) as the same projections and the same attention,
each through the two above, in the batch-first layout.

``linear``: ``F.linear`` computes each position from that position alone. DTensor computes
it as a matrix product of the input flattened to ``(batch * seq, features)``, and a flattened
dim split over two axes cannot be laid out, so it gathers the sequence whole first. Here each
process applies the (replicated) weight to its positions; the weight's gradient is each
process's share, summed over the axes that split the input.

A batch annotated ``('fsdp', 'context')`` (or any spec naming a mesh axis on the sequence
dim) reaches attention as DTensors whose sequence dim (``-2`` of ``(batch, heads, seq,
head_dim)``) is split over that axis. Every other op of a decoder computes each position from
that position alone, and DTensor's own sharding rules keep the split through them; attention
mixes positions, and DTensor's rule for it would gather queries, keys and values whole and
compute the whole attention on every process. Here instead each process keeps its queries
and computes its rows of the attention against every key (the ring, or the keys and values
gathered over the axis): a query row of attention depends on that row of the queries and of the mask and on the
whole keys and values, nothing else, so the rows are one device's rows. The mask is taken
whole and cut to this process's rows, so a causal (``is_causal``: its rows from the global
positions), padding, 4D or per-document mask gives one device's result. The gradient of
gathered keys and values is each process's share, summed over the axis into each process's
split (a reduce-scatter); the ring brings each block's gradient home. The output keeps the
queries' split.

Where any of that does not hold (queries split over several axes on the sequence dim, a
pending sum, dropout, a mask that needs a gradient, keys or values of another layout that
cannot be gathered alike) nothing is done here: DTensor's own rule runs, which gathers and is
exact too.
"""

from __future__ import annotations

from typing import Any

import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchspmd.engines.native.global_view.ring_attention import ring_attention
from torchspmd.errors import SpmdError
from torchspmd.layouts.blocks import contiguous_stride
from torchspmd.tree import walk_tensors

__all__ = ["attend", "inner_split", "linear", "multi_head_attention", "split_sequence_axes", "axes_splitting_positions"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def axes_splitting_positions(inputs: Any, data_dims: list[int]) -> list[int]:
    """The mesh dims, other than ``data_dims``, that split some DTensor in ``inputs`` on a dim
    other than its first (a batch annotated ``('fsdp', 'context')`` splits the sequence)."""
    found: set[int] = set()

    def seen(t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            found.update(i for i, p in enumerate(t.placements)
                         if isinstance(p, Shard) and p.dim > 0 and i not in data_dims)

    walk_tensors(inputs, seen)
    return sorted(found)


def split_sequence_axes(q: DTensor) -> list[int]:
    """The mesh dims over which ``q``'s sequence dim (``-2``) is split."""
    seq = q.ndim - 2
    return [i for i, p in enumerate(q.placements) if isinstance(p, Shard) and p.dim == seq]


class _KeepLayout(torch.autograd.Function):
    """The identity, whose gradient keeps the input's memory layout: DTensor turns the local
    gradient back into a DTensor with the forward's strides, and a later view of it needs
    the local memory laid out as those strides say (a kernel's gradient may come transposed)."""

    @staticmethod
    def forward(ctx, t):
        ctx.stride = t.stride()
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if grad is None or grad.stride() == ctx.stride:
            return grad
        return torch.empty_strided(grad.shape, ctx.stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def _local(t: DTensor, grad_placements=None) -> torch.Tensor:
    """``t``'s local tensor, its gradient laid out as it is."""
    return _KeepLayout.apply(t.to_local(grad_placements=grad_placements))


def _arguments(args: tuple, kwargs: dict) -> dict | None:
    bound = dict(zip(_SDPA_ARGS, args))
    for name, value in kwargs.items():
        if name not in _SDPA_ARGS or name in bound:
            return None
        bound[name] = value
    return bound


def _rows(size: int, parts: int, index: int) -> tuple[int, int]:
    """Where part ``index`` of ``size`` positions split in ``parts`` starts, and its length
    (``torch.chunk``'s split, which DTensor's ``Shard`` uses: the last parts may be shorter
    or empty)."""
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, min(chunk, size - start)


def _mask_rows(mask: torch.Tensor, q: DTensor, axes: list[int], start: int, length: int) -> torch.Tensor:
    """This process's rows of ``mask`` (broadcastable to ``(batch, heads, q_seq, k_seq)``),
    split on the other dims as the queries are."""
    mesh = q.device_mesh
    if not isinstance(mask, DTensor):  # a plain tensor holds the whole mask on every process
        mask = DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False)
    while mask.ndim < q.ndim:
        mask = mask.unsqueeze(0)
    target = []
    for i, p in enumerate(q.placements):
        if i not in axes and isinstance(p, Shard) and mask.shape[p.dim] == q.shape[p.dim] and mask.shape[p.dim] > 1:
            target.append(Shard(p.dim))
        else:
            target.append(Replicate())
    local = mask.redistribute(mesh, target).to_local()
    if local.shape[-2] == q.shape[-2] and q.shape[-2] > 1:
        local = local.narrow(-2, start, length)
    return local


def attend(args: tuple, kwargs: dict) -> DTensor | None:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` with the queries' sequence split
    over one mesh axis: this process's query rows against the gathered keys and values. None
    where it does not apply (the caller then runs the op as it is)."""
    a = _arguments(args, kwargs)
    if a is None or not all(isinstance(a.get(n), DTensor) for n in ("query", "key", "value")):
        return None
    q, k, v = a["query"], a["key"], a["value"]
    mesh = q.device_mesh
    if k.device_mesh != mesh or v.device_mesh != mesh or not (q.ndim == k.ndim == v.ndim >= 3):
        return None
    axes = split_sequence_axes(q)
    mask = a.get("attn_mask")
    if axes and a.get("dropout_p", 0.0) and mesh.size(axes[0]) > 1:
        names = mesh.mesh_dim_names or ()
        axis = repr(names[axes[0]]) if axes[0] < len(names) else f"mesh dim {axes[0]}"
        raise SpmdError(f"F.scaled_dot_product_attention(dropout_p={a['dropout_p']}) on a sequence split over "
                        f"{axis}: attention dropout is not supported there (its random mask over the whole "
                        f"sequence cannot be drawn as one device draws it); set the attention dropout to 0 "
                        f"(transformers: config.attention_dropout = 0.0) or do not split the sequence")
    if len(axes) != 1 or a.get("dropout_p", 0.0) or any(p.is_partial() for t in (q, k, v) for p in t.placements):
        return None
    if isinstance(mask, torch.Tensor) and (mask.requires_grad or mask.ndim > q.ndim or a.get("is_causal")):
        return None  # (a mask with is_causal: torch's own error, as on one device)
    (axis,) = axes
    if mesh.size(axis) == 1:  # nothing is split: DTensor computes it locally as it is
        return None
    seq = q.ndim - 2
    start, length = _rows(q.shape[seq], mesh.size(axis), mesh.get_local_rank(axis))
    q_local = _local(q)
    if q_local.shape[seq] != length:
        return None
    if tuple(k.placements) == tuple(v.placements) == tuple(q.placements) and k.shape[:seq - 1] == q.shape[:seq - 1] \
            and (mask is None or a.get("is_causal") or (mask.ndim >= 1 and mask.shape[-1] == k.shape[seq])) \
            and (q.shape[seq - 1] == k.shape[seq - 1] or (a.get("enable_gqa") and q.shape[seq - 1] % k.shape[seq - 1] == 0)):
        # keys and values split alike: passed around the axis's ring, never gathered whole
        causal = bool(a.get("is_causal"))
        rows_mask = _mask_rows(mask, q, axes, start, length) if mask is not None and not causal else None
        out = ring_attention(q_local, _local(k), _local(v), group=mesh.get_group(axis), seq_len=k.shape[seq],
                             mask=rows_mask, causal=causal, scale=a.get("scale"))
        shape = (*q.shape[:-1], v.shape[-1])
        return DTensor.from_local(out.contiguous(), mesh, q.placements, run_check=False, shape=torch.Size(shape),
                                  stride=contiguous_stride(shape))
    whole = [Replicate() if i == axis else p for i, p in enumerate(q.placements)]
    if any(isinstance(p, Shard) and (p.dim >= k.ndim or k.shape[p.dim] != q.shape[p.dim]) and p.dim != seq
           for p in whole if isinstance(p, Shard)):
        return None
    # the gradient each process computes for the gathered keys and values is its share:
    # summed over the axis into each process's split (DTensor reduce-scatters a pending sum)
    shares = [Partial() if i == axis else p for i, p in enumerate(whole)]
    k_local = _local(k.redistribute(mesh, whole), shares)
    v_local = _local(v.redistribute(mesh, whole), shares)
    if a.get("is_causal"):
        local_mask = torch.ones(length, k.shape[seq], dtype=torch.bool, device=q_local.device).tril(start)
    elif mask is not None:
        local_mask = _mask_rows(mask, q, axes, start, length)
    else:
        local_mask = None
    extra = {"enable_gqa": True} if a.get("enable_gqa") else {}
    if length:
        out = F.scaled_dot_product_attention(q_local, k_local, v_local, attn_mask=local_mask, scale=a.get("scale"),
                                             **extra)
    else:  # no rows here (a sequence shorter than the axis): the gathers' gradients still meet
        out = q_local.new_zeros((*q_local.shape[:-1], v.shape[-1])) + 0 * (k_local.sum() + v_local.sum())
    shape = (*q.shape[:-1], v.shape[-1])
    return DTensor.from_local(out.contiguous(), mesh, q.placements, run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))


def inner_split(x: Any) -> bool:
    """Whether ``x`` is a DTensor split on a dim between its first and its last."""
    return isinstance(x, DTensor) and any(isinstance(p, Shard) and 0 < p.dim < x.ndim - 1 for p in x.placements)


def linear(args: tuple, kwargs: dict) -> DTensor | None:
    """``F.linear(input, weight, bias)`` on each process's positions, where ``input`` is split
    on a dim between the first and the last and the weight and bias are replicated. None
    where it does not apply."""
    bound = dict(zip(("input", "weight", "bias"), args))
    for name, value in kwargs.items():
        if name not in ("input", "weight", "bias") or name in bound:
            return None
        bound[name] = value
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    if not inner_split(x) or any(not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim < x.ndim - 1))
                        for p in x.placements):
        return None
    mesh = x.device_mesh
    for t in (w, b):
        if t is not None and not (isinstance(t, DTensor) and t.device_mesh == mesh
                                  and all(isinstance(p, Replicate) for p in t.placements)):
            return None
    shares = [Partial() if isinstance(p, Shard) else Replicate() for p in x.placements]
    out = F.linear(_local(x), _local(w, shares), None if b is None else _local(b, shares))
    shape = (*x.shape[:-1], w.shape[0])
    return DTensor.from_local(out.contiguous(), mesh, x.placements, run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))


_MHA = inspect.signature(F.multi_head_attention_forward)


def _linear(x: DTensor, w: Any, b: Any) -> DTensor:
    out = linear((x, w, b), {})
    return out if out is not None else F.linear(x, w, b)


def multi_head_attention(args: tuple, kwargs: dict) -> tuple[DTensor, None] | None:
    """``F.multi_head_attention_forward(*args, **kwargs)`` (arguments lifted to DTensors) for
    self-attention on a sequence split over one mesh axis: this process's positions through
    the projections and their rows of the attention. None where it does not apply."""
    try:
        a = _MHA.bind(*args, **kwargs)
    except TypeError:
        return None
    a.apply_defaults()
    a = a.arguments
    x = a["query"]
    if not (isinstance(x, DTensor) and x.ndim == 3 and a["key"] is x and a["value"] is x):
        return None
    if sum(isinstance(p, Shard) and p.dim == 0 for p in x.placements) != 1 or any(
            isinstance(p, Shard) and p.dim == 2 for p in x.placements):
        return None
    if (a["use_separate_proj_weight"] or a["bias_k"] is not None or a["bias_v"] is not None or a["add_zero_attn"]
            or a["key_padding_mask"] is not None or a["need_weights"] or a["static_k"] is not None
            or a["static_v"] is not None or (a["dropout_p"] and a["training"])):
        return None
    mask, causal = a["attn_mask"], bool(a["is_causal"])
    if causal:
        mask = None  # (as torch does without a key padding mask or weights: the hint alone)
    elif mask is not None:
        if mask.ndim != 2:
            return None
        if mask.dtype == torch.bool:  # True: not attended (nn.MultiheadAttention's meaning)
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=mask.device).masked_fill(mask, float("-inf"))
    seq, batch, embed = x.shape
    heads = a["num_heads"]
    hidden = x.transpose(0, 1)  # (batch, seq, embed)
    q, k, v = _linear(hidden, a["in_proj_weight"], a["in_proj_bias"]).chunk(3, dim=-1)
    q, k, v = (t.view(batch, seq, heads, embed // heads).transpose(1, 2) for t in (q, k, v))
    out = attend((q, k, v), {"attn_mask": mask, "is_causal": causal})
    if out is None:
        return None
    out = _linear(out.transpose(1, 2).reshape(batch, seq, embed), a["out_proj_weight"], a["out_proj_bias"])
    return out.transpose(0, 1), None
