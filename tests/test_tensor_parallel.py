"""The 'model' axis: tensor parallelism from sharding annotations, against one device.

Every run trains 3 Adam steps on the same random global batches as the one-device oracle
(_tp_models.oracle, plain PyTorch in a clean process) and must reproduce its losses, its
gradients at every step and its final parameters (fp32: rtol 1e-5, atol 1e-6; Adam's eps is
torch's default, 1e-8, except for the Llama's 1e-3: _tp_models.EPS says why). The vocabulary
(37) splits unevenly over 'model'; batches of 5 and 7 rows split unevenly over the data axes.
"""

import contextlib
import functools
import math
import warnings

import _tp_models as M
import numpy as np
import pytest
import torch
from _clean import run_clean
from torch.distributed.tensor import DTensor

import torchspmd as ts

RTOL, ATOL = 1e-5, 1e-6


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _annotate_attn(model, mesh):
    for b in model.blocks:
        ts.mark_sharding(b.attn.in_proj_weight, mesh, ("model", None))  # split by heads
        ts.mark_sharding(b.attn.out_proj.weight, mesh, (None, "model"))
        ts.mark_sharding(b.mlp.fc1.weight, mesh, ("model", None))
        ts.mark_sharding(b.mlp.fc2.weight, mesh, (None, "model"))


def _annotate(model, mesh, style, data_axis):
    """The torch_xla way: in place, the result unused. 'tp': the model axis alone;
    'xla': torch_xla's 2D recipe, the data axis on the other dim; 'returned': 'tp',
    assigning the results back."""
    col, row = ("model", None), (None, "model")
    if style == "xla":
        col, row = ("model", data_axis), (data_axis, "model")

    def mark(module, name, spec):
        out = ts.mark_sharding(getattr(module, name), mesh, spec)
        if style == "returned":
            setattr(module, name, out)

    for b in model.blocks:
        mark(b.fc1, "weight", col)
        mark(b.fc1, "bias", ("model",))
        mark(b.fc2, "weight", row)
    mark(model.lm_head, "weight", ("model", None))  # vocabulary split: output gathered
    mark(model.embed, "weight", ("model", None))  # vocabulary split: one all-reduce


def _train(wrap, shape, style, batch, kind="mlp", act_spec=None):
    n = ts.global_runtime_device_count()
    data_axis = "data" if wrap == "pattern1" else "fsdp"
    mesh = ts.Mesh(np.arange(n), shape, (data_axis, "model"))
    ts.set_global_mesh(mesh)
    model = M.build(kind)
    if act_spec is not None:  # the program annotates an activation inside its forward, as torch_xla programs do
        marked = tuple(data_axis if a == "data" else a for a in act_spec)
        for b in model.blocks:
            b.fc1.register_forward_hook(lambda mod, args, out: ts.mark_sharding(out, mesh, marked))
    whole = {k: p.numel() for k, p in model.named_parameters()}
    if kind in ("mlp", "tied") and style != "none":
        _annotate(model, mesh, style, data_axis)
    elif kind == "attn":
        _annotate_attn(model, mesh)
    elif kind == "packed":
        for b in model.blocks:
            for lin in (b.q, b.kv, b.w12):
                ts.mark_sharding(lin.weight, mesh, ("model", None))
            for lin in (b.o, b.w3):
                ts.mark_sharding(lin.weight, mesh, (None, "model"))
    elif kind == "llama":
        from torchspmd.hf.fsdp_v2 import shard_by_tp_plan

        shard_by_tp_plan(model, mesh)
    inner = model
    layer = {"mlp": M.Block, "tied": M.Block, "attn": M.AttnBlock, "packed": M.PackedBlock}.get(kind) or type(model.model.layers[0])
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer})
    if wrap == "fsdp":
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    elif wrap == "checkpoint":  # nested units, each with activation checkpointing
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy,
                          auto_wrapper_callable=lambda m, *a, **k: ts.FSDPv2(ts.checkpoint_module(m), *a, **k))
    acts = []
    fc2 = {"mlp": lambda: inner.blocks[0].fc2, "tied": lambda: inner.blocks[0].fc2, "attn": lambda: inner.blocks[0].mlp.fc2,
           "packed": lambda: inner.blocks[0].w3,
           "llama": lambda: inner.model.layers[0].mlp.down_proj}[kind]()
    fc2.register_forward_pre_hook(lambda mod, args: acts.append(_local(args[0]).numel()))
    # eps as the oracle's: torch's default, but 1e-3 for the Llama, where the default turns last-bit
    # noise of near-zero gradients into differences beyond the tolerance (_tp_models.EPS: measured)
    opt = torch.optim.Adam(model.parameters(), lr=M.LR, eps=M.adam_eps(kind))
    spec = ts.ShardingSpec(mesh, (data_axis, None))
    losses, grads, storage = [], [], None
    for x, y in M.batches(batch):
        with ts.step():
            loss = M.loss_of(model(ts.shard_batch(x, spec)), ts.shard_batch(y, spec))
            loss.backward()
            grads.append({k: _full(p.grad) for k, p in model.named_parameters()})  # every step's, whole
            if storage is None:
                storage = {k: [_local(p).numel(), _local(p.grad).numel()] for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    for k, p in model.named_parameters():
        storage[k].append(_local(opt.state[p]["exp_avg"]).numel())
    layouts = {k: tuple(p.placements) if isinstance(p, DTensor) else None for k, p in model.named_parameters()}
    final = {k: _full(p.detach()) for k, p in model.named_parameters()}
    first = ts.global_ordinal() == 0
    return dict(losses=losses, grads=grads if first else None, final=final if first else None, storage=storage,
                # (the first real call's: FSDPv2's analysis traces the forward once, the hook seeing
                # a symbolic size then)
                whole=whole, act=next(a for a in acts if type(a) is int), layouts=layouts)


@functools.lru_cache(maxsize=None)
def _oracle(kind, batch):
    """One device's run, in a clean process: once per (model, batch) for this test runner."""
    return run_clean(M.oracle, kind, batch)


def _check_against_oracle(results, kind, batch):
    ref_losses, ref_grads, ref_final = _oracle(kind, batch)
    r0 = results[0]
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=RTOL, atol=ATOL)
        assert r["losses"] == r0["losses"]  # one program: every process reports the same loss
    assert len(r0["grads"]) == len(ref_grads) == M.STEPS and r0["final"].keys() == ref_final.keys()
    for step, (grads, want) in enumerate(zip(r0["grads"], ref_grads), 1):  # the gradients of every step
        assert grads.keys() == want.keys() == ref_final.keys()
        for k in want:
            torch.testing.assert_close(grads[k], want[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k, step=step: f"step {step} grad {k}: {m}")
    for k in ref_final:
        got, want = r0["final"][k], ref_final[k]
        if k.endswith("in_proj_bias"):
            # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared
            # by every key); Adam turns its rounding noise, which differs with the summation
            # order, into steps of ~lr. Compare the query and value biases.
            assert all(g[k][M.DIM:2 * M.DIM].abs().max() < 1e-6 for g in ref_grads)
            got, want = got[list(range(M.DIM)) + list(range(2 * M.DIM, 3 * M.DIM))], \
                want[list(range(M.DIM)) + list(range(2 * M.DIM, 3 * M.DIM))]
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"param {k}: {m}")


# (wrap, mesh shape, annotation style, global batch)
CASES = [
    ("fsdp", (2, 2), "tp", 5), ("fsdp", (1, 4), "tp", 5), ("fsdp", (4, 1), "tp", 7), ("fsdp", (1, 2), "tp", 5),
    ("fsdp", (2, 2), "xla", 5), ("fsdp", (1, 2), "xla", 3), ("fsdp", (2, 2), "returned", 5),
    ("checkpoint", (2, 2), "tp", 5),
    ("pattern1", (2, 2), "tp", 4), ("pattern1", (2, 2), "tp", 5), ("pattern1", (1, 4), "tp", 5),
    ("pattern1", (4, 1), "tp", 8), ("pattern1", (1, 2), "tp", 5),
]


@pytest.mark.smoke
@pytest.mark.parametrize("wrap,shape,style,batch", CASES)
def test_tensor_parallel_matches_one_device(dist, wrap, shape, style, batch):
    world = math.prod(shape)
    results = dist(world).run(_train, wrap, shape, style, batch)
    _check_against_oracle(results, "mlp", batch)
    fsdp, tp = shape
    for k, whole in results[0]["whole"].items():
        # Each annotated parameter, its gradient and its Adam state: every element held once
        # over the processes it is split over, a 1/(product of its axes) share (+ padding).
        split = tp * (fsdp if wrap != "pattern1" else 1)
        if k.endswith("norm.weight") or k.endswith("fc2.bias"):
            split = fsdp if wrap != "pattern1" else 1  # unannotated: FSDP's share, or whole
        bound = math.ceil(whole / split) + (whole // min(whole, 16) if split > 1 else 0)  # + one padded row
        for i, what in enumerate(("parameter", "gradient", "Adam exp_avg")):
            locals_ = [r["storage"][k][i] for r in results]
            assert max(locals_) <= bound, (k, what, locals_, whole, split)
            assert sum(locals_) >= whole * world // split, (k, what, locals_)  # nothing lost
    rows, seq = batch, 8
    if wrap == "pattern1" and batch % fsdp:
        return  # DTensor's linear flattens (batch, seq): uneven rows cannot stay split (docs/data_parallel.md)
    # The MLP's intermediate activation: each process holds its rows x its 'model' share of
    # the features, every element once: 1/(fsdp x model) (Pattern 1: 1/(data x model)).
    assert sum(r["act"] for r in results) == rows * seq * M.INTER
    assert max(r["act"] for r in results) == math.ceil(rows / fsdp) * seq * M.INTER // tp


def test_in_place_and_returned_annotations_give_one_layout(dist):
    a = dist(4).run(_train, "fsdp", (2, 2), "tp", 5)
    b = dist(4).run(_train, "fsdp", (2, 2), "returned", 5)
    for ra, rb in zip(a, b):
        assert ra["layouts"] == rb["layouts"]
        assert ra["storage"] == rb["storage"]
    # the weights computed tensor-parallel are stored over both axes
    assert len(a[0]["layouts"]["blocks.0.fc1.weight"]) == 2


def _pattern1_layout():
    mesh = ts.Mesh(np.arange(ts.global_runtime_device_count()), (2, 2), ("data", "model"))
    model = M.build("mlp")
    _annotate(model, mesh, "tp", "data")
    w = model.blocks[0].fc1.weight
    model.blocks[0].register_buffer("table", torch.randn(6, 4))
    ts.mark_sharding(model.blocks[0].table, mesh, ("data", None))  # a buffer: in place too
    table = model.blocks[0].table
    return (isinstance(w, torch.nn.Parameter), ts.get_sharding(w), ts.get_sharding(model.blocks[0].fc2.weight),
            ts.get_sharding(table), dict(model.blocks[0].named_buffers())["table"] is table)


def test_in_place_annotation_replaces_the_module_parameter(dist):
    for is_param, fc1, fc2, table, registered in dist(4).run(_pattern1_layout):
        assert is_param and fc1 == ("model", None) and fc2 == (None, "model")
        assert table == ("data", None) and registered


def _errors(case):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (2, 2), ("fsdp", "model"))
    model = M.build("mlp")
    try:
        if case == "unknown_axis":
            ts.mark_sharding(model.blocks[0].fc1.weight, mesh, ("tensor", None))
        elif case == "other_mesh":
            other = ts.Mesh(np.arange(n), (1, 4), ("fsdp", "model"))
            ts.mark_sharding(model.blocks[0].fc1.weight, other, ("model", None))
            ts.FSDPv2(model, mesh=mesh)
        elif case == "uneven_pair":
            model.blocks[0].fc1 = torch.nn.Linear(M.DIM, 25)
            model.blocks[0].fc2 = torch.nn.Linear(25, M.DIM)
            ts.mark_sharding(model.blocks[0].fc1.weight, mesh, ("model", None))
            ts.mark_sharding(model.blocks[0].fc2.weight, mesh, (None, "model"))
            ts.FSDPv2(model, mesh=mesh)
        elif case == "uneven_pair_nested":  # the same, in a unit of its own: named from the model
            model.blocks[0].fc1 = torch.nn.Linear(M.DIM, 25)
            model.blocks[0].fc2 = torch.nn.Linear(25, M.DIM)
            ts.mark_sharding(model.blocks[0].fc1.weight, mesh, ("model", None))
            ts.mark_sharding(model.blocks[0].fc2.weight, mesh, (None, "model"))
            ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=functools.partial(ts.transformer_auto_wrap_policy,
                                                                           transformer_layer_cls={M.Block}))
        elif case == "mha_heads":  # 3 heads over 'model' of size 2
            attn = torch.nn.MultiheadAttention(18, 3, batch_first=True)
            ts.mark_sharding(attn.in_proj_weight, mesh, ("model", None))
            ts.FSDPv2(attn, mesh=mesh)
        elif case == "kv_heads":  # Llama's 2 key/value heads over 'model' of size 4
            from torchspmd.hf.fsdp_v2 import shard_by_tp_plan

            mesh = ts.Mesh(np.arange(n), (1, 4), ("fsdp", "model"))
            llama = M.build("llama")
            shard_by_tp_plan(llama, mesh)
            ts.FSDPv2(llama, mesh=mesh)
        elif case == "strict":
            ts.mark_sharding(model.blocks[0].norm.weight, mesh, ("model",))
            ts.FSDPv2(model, mesh=mesh, strict_sharding=True)
        elif case == "warn":
            ts.mark_sharding(model.blocks[0].norm.weight, mesh, ("model",))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ts.FSDPv2(model, mesh=mesh)
            return [str(w.message) for w in caught if "gathered whole" in str(w.message)]
    except ts.SpmdError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,pattern", [
    ("unknown_axis", r"axis name 'tensor' is not defined in the mesh"),
    ("other_mesh", r"'blocks.0.fc1.weight' is sharded over another mesh than FSDPv2's"),
    ("uneven_pair", r"'blocks.0.fc1.weight' has 25 output features, which do not split evenly over the "
                    r"'model' axis of size 2"),
    ("uneven_pair_nested", r"'blocks.0.fc1.weight' has 25 output features, which do not split evenly over the "
                           r"'model' axis of size 2; its output stays split into 'blocks.0.fc2.weight'"),
    ("strict", r"'blocks.0.norm.weight' \(RMSNorm\) is annotated over 'model' but is gathered whole"),
    ("mha_heads", r"'in_proj_weight' projects to 3 heads, which do not split over the 'model' axis of size 2"),
    ("kv_heads", r"'model.layers.0.self_attn.k_proj.weight' projects to 2 heads, which do not split over the "
                 r"'model' axis of size 4"),
])
def test_errors_name_the_parameter_and_axis(dist, case, pattern):
    import re

    for message in dist(4).run(_errors, case):  # every process raises the same error
        assert message is not None and re.search(pattern, message), message


def test_a_parameter_gathered_whole_is_named_in_a_warning(dist):
    for caught in dist(4).run(_errors, "warn"):
        assert len(caught) == 1 and "'blocks.0.norm.weight'" in caught[0] and "strict_sharding" in caught[0]


def _input_grad(annotate):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (2, n // 2), ("fsdp", "model"))
    net = M.pair()
    if annotate:
        ts.mark_sharding(net[0].weight, mesh, ("model", None))
        ts.mark_sharding(net[2].weight, mesh, (None, "model"))
    model = ts.FSDPv2(net, mesh=mesh)
    x = ts.mark_sharding(M.input_rows().requires_grad_(True), mesh, ("fsdp", None))
    with ts.step():
        model(x).pow(2).mean().backward()
    return x.grad.full_tensor()


@pytest.mark.parametrize("annotate", [True, False])
def test_the_gradient_of_an_input_is_one_devices(dist, annotate):
    # The processes along 'model' compute the same rows: each holds the whole input gradient
    # (it is not a share of a sum over 'model').
    expected = run_clean(M.input_grad_oracle)
    for got in dist(4).run(_input_grad, annotate):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


# The attention-and-MLP model (nn.MultiheadAttention split by heads: its packed projection on
# 'model' by heads and on 'fsdp' by input features) and a transformers Llama with grouped
# key/value heads (4 heads, 2 key/value heads) from its own tensor-parallel plan.
@pytest.mark.parametrize("kind,wrap,shape,batch", [
    ("attn", "fsdp", (2, 2), 5), ("attn", "checkpoint", (1, 4), 5),
    ("llama", "fsdp", (2, 2), 5), ("llama", "fsdp", (1, 2), 3), ("tied", "fsdp", (2, 2), 5),
])
def test_attention_and_llama_match_one_device(dist, kind, wrap, shape, batch):
    results = dist(math.prod(shape)).run(_train, wrap, shape, "tp", batch, kind)
    if kind == "tied":  # one parameter, under its first name
        assert "lm_head.weight" not in results[0]["whole"]
    _check_against_oracle(results, kind, batch)
    if wrap != "pattern1":
        fsdp, tp = shape
        assert max(r["act"] for r in results) == math.ceil(batch / fsdp) * 8 * M.INTER // tp


@pytest.mark.parametrize("wrap,shape", [("fsdp", (1, 2)), ("fsdp", (2, 2)), ("pattern1", (1, 2))])
def test_packed_projections_and_a_whole_norm_are_one_devices(dist, wrap, shape):
    """Column-parallel outputs the program cuts itself (`chunk` of a packed gate/up or
    key/value projection) or normalises over all features are not kept split into their
    row-parallel partners (FSDPv2 kept them split: silently wrong values); the model trains
    as on one device."""
    results = dist(math.prod(shape)).run(_train, wrap, shape, "tp", 5, "packed")
    _check_against_oracle(results, "packed", 5)


@pytest.mark.parametrize("wrap,shape,style,act_spec", [
    ("fsdp", (2, 2), "tp", ("data", None, "model")), ("fsdp", (2, 1), "none", ("data", None, None)),
    ("fsdp", (4, 1), "none", (None, None, None)), ("pattern1", (2, 2), "tp", ("data", None, "model")),
    ("pattern1", (2, 1), "none", ("data", None, None)),
])
def test_an_activation_annotated_inside_forward_is_one_devices(dist, wrap, shape, style, act_spec):
    """mark_sharding on an activation inside the model's forward (a layout constraint in
    torch_xla) under FSDPv2 (whose forward computes this process's rows: the activation was
    taken for a global value and met plain tensors) and Pattern 1 (with and without 'model'
    weights: its local calls too), against one device."""
    results = dist(math.prod(shape)).run(_train, wrap, shape, style, 5, "mlp", act_spec)
    _check_against_oracle(results, "mlp", 5)


def _dropout_on_a_row_parallel_output():
    mesh = ts.Mesh(np.arange(2), (1, 2), ("data", "model"))
    p = M.pair()
    ts.mark_sharding(p[0].weight, mesh, ("model", None))
    ts.mark_sharding(p[2].weight, mesh, (None, "model"))
    x = ts.mark_sharding(M.input_rows(), mesh, ("data", None))
    y = p(x)  # the row-parallel output: a pending sum over 'model'
    out = torch.nn.functional.dropout(y, 0.5, training=True)
    return y.full_tensor().detach(), out.full_tensor().detach()


def test_dropout_of_a_row_parallel_output(dist):
    """Pattern 1: dropout on a row-parallel layer's output (residual dropout, GPT-2's) filled
    a mask shaped as a pending sum in place and failed; every element is now either dropped
    or kept and scaled, as on one device (one mask for the summed value)."""
    for y, out in dist(2).run(_dropout_on_a_row_parallel_output):
        torch.testing.assert_close(y, input_grad_free_pair(), rtol=RTOL, atol=ATOL)
        kept = out != 0
        assert 0 < kept.sum() < out.numel()
        torch.testing.assert_close(out[kept], 2 * y[kept], rtol=RTOL, atol=ATOL)


@contextlib.contextmanager
def _dropout_masks():
    """Every ``F.dropout`` call's mask meanwhile (this process's part), and whether autograd
    was running (a checkpointed module's recomputation): a list of ``(again, mask)``."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    calls, real = [], torch.nn.functional.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = real(x, p, training, inplace)
        if get_proxy_mode() is None:  # (not FSDPv2's analysis, which traces the forward once on fake tensors)
            calls.append((torch._C._current_graph_task_id() != -1, (_local(out) != 0).detach().clone()))
        return out

    torch.nn.functional.dropout = recording
    try:
        yield calls
    finally:
        torch.nn.functional.dropout = real


def _dropout_run(shape, wrap, batch):
    """One FSDPv2 step of M.DropLM split over 'model', recording every dropout's mask (this
    process's part) and whether autograd was recomputing (a checkpointed unit) when drawn."""
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), shape, ("fsdp", "model"))
    model = M.build("drop")
    for b in model.blocks:
        for lin in (*b.qkv.values(), b.fc1):
            ts.mark_sharding(lin.weight, mesh, ("model", None))
        ts.mark_sharding(b.fc1.bias, mesh, ("model",))
        for lin in (b.o, b.fc2):
            ts.mark_sharding(lin.weight, mesh, (None, "model"))
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={M.DropBlock})
    if wrap == "fsdp":
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy)
    else:  # nested units, each checkpointed, and inside each the MLP's activation and dropout:
        # backward recomputes the forward, dropout included
        for b in model.blocks:
            ts.checkpoint_module(b.act)
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy,
                          auto_wrapper_callable=lambda m, *a, **k: ts.FSDPv2(ts.checkpoint_module(m), *a, **k))
    x, y = M.batches(batch)[0]
    spec = ts.ShardingSpec(mesh, ("fsdp", None))
    with _dropout_masks() as calls, ts.step():
        loss = M.loss_of(model(ts.shard_batch(x, spec)), ts.shard_batch(y, spec))
        loss.backward()
    return dict(loss=loss.item(), grads={k: _full(p.grad) for k, p in model.named_parameters()},
                forward=[m for again, m in calls if not again], recomputed=[m for again, m in calls if again],
                coord=tuple(mesh.device_mesh.get_coordinate()))


@pytest.mark.parametrize("wrap,shape,batch", [("fsdp", (1, 2), 5), ("fsdp", (2, 2), 5), ("checkpoint", (2, 2), 5)])
def test_dropout_inside_a_pair_draws_a_mask_per_split(dist, wrap, shape, batch):
    """Dropout between a column-parallel linear and its row-parallel partner (attention
    weights: each process's heads; the MLP's hidden features) drew the same stream on every
    'model' process of the same rows, so every split of a row got the same mask. Now each
    split draws its own, while dropout of a whole (replicated) activation keeps one mask
    along 'model' (the processes' copies stay equal), and a checkpointed unit recomputes the
    masks it drew. The oracle: one device, plain PyTorch, applying the masks the processes
    drew (put together from their parts) — losses and gradients must match."""
    results = dist(math.prod(shape)).run(_dropout_run, shape, wrap, batch)
    by = {r["coord"]: r for r in results}
    data, split = shape
    kinds = M.DropLM.KINDS
    for r in results:
        assert len(r["forward"]) == len(kinds)
        assert r["loss"] == results[0]["loss"]
        if wrap == "checkpoint":  # (backward's gradients against the oracle check the recomputed masks too)
            assert len(r["recomputed"]) >= 3
            assert all(any(torch.equal(a, b) for b in r["forward"]) for a in r["recomputed"])
        for i, kind in enumerate(kinds):  # (the attention weights above the diagonal are zero, dropped or not)
            if kind == "features":
                assert 0.3 < r["forward"][i].float().mean() < 0.7
    for d in range(data):
        for i, kind in enumerate(kinds):
            parts = [by[(d, m)]["forward"][i] for m in range(split)]
            if kind == "whole":  # one mask on every process of these rows
                assert all(torch.equal(parts[0], q) for q in parts)
            else:  # each split its own mask (the code before gave every split the same)
                assert not any(torch.equal(parts[0], q) for q in parts[1:]), (d, i)
    # every process's part, put together: heads on dim 1 (attention), features last (MLP)
    masks = []
    for i, kind in enumerate(kinds):
        rows = []
        for d in range(data):
            parts = [by[(d, m)]["forward"][i] for m in range(split)]
            rows.append(parts[0] if kind == "whole" else torch.cat(parts, dim=1 if kind == "heads" else -1))
        masks.append(torch.cat(rows, dim=0).float())
    loss, grads = run_clean(M.dropout_oracle, batch, masks)
    r0 = by[(0, 0)]
    np.testing.assert_allclose(r0["loss"], loss, rtol=RTOL, atol=ATOL)
    assert r0["grads"].keys() == grads.keys()
    for k in grads:
        torch.testing.assert_close(r0["grads"][k], grads[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"grad {k}: {m}")


def _lora_dropout_run():
    """M.DropLM with LoRA adapters (dropout 0.5) on a column-parallel linear of each pair
    (q, fc1), split over 'model' at (1, 2): every dropout's mask and the adapters' gradients."""
    import peft

    mesh = ts.Mesh(np.arange(2), (1, 2), ("fsdp", "model"))
    model = M.build("drop")
    peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["q", "fc1"], lora_dropout=0.5), model)
    for b in model.blocks:
        q = b.qkv["q"]
        for lin in (q.base_layer, b.qkv["k"], b.qkv["v"], b.fc1.base_layer, q.lora_B["default"],
                    b.fc1.lora_B["default"]):
            ts.mark_sharding(lin.weight, mesh, ("model", None))
        ts.mark_sharding(b.fc1.base_layer.bias, mesh, ("model",))
        for lin in (b.o, b.fc2):
            ts.mark_sharding(lin.weight, mesh, (None, "model"))
    model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=functools.partial(
        ts.transformer_auto_wrap_policy, transformer_layer_cls={M.DropBlock}))
    x, y = M.batches(4)[0]
    spec = ts.ShardingSpec(mesh, ("fsdp", None))
    with _dropout_masks() as calls:
        M.loss_of(model(ts.shard_batch(x, spec)), ts.shard_batch(y, spec)).backward()
    return [m for _, m in calls], {k: _local(p.grad).clone() for k, p in model.named_parameters() if "lora_A" in k}


def test_lora_dropout_of_a_column_layers_whole_input_keeps_one_mask(dist):
    """PEFT's LoRA on a column-parallel linear drops out the layer's whole input for its
    ``lora_A`` after the base layer ran: that mask must be the same on every 'model' process
    (lora_A is whole there), and the split stream starts after the adapter. With the stream
    switched at the base layer, each process drew its own mask and lora_A's gradients
    differed between the processes that hold it whole."""
    (c0, g0), (c1, g1) = dist(2).run(_lora_dropout_run)
    assert len(c0) == len(c1) == 9  # per block: q's adapter, heads, fc1's adapter, features (+ block 0's output)
    for i, kind in enumerate(("whole", "heads", "whole", "features", "whole", "whole", "heads", "whole", "features")):
        assert torch.equal(c0[i], c1[i]) == (kind == "whole"), (i, kind)
    assert g0.keys() == g1.keys() and len(g0) == 4
    for k in g0:
        torch.testing.assert_close(g0[k], g1[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def _attention_dropout_masks():
    mesh = ts.Mesh(np.arange(2), (1, 2), ("fsdp", "model"))
    model = M.build("attn")
    for b in model.blocks:
        b.attn.dropout = 0.5
    _annotate_attn(model, mesh)
    model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=functools.partial(
        ts.transformer_auto_wrap_policy, transformer_layer_cls={M.AttnBlock}))
    x, y = M.batches(4)[0]
    spec = ts.ShardingSpec(mesh, ("fsdp", None))
    with _dropout_masks() as calls:
        loss = M.loss_of(model(ts.shard_batch(x, spec)), ts.shard_batch(y, spec))
    return [m for _, m in calls], loss.item()


def test_attention_dropout_of_split_heads_draws_a_mask_per_split(dist):
    """nn.MultiheadAttention split by heads: its dropout of the attention weights (the path
    that returns them) drew the same masks on both 'model' processes, one per head position."""
    (m0, l0), (m1, l1) = dist(2).run(_attention_dropout_masks)
    assert l0 == l1 and len(m0) == len(m1) == 1  # the second block returns its weights: F.dropout
    assert m0[0].shape == m1[0].shape and not torch.equal(m0[0], m1[0])


def input_grad_free_pair():
    with torch.no_grad():
        return M.pair()(M.input_rows())


class _Pair(torch.nn.Sequential):
    pass


def _clip_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(M.DIM, M.DIM), _Pair(*M.pair()))


def _clipped_by_torch(foreach):
    mesh = ts.Mesh(np.arange(4), (2, 2), ("fsdp", "model"))
    net = _clip_model()
    ts.mark_sharding(net[1][0].weight, mesh, ("model", None))
    ts.mark_sharding(net[1][2].weight, mesh, (None, "model"))
    net = ts.FSDPv2(net, mesh=mesh, auto_wrap_policy=functools.partial(ts.transformer_auto_wrap_policy,
                                                                       transformer_layer_cls={_Pair}))
    with ts.step():
        net(ts.mark_sharding(M.input_rows(), mesh, ("fsdp", None))).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05, foreach=foreach)
    return float(norm), {k: _full(p.grad) for k, p in net.named_parameters()}


@pytest.mark.parametrize("foreach", [True, False])
def test_torchs_clip_grad_norm_over_units_of_two_meshes(dist, foreach):
    """torch.nn.utils.clip_grad_norm_ on a 2D FSDPv2 model whose units are held on
    ('fsdp', 'model') and on 'fsdp' alone (a unit without tensor parallelism): the norms
    of several meshes are stacked and every gradient scaled by one coefficient; DTensor
    refused both. The norm and the clipped gradients are one device's."""
    ref = _clip_model()
    ref(M.input_rows()).pow(2).mean().backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    assert want > 0.05  # it clips
    for norm, grads in dist(4).run(_clipped_by_torch, foreach):
        assert norm == pytest.approx(want, rel=RTOL, abs=0)
        for k, p in ref.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, rtol=RTOL, atol=ATOL)
