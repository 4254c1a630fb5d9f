"""Ring attention: each process's queries against keys and values passed around the
processes of one mesh axis, one block at a time, never gathered whole.

The sequence is split over the axis in ``torch.chunk``'s blocks (DTensor's ``Shard``: the
last blocks may be shorter or empty). Each of the n steps computes this process's query rows
against the block it holds, in float32, merged into the rows' running maximum, sum and output
(the online softmax: a block whose scores are all masked adds nothing and makes no NaN), then
passes the block to the next process of the axis and takes the previous one's. The backward
pass runs the ring again with each block's key and value gradients travelling with it, and
one more pass brings them home. Grouped-query attention passes keys and values at their own
(smaller) width. The mask is given as this process's rows over all keys (or as ``causal``:
built per block from the global positions; a block whose keys all follow this process's last
row is not computed, forward or backward: it would add exactly nothing, so the process of the
first positions computes one block, the last one n).

Every process computes each of its rows from every key once, so the result is one device's up
to the order of the sums (fp32: within rtol 1e-5 at the tests' sizes).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["ring_attention"]


def _blocks(size: int, parts: int) -> list[tuple[int, int]]:
    chunk = -(-size // parts)
    out = []
    for i in range(parts):
        start = min(i * chunk, size)
        out.append((start, min(chunk, size - start)))
    return out


class _Ring:
    """The axis's processes in order, and passing a list of tensors one step around them."""

    def __init__(self, group, blocks: list[tuple[int, int]]):
        self.group = group
        self.n = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.blocks = blocks
        self.chunk = max(length for _, length in blocks)
        self.next = dist.get_global_rank(group, (self.me + 1) % self.n)
        self.prev = dist.get_global_rank(group, (self.me - 1) % self.n)

    def padded(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a block on dim -2) padded to the longest block's length."""
        pad = self.chunk - t.shape[-2]
        if pad == 0:
            return t.contiguous()
        return torch.cat([t, t.new_zeros((*t.shape[:-2], pad, t.shape[-1]))], dim=-2)

    def shift(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send each padded tensor to the next process, receive the previous one's."""
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, r in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received


def _after_every_row(cols, rows_start: int, rows: int, causal: bool) -> bool:
    """Whether a causal block's keys all come after this process's last query row: every
    score masked, the block adds exactly nothing (forward and backward) and is not computed."""
    return causal and cols[0] >= rows_start + rows


def _scores(q, k, scale, rows_start, cols, mask, causal):
    """Float32 scores of ``q`` against the block ``k`` holding key positions ``cols``
    (start, length), with the mask applied (-inf where not attended)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    start, length = cols
    if causal:
        q_pos = torch.arange(rows_start, rows_start + q.shape[-2], device=q.device)
        k_pos = torch.arange(start, start + length, device=q.device)
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    elif mask is not None:
        m = mask[..., start:start + length]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    return s


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=-3)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of ``_expand``: the query heads' sums per key-value head."""
    if rep == 1:
        return t
    return t.unflatten(-3, (t.shape[-3] // rep, rep)).sum(-3)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, rows_start, scale, ring):
        rep = q.shape[-3] // k.shape[-3]
        qf = q.float()
        rows = q.shape[:-1]
        m = torch.full(rows, float("-inf"), device=q.device)
        total = torch.zeros(rows, device=q.device)
        acc = torch.zeros((*rows, v.shape[-1]), device=q.device)
        kb, vb = ring.padded(k), ring.padded(v)
        for step in range(ring.n):
            src = (ring.me - step) % ring.n
            cols = ring.blocks[src]
            if cols[1] and q.shape[-2] and not _after_every_row(cols, rows_start, q.shape[-2], causal):
                kk = _expand(kb[..., :cols[1], :], rep).float()
                vv = _expand(vb[..., :cols[1], :], rep).float()
                s = _scores(qf, kk, scale, rows_start, cols, mask, causal)
                new_m = torch.maximum(m, s.amax(-1))
                shift = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
                keep = torch.exp(m - shift)
                p = torch.exp(s - shift[..., None])
                total = total * keep + p.sum(-1)
                acc = acc * keep[..., None] + torch.matmul(p, vv)
                m = new_m
            if step < ring.n - 1:
                kb, vb = ring.shift([kb, vb])
        out = acc / total[..., None]
        lse = torch.where(torch.isinf(m), m, m + torch.log(total))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.causal, ctx.rows_start, ctx.scale, ctx.ring, ctx.rep = mask, causal, rows_start, scale, ring, rep
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, rep, scale = ctx.ring, ctx.rep, ctx.scale
        qf, go = q.float(), grad_out.float()
        delta = (go * out).sum(-1)
        dq = torch.zeros_like(qf)
        kb, vb = ring.padded(k), ring.padded(v)
        dkb = torch.zeros(kb.shape, device=kb.device)
        dvb = torch.zeros(vb.shape, device=vb.device)
        for step in range(ring.n):
            src = (ring.me - step) % ring.n
            cols = ring.blocks[src]
            n = cols[1]
            if n and q.shape[-2] and not _after_every_row(cols, ctx.rows_start, q.shape[-2], ctx.causal):
                kk = _expand(kb[..., :n, :], rep).float()
                vv = _expand(vb[..., :n, :], rep).float()
                s = _scores(qf, kk, scale, ctx.rows_start, cols, ctx.mask, ctx.causal)
                p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
                p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(p), p)
                dvb[..., :n, :] += _fold(torch.matmul(p.transpose(-1, -2), go), rep)
                ds = p * (torch.matmul(go, vv.transpose(-1, -2)) - delta[..., None])
                dq += torch.matmul(ds, kk) * scale
                dkb[..., :n, :] += _fold(torch.matmul(ds.transpose(-1, -2), qf), rep) * scale
            if step < ring.n - 1:
                kb, vb, dkb, dvb = ring.shift([kb, vb, dkb, dvb])
            elif ring.n > 1:  # the last pass takes each block's gradients home
                dkb, dvb = ring.shift([dkb, dvb])
        mine = ring.blocks[ring.me][1]
        return (dq.to(q.dtype), dkb[..., :mine, :].to(k.dtype), dvb[..., :mine, :].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, seq_len: int,
                   rows_start: int, mask: torch.Tensor | None = None, causal: bool = False,
                   scale: float | None = None) -> torch.Tensor:
    """This process's rows of attention (``q``: its query rows; ``k``, ``v``: its own block
    of keys and values, at their grouped-query width) over a sequence of ``seq_len`` split in
    ``torch.chunk`` blocks over ``group``. ``mask``: this process's rows over all keys
    (boolean: True attended; or additive), broadcastable to ``(..., rows, seq_len)``;
    ``causal``: each row attends the keys at its global position and before."""
    ring = _Ring(group, _blocks(seq_len, dist.get_world_size(group)))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, mask, causal, rows_start, scale, ring)
