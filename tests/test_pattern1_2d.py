"""Pattern 1 (no wrapper: parameters annotated over 'model' with mark_sharding, the batch over
'data') on a ('data', 'model') = (2, 2) mesh, against one device.

The seed document's decoder (nn.MultiheadAttention, RMSNorm, an embedding, an MLP whose two
weights are annotated the torch_xla way) failed in ``loss.backward()`` inside DTensor
(``_StridedShard redistribute assumes no flattened transforms``): redistributions DTensor
refuses are now done as a gather and a split (torchspmd/engines/native/global_view/redistribution.py), and
``ts.explain`` lists where. Every run here trains STEPS steps on the same random global batches as
the one-device oracle (_pattern1_models.oracle, plain PyTorch in a clean process) and must
reproduce its losses, its gradients at every step and its final parameters (fp32: rtol 1e-5,
atol 1e-6). Models mix annotated and unannotated layers; annotations sit on either dim of either
linear, the embedding, the LM head (tied or not) and attention's packed projection; the vocabulary
(13) and some widths do not divide by 2.
"""

import math

import _pattern1_models as P
import numpy as np
import pytest
import torch
import torch.distributed as dist_c10d
from _clean import run_clean
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor.placement_types import _StridedShard

import torchspmd as ts
from torchspmd.engines.native.global_view import redistribution

RTOL, ATOL = 1e-5, 1e-6
SHAPE = (2, 2)

SEED_CFG = dict(vocab=13, dim=8, heads=2, inter=10, layers=2, norm="rms", rows=4, seq=6, opt="adam")


def _mlp(layers, first, second):
    """Annotations of the MLP's two linears in ``layers``: ``first`` for ``mlp.0.weight``,
    ``second`` for ``mlp.2.weight`` (None: left unannotated)."""
    out = {}
    for i in layers:
        if first is not None:
            out[f"layers.{i}.mlp.0.weight"] = first
        if second is not None:
            out[f"layers.{i}.mlp.2.weight"] = second
    return out


COL, ROW = ("model", None), (None, "model")
# Cases whose MLPs are column- then row-parallel pairs (with either annotation style), the stream outside them
# computed by modules with plain weights or under Megatron's layouts: they compute as tensor parallelism.
MEGATRON = ("seed", "xla_2d", "attention_xla_2d", "uneven_rows", "tied")
# name -> (model, annotations)
CASES = {
    # The seed's decoder, its MLP annotated as torch_xla programs annotate it (column- then row-parallel).
    "seed": (SEED_CFG, _mlp([0, 1], COL, ROW)),
    # Either dim of either linear: row-parallel first, column-parallel second; SGD; an odd MLP width (9).
    "swapped": (dict(SEED_CFG, inter=9, opt="sgd"), _mlp([0, 1], ROW, COL)),
    # Both linears split on their input features, with biases, under LayerNorm.
    "both_rows": (dict(SEED_CFG, norm="layer", bias=True), _mlp([0, 1], ROW, ROW)),
    # One linear of one layer annotated; the other layer's MLP and every other weight left whole.
    "mixed": (dict(SEED_CFG, norm="layer", bias=True), _mlp([0], COL, None)),
    # torch_xla's 2D recipe: the data axis on the other dim of each weight (dim 10, MLP 9: uneven over 'model').
    "xla_2d": (dict(SEED_CFG, dim=10, inter=9), _mlp([0, 1], ("model", "data"), ("data", "model"))),
    # The vocabulary split over 'model' (13: uneven) in the embedding and the LM head; attention's
    # packed q/k/v projection split by heads and its output projection by input features.
    "vocab_and_attention": (dict(SEED_CFG, layers=1), {
        "embed.weight": COL, "lm_head.weight": COL, "layers.0.self_attn.in_proj_weight": COL,
        "layers.0.self_attn.out_proj.weight": ROW, **_mlp([0], COL, ROW)}),
    # Attention and the embedding under torch_xla's 2D recipe (both axes on every weight); attention's
    # width (10) splits its packed projection unevenly into q, k and v over 'model'; 5 rows over 'data'.
    "attention_xla_2d": (dict(SEED_CFG, dim=10, layers=1, rows=5), {
        "embed.weight": ("data", "model"), "layers.0.self_attn.in_proj_weight": ("model", "data"),
        "layers.0.self_attn.out_proj.weight": ("data", "model"),
        **_mlp([0], ("model", "data"), ("data", "model"))}),
    # The LM head tied to the embedding, annotated (hidden features over 'model') under its embedding's name.
    "tied": (dict(SEED_CFG, norm="layer", tied=True), {"embed.weight": ROW, **_mlp([0, 1], COL, ROW)}),
    # The batch does not divide over 'data' (5 rows over 2).
    "uneven_rows": (dict(SEED_CFG, rows=5), _mlp([0, 1], COL, ROW)),
    # A dim split over both axes (a tuple), uneven (vocabulary 13, MLP width 9 over 4 devices): tiled flat as
    # XLA tiles it (13 rows: 4, 4, 4, 1; 9: 3, 3, 3, 0), computed with the batch's and the other weights' layouts.
    "flat_tiled": (dict(SEED_CFG, dim=10, inter=9), {
        "embed.weight": (("data", "model"), None),
        **_mlp([0, 1], (("data", "model"), None), (None, ("data", "model")))}),
}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _spmd(cfg, specs):
    """The Pattern 1 program: annotate in place (the result unused), optimizer, loader, steps."""
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), SHAPE, ("data", "model"))
    ts.set_global_mesh(mesh)
    model = P.build(cfg)
    params = dict(model.named_parameters())
    for name, spec in specs.items():
        ts.mark_sharding(params[name], mesh, spec)
    acts = []  # the MLP's intermediate activation of each layer: elements this process holds
    for layer in model.layers:
        layer.mlp[1].register_forward_hook(
            lambda m, i, o: acts.append((o.to_local().numel(), tuple(o.placements)) if isinstance(o, DTensor)
                                        else (o.numel(), None)))
    opt = P.optimizer(cfg, model)
    loader = ts.MpDeviceLoader(P.batches(cfg), ts.device(), input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    losses, grads = [], []
    with redistribution.watching() as fallbacks:
        for data, target in loader:
            with ts.step():
                opt.zero_grad()
                loss = P.loss_of(model(data), target)
                loss.backward()
                grads.append({k: _full(p.grad).detach().clone() for k, p in model.named_parameters()})
                opt.step()
            losses.append(loss.item())
    named = dict(model.named_parameters())
    return dict(losses=losses, grads=grads, params={k: _full(p).detach().clone() for k, p in named.items()},
                local={k: (p.to_local() if isinstance(p, DTensor) else p).numel() for k, p in named.items()},
                fallbacks=[str(f) for f in fallbacks], acts=acts[:len(model.layers)])


def _oracle(cfg):
    return run_clean(P.oracle, cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_pattern1_on_a_2d_mesh_is_one_devices(dist, case):
    cfg, specs = CASES[case]
    results = dist(4).run(_spmd, cfg, specs)
    want = _oracle(cfg)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=ATOL)
        for step, (got, ref) in enumerate(zip(r["grads"], want["grads"])):
            assert got.keys() == ref.keys()
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, k=k, s=step: f"step {s} gradient of {k}: {m}")
        assert r["params"].keys() == want["params"].keys()
        for k in want["params"]:
            torch.testing.assert_close(r["params"][k], want["params"][k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"parameter {k}: {m}")
    if case in MEGATRON:
        # Tensor parallelism: the MLP's intermediate activation of every layer is split over the rows on
        # 'data' and over the features on 'model', each element held once (1/4 per process), and no
        # redistribution was refused (none gathered whole and split again).
        rows, seq, inter = cfg["rows"], cfg["seq"], cfg["inter"]
        for layer in range(len(results[0]["acts"])):
            held = [r["acts"][layer][0] for r in results]
            assert all(r["acts"][layer][1] == (Shard(0), Shard(2)) for r in results), results[0]["acts"]
            assert sum(held) == rows * seq * inter, (layer, held)
            assert max(held) == math.ceil(rows / SHAPE[0]) * seq * math.ceil(inter / SHAPE[1]), (layer, held)
        assert all(not r["fallbacks"] for r in results), results[0]["fallbacks"]
    # The annotations took effect: each annotated parameter is stored split (a share per process).
    for name, spec in specs.items():
        shape = want["params"][name].shape
        whole = shape.numel()
        ways = 1
        for axis in spec:
            for a in axis if isinstance(axis, tuple) else (axis,):
                ways *= {"data": SHAPE[0], "model": SHAPE[1], None: 1}[a]
        assert max(r["local"][name] for r in results) < whole, name
        assert sum(r["local"][name] for r in results) == whole * 4 // ways, name
        for d, axis in enumerate(spec):
            if isinstance(axis, tuple):  # over every device: torch.chunk's flat tiling (XLA's), by rank
                tiles = [len(c) for c in torch.arange(shape[d]).chunk(4)]
                tiles += [0] * (4 - len(tiles))
                assert [r["local"][name] for r in results] == [t * whole // shape[d] for t in tiles], name


# torch 2.13 merges per-axis gathers into one over a flattened mesh and then refuses the merged
# step for _StridedShard: where torch does not merge (2.9) DTensor never refuses these layouts.
MERGES = hasattr(dtensor_redistribute, "_optimize_transform_infos")


def _explained_step():
    # (MLPs annotated as pairs compute as Megatron's layouts, nothing refused; nn.MultiheadAttention's
    # packed projection split by heads computes through DTensor's decomposition, which still meets refusals)
    cfg, specs = CASES["vocab_and_attention"]
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), SHAPE, ("data", "model"))
    model = P.build(cfg)
    params = dict(model.named_parameters())
    for name, spec in specs.items():
        ts.mark_sharding(params[name], mesh, spec)
    opt = P.optimizer(cfg, model)
    data, target = ts.shard_batch(P.batches(cfg)[0], ts.ShardingSpec(mesh, ("data", None)))
    losses = []

    def step():
        with ts.step():
            loss = P.loss_of(model(data), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())

    r = ts.explain(model, step)
    after = ts.explain(model)  # no step: every one this process did so far
    rows = [(x.op, x.phase, x.module, x.source, x.target, x.shape, x.error, x.count) for x in r.regathered]
    return losses, rows, str(r), sum(x.count for x in after.regathered)


@pytest.mark.skipif(not MERGES, reason="this torch does not merge per-axis gathers (nothing is refused)")
def test_explain_lists_where_redistributions_were_regathered(dist):
    results = dist(4).run(_explained_step)
    want = _oracle(CASES["vocab_and_attention"][0])
    for losses, rows, text, so_far in results:
        torch.testing.assert_close(losses[0], want["losses"][0], rtol=RTOL, atol=ATOL)
        assert rows, text
        for op, phase, module, source, target, shape, error, count in rows:
            assert "_StridedShard" in source and target == "(Replicate(), Replicate())", rows
            assert "_StridedShard redistribute assumes no flattened transforms" in error
            assert count >= 1
        # the weight gradients' matrix products in backward, inside the attention the annotations split
        mm = [(phase, module) for op, phase, module, *_ in rows if op == "aten.mm.default"]
        assert mm and all(phase == "backward" for phase, _ in mm), rows
        assert all(module.startswith("DecoderModel.layers.") for _, module in mm), rows
        assert "redistribute" not in [row[0] for row in rows], rows  # every one inside an op, named
        assert so_far >= sum(row[-1] for row in rows)
        assert "Redistributions DTensor refused, done as a gather to Replicate and a split" in text
        assert "aten.mm.default" in text and "DTensor raised: AssertionError" in text


def _strided_round_trip():
    """A (batch, sequence) activation split over both axes on the batch, in the sequence-first
    layout nn.MultiheadAttention uses, flattened: its rows are split twice (_StridedShard on each
    axis). Gathered whole (DTensor refuses on torch 2.13) and split to other layouts, it must be
    the global value, forward and backward."""
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), SHAPE, ("data", "model")).device_mesh
    g = torch.Generator().manual_seed(7)
    whole = torch.randn(4, 6, 8, generator=g)  # (batch, sequence, features): the same on every process
    x = torch.distributed.tensor.distribute_tensor(whole, mesh, [Shard(0), Shard(0)]).requires_grad_(True)
    flat = x.transpose(0, 1).reshape(24, 8)
    strided = all(isinstance(p, _StridedShard) for p in flat.placements)
    with redistribution.watching() as fallbacks:
        gathered = flat.redistribute(mesh, [Replicate(), Replicate()])
        split = flat.redistribute(mesh, [Replicate(), Shard(1)])
        (gathered.to_local() * 2).sum().backward()
    return (strided, gathered.to_local().detach(), split.full_tensor().detach(), split.to_local().shape,
            x.grad.full_tensor(),
            whole.transpose(0, 1).reshape(24, 8), [f.op for f in fallbacks])


def test_a_refused_redistribution_is_exact(dist):
    for strided, gathered, split, local_shape, grad, want, ops in dist(4).run(_strided_round_trip):
        assert strided
        torch.testing.assert_close(gathered, want, rtol=0, atol=0)
        torch.testing.assert_close(split, want, rtol=0, atol=0)
        assert tuple(local_shape) == (24, 4)
        torch.testing.assert_close(grad, torch.full((4, 6, 8), 2.0), rtol=0, atol=0)
        if MERGES:
            assert "redistribute" in ops, ops  # the explicit calls (backward's view of the rows: its op)


def _errors_that_are_not_layouts():
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), SHAPE, ("data", "model")).device_mesh
    x = torch.distributed.tensor.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()])
    target = torch.distributed.tensor.distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()])._spec
    calls = []

    def refuses(local, current, wanted, *a, **k):  # DTensor refusing every step, the fallback's too
        calls.append(wanted.placements)
        raise NotImplementedError("refused")

    def local_op_fails(local, current, wanted, *a, **k):  # not DTensor's refusal: maybe on this process only
        calls.append(wanted.placements)
        return local.view(5, 5)

    def peer_gone(local, current, wanted, *a, **k):  # a collective failing
        calls.append(wanted.placements)
        raise dist_c10d.DistError("peer gone")

    out = []
    for original in (refuses, local_op_fails, peer_gone):
        calls.clear()
        with redistribution.watching() as fallbacks:
            try:
                redistribution.redistribute(original, x.to_local(), x._spec, target)
            except Exception as e:
                out.append((type(e).__name__, str(e).splitlines()[0], len(calls), len(fallbacks)))
    return out


def test_errors_that_are_not_layouts_still_raise(dist):
    for got in dist(4).run(_errors_that_are_not_layouts):
        # DTensor's own error after the fallback's gather met it too; a local op's and a collective's at once
        assert got == [("NotImplementedError", "refused", 2, 0),
                       ("RuntimeError", "shape '[5, 5]' is invalid for input of size 8", 1, 0),
                       ("DistError", "peer gone", 1, 0)]


def _pending_sum_to_masked_partial():
    """A pending sum moved to an embedding's masked partial (what DTensor's backward asks of a gradient
    reaching an embedding split over the vocabulary): DTensor refuses it, and the fallback must not
    split it as if it were an index tensor (masking values by the vocabulary offsets: wrong numbers)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    try:
        from torch.distributed.tensor.placement_types import _MaskPartial
    except ImportError:  # (where older torch keeps it)
        from torch.distributed.tensor._ops._embedding_ops import _MaskPartial

    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), SHAPE, ("data", "model")).device_mesh
    g = torch.Generator().manual_seed(3)
    local = torch.randn(2, 6, 8, generator=g)
    x = torch.distributed.tensor.DTensor.from_local(local, mesh, [Shard(0), Partial()], run_check=False)
    target = DTensorSpec(mesh, (Shard(0), _MaskPartial(offset_shape=torch.Size([13, 8]), offset_dim=0)),
                         tensor_meta=x._spec.tensor_meta)
    try:  # as DTensor's backward calls it (the public redistribute refuses partial targets itself)
        dtensor_redistribute.redistribute_local_tensor(x.to_local(), x._spec, target)
    except AssertionError as e:
        return "refused", str(e).splitlines()[0]
    return "split", ""


def test_a_pending_sum_is_never_split_as_a_masked_partial(dist):
    for what, message in dist(4).run(_pending_sum_to_masked_partial):
        assert what == "refused" and "partial type" in message, (what, message)


def _installed_and_removed():
    import importlib

    names = ("torch.distributed.tensor._redistribute", "torch.distributed.tensor._dispatch",
             "torch.distributed.tensor._api")

    def state():
        return [id(getattr(importlib.import_module(n), "redistribute_local_tensor")) for n in names]

    from torchspmd import patches

    fresh = state()
    ts.use_spmd(backend="cpu")
    applied = state()
    active = [p.name for p in patches.active()]
    patches.remove_all()
    return fresh, applied, active, state()


def test_the_fallback_is_a_patch_use_spmd_applies_and_removal_undoes():
    fresh, applied, active, removed = run_clean(_installed_and_removed, allow_torchspmd=True)
    assert "torch.distributed.tensor redistribute_local_tensor (fallback)" in active
    assert all(a != f for a, f in zip(applied, fresh))  # each module calls through the fallback
    assert removed == fresh
