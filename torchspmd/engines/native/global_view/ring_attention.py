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
built from the global positions).

A block is a list of segments of global positions. Under a causal mask a pair of a query
segment and a key segment whose keys all follow the queries is not computed, forward or
backward: it would add exactly nothing. With the blocks in order, the process of the first
positions would then compute one block and the last one n; so a causal attention without
another mask, over a sequence 2n divides, runs in torch's head-tail layout (its
``_HeadTailLoadBalancer``'s): the sequence cut in 2n chunks, process i holding chunks i and
2n - 1 - i, every process computing 2n + 1 of the (n x 2)^2 chunk pairs. The queries, keys and
values are moved into that layout for the attention only (each process sends the halves of
its block to their owners: at most two messages) and the output back, so the model around it
keeps the sequence in order (positions, RoPE, the loss), and the gradients take the same
moves in reverse.

Every process computes each of its rows from every key once, so the result is one device's up
to the order of the sums (fp32: within rtol 1e-5 at the tests' sizes).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["ring_attention"]

#: a block's global positions: (start, length) segments, in the block's order
Segments = list[tuple[int, int]]


def _in_order(size: int, parts: int) -> list[Segments]:
    """``torch.chunk``'s blocks (DTensor's ``Shard``): one segment each."""
    chunk = -(-size // parts)
    out = []
    for i in range(parts):
        start = min(i * chunk, size)
        out.append([(start, min(chunk, size - start))])
    return out


def _head_tail(size: int, parts: int) -> list[Segments] | None:
    """torch's head-tail layout of ``size`` positions over ``parts`` processes: 2 x parts
    equal chunks, process i holding chunks i and 2 parts - 1 - i; None where 2 x parts does
    not divide ``size``."""
    if parts < 2 or size % (2 * parts):
        return None
    h = size // (2 * parts)
    return [[(i * h, h), ((2 * parts - 1 - i) * h, h)] for i in range(parts)]


class _Ring:
    """The axis's processes in order, each one's block (``layout``), and passing a list of
    tensors one step around them."""

    def __init__(self, group, layout: list[Segments]):
        self.group = group
        self.n = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.layout = layout
        self.chunk = max(sum(length for _, length in block) for block in layout)
        self.next = dist.get_global_rank(group, (self.me + 1) % self.n)
        self.prev = dist.get_global_rank(group, (self.me - 1) % self.n)

    def length(self, i: int) -> int:
        return sum(length for _, length in self.layout[i])

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


def _pairs(rows: Segments, cols: Segments, causal: bool) -> list[tuple[int, int, int, int, int, int]]:
    """(row offset, row start, row count, key offset, key start, key count) of each pair of a
    query segment and a key segment to compute (offsets: in the local tensors; starts: global
    positions), leaving out the pairs a causal mask masks whole."""
    out, ro = [], 0
    for rs, rn in rows:
        ko = 0
        for ks, kn in cols:
            if rn and kn and not (causal and ks > rs + rn - 1):
                out.append((ro, rs, rn, ko, ks, kn))
            ko += kn
        ro += rn
    return out


#: the float32 scores one step computes at once (bytes): the query rows of a pair are taken in
#: tiles that keep the scores, their exponentials and (backward) their gradients this small,
#: whatever the sequence (rows are independent: the result is the same)
TILE_BYTES = 64 * 2**20


def _tiles(pairs, heads_rows: int):
    """Each pair's query rows cut in tiles: (row offset, row start, row count, key offset, key
    start, key count) with at most TILE_BYTES of scores each (``heads_rows``: the elements
    of the query's dims before the rows, batch x heads)."""
    for ro, rs, rn, ko, ks, kn in pairs:
        step = max(1, TILE_BYTES // (4 * max(1, heads_rows) * kn))
        for t in range(0, rn, step):
            yield ro + t, rs + t, min(step, rn - t), ko, ks, kn


def _scores(q, k, scale, rows_start, cols_start, mask, causal):
    """Float32 scores of the query rows ``q`` (global positions from ``rows_start``) against
    the keys ``k`` (from ``cols_start``), with the mask applied (-inf where not attended).
    ``mask``: these rows over all keys (or broadcast over the rows)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        q_pos = torch.arange(rows_start, rows_start + q.shape[-2], device=q.device)
        k_pos = torch.arange(cols_start, cols_start + k.shape[-2], device=q.device)
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    elif mask is not None:
        m = mask[..., cols_start:cols_start + k.shape[-2]]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    return s


def _mask_rows(mask, offset: int, count: int, rows: int):
    """The mask of the local rows ``offset .. offset + count`` (a mask broadcast over the
    rows is kept as it is)."""
    if mask is None or mask.ndim < 2 or mask.shape[-2] == 1 or (offset == 0 and count == rows):
        return mask
    return mask[..., offset:offset + count, :]


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=-3)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of ``_expand``: the query heads' sums per key-value head."""
    if rep == 1:
        return t
    return t.unflatten(-3, (t.shape[-3] // rep, rep)).sum(-3)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, ring):
        rep = q.shape[-3] // k.shape[-3]
        qf = q.float()
        rows = q.shape[:-1]
        m = torch.full(rows, float("-inf"), device=q.device)
        total = torch.zeros(rows, device=q.device)
        acc = torch.zeros((*rows, v.shape[-1]), device=q.device)
        kb, vb = ring.padded(k), ring.padded(v)
        mine = ring.layout[ring.me]
        for step in range(ring.n):
            src = (ring.me - step) % ring.n
            for ro, rs, rn, ko, ks, kn in _tiles(_pairs(mine, ring.layout[src], causal), math.prod(rows[:-1])):
                kk = _expand(kb[..., ko:ko + kn, :], rep).float()
                vv = _expand(vb[..., ko:ko + kn, :], rep).float()
                s = _scores(qf[..., ro:ro + rn, :], kk, scale, rs, ks, _mask_rows(mask, ro, rn, rows[-1]), causal)
                r = slice(ro, ro + rn)
                old = m[..., r]
                new_m = torch.maximum(old, s.amax(-1))
                shift = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
                keep = torch.exp(old - shift)
                p = torch.exp(s - shift[..., None])
                total[..., r] = total[..., r] * keep + p.sum(-1)
                acc[..., r, :] = acc[..., r, :] * keep[..., None] + torch.matmul(p, vv)
                m[..., r] = new_m
            if step < ring.n - 1:
                kb, vb = ring.shift([kb, vb])
        out = acc / total[..., None]
        lse = torch.where(torch.isinf(m), m, m + torch.log(total))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.causal, ctx.scale, ctx.ring, ctx.rep = mask, causal, scale, ring, rep
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
        mine = ring.layout[ring.me]
        rows = q.shape[-2]
        for step in range(ring.n):
            src = (ring.me - step) % ring.n
            for ro, rs, rn, ko, ks, kn in _tiles(_pairs(mine, ring.layout[src], ctx.causal),
                                                 math.prod(q.shape[:-2])):
                kk = _expand(kb[..., ko:ko + kn, :], rep).float()
                vv = _expand(vb[..., ko:ko + kn, :], rep).float()
                r = slice(ro, ro + rn)
                qr = qf[..., r, :]
                s = _scores(qr, kk, scale, rs, ks, _mask_rows(ctx.mask, ro, rn, rows), ctx.causal)
                lr = lse[..., r]
                p = torch.exp(s - torch.where(torch.isinf(lr), torch.zeros_like(lr), lr)[..., None])
                p = torch.where(torch.isinf(lr)[..., None], torch.zeros_like(p), p)
                gr = go[..., r, :]
                dvb[..., ko:ko + kn, :] += _fold(torch.matmul(p.transpose(-1, -2), gr), rep)
                ds = p * (torch.matmul(gr, vv.transpose(-1, -2)) - delta[..., r, None])
                dq[..., r, :] += torch.matmul(ds, kk) * scale
                dkb[..., ko:ko + kn, :] += _fold(torch.matmul(ds.transpose(-1, -2), qr), rep) * scale
            if step < ring.n - 1:
                kb, vb, dkb, dvb = ring.shift([kb, vb, dkb, dvb])
            elif ring.n > 1:  # the last pass takes each block's gradients home
                dkb, dvb = ring.shift([dkb, dvb])
        n = ring.length(ring.me)
        return (dq.to(q.dtype), dkb[..., :n, :].to(k.dtype), dvb[..., :n, :].to(v.dtype),
                None, None, None, None)


# -- moving blocks between layouts ------------------------------------------------------------


def _locate(layout: list[Segments], position: int) -> tuple[int, int]:
    """(process, offset in its block) holding ``position`` in ``layout``."""
    for proc, block in enumerate(layout):
        off = 0
        for start, length in block:
            if start <= position < start + length:
                return proc, off + position - start
            off += length
    raise ValueError(f"position {position} is in no block of {layout}")


def _moves(source: list[Segments], target: list[Segments]) -> list[tuple[int, int, int, int, int, int]]:
    """(piece start, from process, offset there, to process, offset there, length) of every
    piece of the sequence between two layouts of it (the pieces: between the boundaries of
    either layout's segments)."""
    cuts = sorted({p for block in source + target for start, length in block if length
                   for p in (start, start + length)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        frm, f_off = _locate(source, a)
        to, t_off = _locate(target, a)
        out.append((a, frm, f_off, to, t_off, b - a))
    return out


def _move(tensors: list[torch.Tensor], moves, group, me: int, lengths: tuple[int, int]) -> list[torch.Tensor]:
    """Each tensor (its block on dim -2, ``lengths[0]`` long here) moved by ``moves`` into a
    block ``lengths[1]`` long: pieces staying here are copied, the others sent and received
    (one tag per tensor and piece)."""
    outs = [t.new_empty((*t.shape[:-2], lengths[1], t.shape[-1])) for t in tensors]
    ops, waits = [], []
    for i, (t, o) in enumerate(zip(tensors, outs)):
        for tag, (piece, frm, f_off, to, t_off, n) in enumerate(moves):
            tag += i * len(moves)
            if frm == me and to == me:
                o[..., t_off:t_off + n, :] = t[..., f_off:f_off + n, :]
            elif frm == me:
                ops.append(dist.P2POp(dist.isend, t[..., f_off:f_off + n, :].contiguous(),
                                      dist.get_global_rank(group, to), group, tag))
            elif to == me:
                buf = t.new_empty((*t.shape[:-2], n, t.shape[-1]))
                ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, frm), group, tag))
                waits.append((o, t_off, n, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for o, t_off, n, buf in waits:
        o[..., t_off:t_off + n, :] = buf
    return outs


class _Relayout(torch.autograd.Function):
    """Tensors moved from one layout of the sequence to another; their gradients move back."""

    @staticmethod
    def forward(ctx, plan, *tensors):
        ctx.plan = plan
        there, back, group, me, lengths = plan
        outs = _move(list(tensors), there, group, me, lengths)
        ctx.like = [(o.shape, o.dtype, o.device) for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        there, back, group, me, lengths = ctx.plan
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
                 for g, (shape, dtype, device) in zip(grads, ctx.like)]
        return (None, *_move(grads, back, group, me, lengths[::-1]))


def _relayout(tensors: list[torch.Tensor], source: list[Segments], target: list[Segments], group) -> tuple:
    me = dist.get_rank(group)
    lengths = (sum(n for _, n in source[me]), sum(n for _, n in target[me]))
    plan = (_moves(source, target), _moves(target, source), group, me, lengths)
    return _Relayout.apply(plan, *tensors)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, seq_len: int,
                   mask: torch.Tensor | None = None, causal: bool = False,
                   scale: float | None = None) -> torch.Tensor:
    """This process's rows of attention (``q``: its query rows; ``k``, ``v``: its own block
    of keys and values, at their grouped-query width) over a sequence of ``seq_len`` split in
    ``torch.chunk`` blocks over ``group``. ``mask``: this process's rows over all keys
    (boolean: True attended; or additive), broadcastable to ``(..., rows, seq_len)``;
    ``causal``: each row attends the keys at its global position and before (computed in the
    head-tail layout where 2 x the processes divide ``seq_len``)."""
    n = dist.get_world_size(group)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    in_order = _in_order(seq_len, n)
    balanced = _head_tail(seq_len, n) if causal and mask is None else None
    if balanced is None:
        return _RingAttention.apply(q, k, v, mask, causal, scale, _Ring(group, in_order))
    q, k, v = _relayout([q, k, v], in_order, balanced, group)
    out = _RingAttention.apply(q, k, v, None, True, scale, _Ring(group, balanced))
    return _relayout([out], balanced, in_order, group)[0]
