"""The 'context' axis: a batch annotated ``('data', 'context')`` (Pattern 1) or ``('fsdp',
'context')`` (FSDPv2) splits each sequence over 'context'; the program is one device's.

Every run trains STEPS steps on the same random global batches as the one-device oracle
(tests/_context_models.py, plain PyTorch and transformers in a clean process) and must
reproduce its losses, its gradients at every step and its final parameters (fp32: rtol 1e-5,
atol 1e-6; attention sums its rows' keys in another order). Sequences of 11 tokens do not
divide over 2 or 4 processes; 3 tokens over 4 leave one process none. The models: the seed
document's decoder (nn.MultiheadAttention, causal, or not causal and returning its weights), decoders calling
F.scaled_dot_product_attention with causal, padding (4D, and over the keys alone), per-document
and additive masks (keys and
values passed around the axis's ring) or against learned memory tokens (keys and values not
split: taken whole), and a
transformers Llama (RoPE, grouped-query attention) with its loss inside. The sequence stays
split through the model: attention's output and the final norm's are split over 'context' on every
process.
"""

import functools

import _context_models as M
import _pattern1_models as P
import numpy as np
import pytest
import torch
from _clean import run_clean
from torch.distributed.tensor import DTensor, Shard

import torchspmd as ts

RTOL, ATOL = 1e-5, 1e-6
BASE = dict(vocab=29, dim=16, heads=4, inter=24, layers=2, rows=4, seq=11)
MODELS = {
    "mha_causal": dict(BASE, model="mha", causal=True),
    "mha": dict(BASE, model="mha", weights=True),
    "sdpa_causal": dict(BASE, model="sdpa", mask="causal"),
    "sdpa_padding": dict(BASE, model="sdpa", mask="padding"),
    "sdpa_keys": dict(BASE, model="sdpa", mask="keys"),
    "sdpa_documents": dict(BASE, model="sdpa", mask="documents"),
    "sdpa_float": dict(BASE, model="sdpa", mask="float"),
    "sdpa_memory": dict(BASE, model="sdpa", mask="memory"),
    "llama": dict(BASE, model="llama"),
    # sequences 2 x the processes divide: causal attention in torch's head-tail layout
    "sdpa_causal_16": dict(BASE, model="sdpa", mask="causal", seq=16),
    "llama_16": dict(BASE, model="llama", seq=16),
}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _spmd(cfg, shape, wrap):
    n = ts.global_runtime_device_count()
    first = "fsdp" if wrap else "data"
    mesh = ts.Mesh(np.arange(n), shape, (first, "context"))
    ts.set_global_mesh(mesh)
    model = M.build(cfg)
    if wrap:
        model = ts.FSDPv2(model, auto_wrap_policy=functools.partial(ts.transformer_auto_wrap_policy,
                                                                    transformer_layer_cls={M.layer_class(cfg)}))
    else:
        model = model.to(ts.device())
    opt = torch.optim.Adam(model.parameters(), lr=M.LR, eps=P.ADAM_EPS)
    final_norm = [m for name, m in model.named_modules() if name.endswith("norm") and "layers" not in name][-1]
    kept = []

    def split(t):
        return isinstance(t, DTensor) and t.placements[1] == Shard(1)

    attention = []
    final_norm.register_forward_hook(lambda m, i, o: kept.append(split(o)))
    # and attention's output: each process's rows of it, not the whole
    attn = next(m for name, m in model.named_modules() if name.endswith("self_attn") or name.endswith(".out"))
    if isinstance(attn, torch.nn.Linear):  # the sdpa decoders' output projection: attention's output enters it
        attn.register_forward_pre_hook(lambda m, i: attention.append(split(i[0])))
    else:
        attn.register_forward_hook(lambda m, i, o: attention.append(split(o[0])))
    losses, grads = [], []
    for data, target in M.batches(cfg):
        x = ts.mark_sharding(data.to(ts.device()), mesh, (first, "context"))
        y = ts.mark_sharding(target.to(ts.device()), mesh, (first, "context"))
        with ts.step():
            opt.zero_grad()
            loss = M.loss(cfg, model, x, y)
            loss.backward()
            grads.append({k: _full(p.grad).detach().clone() for k, p in model.named_parameters()})
            opt.step()
        losses.append(loss.item())
    # what this process holds of each parameter (FSDPv2: split over 'fsdp' x 'context' together)
    held = {k: p.to_local().numel() if isinstance(p, DTensor) else p.numel() for k, p in model.named_parameters()}
    return dict(losses=losses, grads=grads, kept=kept, attention=attention, held=held,
                params={k: _full(p).detach().clone() for k, p in model.named_parameters()})


def _check(results, cfg, split=True):
    want = run_clean(M.oracle, cfg)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=ATOL)
        for step, (got, ref) in enumerate(zip(r["grads"], want["grads"])):
            assert got.keys() == ref.keys()
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=k, s=step: f"step {s} gradient of {k}: {m}")
        for k in want["params"]:
            torch.testing.assert_close(r["params"][k], want["params"][k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"parameter {k}: {m}")
        if split:  # the sequence stayed split over 'context' (mesh dim 1) up to the final norm
            assert r["kept"] and all(r["kept"]), r["kept"]
            # attention gave each process its rows, except nn.MultiheadAttention returning its weights
            # (need_weights=True, its default: a (seq, seq) map per row), computed whole
            assert r["attention"] and all(r["attention"]) == (not cfg.get("weights")), r["attention"]


@pytest.mark.parametrize("name", list(MODELS))
def test_pattern1_with_the_sequence_over_context_is_one_devices(dist, name):
    _check(dist(2).run(_spmd, MODELS[name], (1, 2), False), MODELS[name])


@pytest.mark.parametrize("name", ["mha_causal", "sdpa_documents", "llama", "sdpa_causal_16", "llama_16"])
def test_pattern1_over_four_context_processes(dist, name):
    _check(dist(4).run(_spmd, MODELS[name], (1, 4), False), MODELS[name])


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["mha_causal", "sdpa_padding", "llama"])
@pytest.mark.parametrize("shape", [(2, 2), (1, 4)])
def test_fsdpv2_with_the_sequence_over_context_is_one_devices(dist, name, shape):
    results = dist(4).run(_spmd, MODELS[name], shape, True)
    _check(results, MODELS[name])
    # every parameter is split over all 4 processes ('fsdp' x 'context' flattened: dim 0 in 4
    # chunks), not replicated over 'context'
    params = results[0]["params"]
    for k, whole in params.items():
        rows = whole.shape[0]
        per_row = whole.numel() // rows
        chunk = -(-rows // 4)
        want = [max(0, min(chunk, rows - r * chunk)) * per_row for r in range(4)]
        assert [r["held"][k] for r in results] == want, (k, whole.shape, [r["held"][k] for r in results])


def _explained(cfg):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (1, n), ("fsdp", "context"))
    ts.set_global_mesh(mesh)
    model = ts.FSDPv2(M.build(cfg), auto_wrap_policy=functools.partial(
        ts.transformer_auto_wrap_policy, transformer_layer_cls={M.layer_class(cfg)}))
    data, target = M.batches(cfg)[0]
    x = ts.mark_sharding(data.to(ts.device()), mesh, ("fsdp", "context"))
    y = ts.mark_sharding(target.to(ts.device()), mesh, ("fsdp", "context"))
    report = ts.explain(model, lambda: M.loss(cfg, model, x, y).backward())
    return [(c.family, c.phase, c.axis, c.count, c.bytes) for c in report.collectives], str(report)


def test_explain_shows_the_rings_sends(dist):
    """Ring attention's sends and receives over 'context' are listed by explain, forward and
    backward (a layer's keys and values: 2 per step of the ring, c - 1 steps)."""
    cfg = MODELS["sdpa_causal"]
    out = dist(2).run(_explained, cfg)
    rows, text = out[0]
    for family in ("send", "recv"):
        for phase in ("forward", "backward"):
            found = [r for r in rows if r[0] == family and r[1] == phase]
            assert found and all(r[2] == "context" and r[4] for r in found), (family, phase, rows)
    assert "send" in text


def _ring_direct(seq, kv_heads, causal, tile_bytes=None):
    """ring_attention on this process's block of the ring tests' q, k, v (and mask rows): its
    output, the gradients of its blocks, and the layouts its ring used."""
    import torch.distributed as dist_

    from torchspmd.engines.native.global_view import ring_attention as R

    ts.use_spmd()
    n, me = dist_.get_world_size(), dist_.get_rank()
    used = []

    class Ring(R._Ring):
        def __init__(self, group, layout):
            super().__init__(group, layout)
            used.append(layout)

    R._Ring, original, tiles = Ring, R._Ring, R.TILE_BYTES
    R.TILE_BYTES = tile_bytes or tiles
    try:
        x = M.ring_inputs(seq, kv_heads, causal)
        (start, length), = R._in_order(seq, n)[me]
        r = slice(start, start + length)
        mine = [x[name][..., r, :].clone().requires_grad_() for name in "qkv"]
        rows_mask = None if x["mask"] is None else x["mask"][..., r, :]
        got = R.ring_attention(*mine, group=dist_.group.WORLD, seq_len=seq, causal=causal, mask=rows_mask)
        got.backward(x["grad"][..., r, :])
        return dict(out=got.detach(), grads=[m.grad for m in mine], rows=(start, length), layouts=used)
    finally:
        R._Ring, R.TILE_BYTES = original, tiles


@pytest.mark.parametrize("n,seq,kv_heads,causal,tile", [(2, 16, 4, True, None), (4, 16, 2, True, None),
                                                       (4, 13, 4, True, None), (4, 16, 2, True, 2 * 4 * 4 * 3),
                                                       (2, 13, 4, False, 2 * 4 * 4 * 3)],
                         ids=["c2", "c4_gqa", "c4_uneven", "c4_tiled", "c2_mask_tiled"])
def test_causal_ring_attention_runs_in_the_head_tail_layout(dist, n, seq, kv_heads, causal, tile):
    """A causal ring over a sequence 2n divides runs in torch's head-tail layout (process i:
    chunks i and 2n - 1 - i of 2n), its output and gradients back in order and equal to
    SDPA's on the whole sequence; an uneven sequence, or another mask, keeps the blocks in
    order. ``tile``: the scores computed one query row at a time (TILE_BYTES that small)."""
    from torchspmd.engines.native.global_view import ring_attention as R

    want = run_clean(M.sdpa_whole, seq, kv_heads, causal)  # torch's SDPA on the whole, in a clean process
    for r in dist(n).run(_ring_direct, seq, kv_heads, causal, tile):
        start, length = r["rows"]
        rows = slice(start, start + length)
        torch.testing.assert_close(r["out"], want["out"][..., rows, :], rtol=RTOL, atol=ATOL)
        for got, whole in zip(r["grads"], want["grads"]):
            torch.testing.assert_close(got, whole[..., rows, :], rtol=RTOL, atol=ATOL)
        balanced = R._head_tail(seq, n) if causal else None
        assert r["layouts"] == [balanced if balanced else R._in_order(seq, n)], r["layouts"]
        if balanced:
            h = seq // (2 * n)
            assert balanced[0] == [(0, h), ((2 * n - 1) * h, h)]


def _dropout(cfg):
    try:
        _spmd(cfg, (1, 2), False)
    except ts.SpmdError as e:
        return str(e)
    return None


def test_attention_dropout_on_a_split_sequence_is_refused_on_every_process(dist):
    """Attention dropout draws one random mask over the whole (rows, heads, seq, seq) on one
    device; with the sequence split over 'context' it cannot be drawn alike: refused, naming
    the argument and the axis, the same on every process."""
    out = dist(2).run(_dropout, dict(MODELS["sdpa_causal"], dropout=0.2))
    assert out[0] is not None and all(o == out[0] for o in out), out
    assert "dropout_p=0.2" in out[0] and "'context'" in out[0] and "attention_dropout = 0.0" in out[0]


def test_a_sequence_shorter_than_the_axis(dist):
    cfg = dict(MODELS["sdpa_causal"], seq=3)
    _check(dist(4).run(_spmd, cfg, (1, 4), False), cfg, split=False)


def _refused(options):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (1, 2, 2), ("fsdp", "context", "model"))
    if options == "shard_output":
        mesh = ts.Mesh(np.arange(n), (2, 2), ("fsdp", "context"))
    ts.set_global_mesh(mesh)
    model = M.build(MODELS["sdpa_causal"])
    extra = {"shard_output": lambda output, mesh: None} if options == "shard_output" else {}
    model = ts.FSDPv2(model, **extra)
    data, _ = M.batches(MODELS["sdpa_causal"])[0]
    x = ts.mark_sharding(data.to(ts.device()), mesh, ("fsdp", "context"))
    try:
        model(x)
    except ts.SpmdError as e:
        return str(e)
    return None


@pytest.mark.parametrize("options", ["model_axis", "shard_output"])
def test_what_does_not_combine_with_context_is_refused_on_every_process(dist, options):
    out = dist(4).run(_refused, options)
    assert out[0] is not None and all(o == out[0] for o in out), out
    assert "'context'" in out[0] and ("'model'" in out[0] if options == "model_axis" else "shard_output" in out[0])
