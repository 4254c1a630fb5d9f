"""Pipeline stages over a 'pipeline' mesh axis (``ts.pipeline``), against one device.

Every run trains 3 AdamW steps, with the gradients clipped by their global norm, on the same
random global batches as the one-device oracle (_pp_models.oracle, plain PyTorch in a clean
process) and must reproduce its losses (on every process), every step's gradients and the
final parameters of each process's stages (fp32: rtol 1e-5, atol 1e-6). The model has 5 layers
(uneven over 2 and 4 stages) and, in the tied case, an embedding tied to the LM head, which
then sit on the first and the last stage.
"""

import functools

import _pp_models as M
import numpy as np
import pytest
import torch
from _clean import run_clean
from torch.distributed.tensor import DTensor
from _helpers import same_on_every_rank

import torchspmd as ts

RTOL, ATOL = 1e-5, 1e-6


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _annotate(model, mesh, kind):
    """The 'model' axis: Megatron's pairs in every layer (attention's projections in, out;
    the MLP's up, down), the embedding and the LM head split by vocabulary (37 rows over 2:
    uneven)."""
    if kind == "llama":
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight = ts.mark_sharding(lin.weight, mesh, ("model", None))
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                lin.weight = ts.mark_sharding(lin.weight, mesh, (None, "model"))
        model.model.embed_tokens.weight = ts.mark_sharding(model.model.embed_tokens.weight, mesh, ("model", None))
        model.lm_head.weight = model.model.embed_tokens.weight
        return
    for layer in model.layers:
        layer.qkv.weight = ts.mark_sharding(layer.qkv.weight, mesh, ("model", None))
        layer.fc1.weight = ts.mark_sharding(layer.fc1.weight, mesh, ("model", None))
        layer.o.weight = ts.mark_sharding(layer.o.weight, mesh, (None, "model"))
        layer.fc2.weight = ts.mark_sharding(layer.fc2.weight, mesh, (None, "model"))
    model.embed.weight = ts.mark_sharding(model.embed.weight, mesh, ("model", None))
    if kind == "tied":
        model.lm_head.weight = model.embed.weight
    else:
        model.lm_head.weight = ts.mark_sharding(model.lm_head.weight, mesh, ("model", None))


def _train(schedule, kind, rows, microbatches, fsdp=1, fixed=False, tp=1):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n // fsdp // tp, fsdp, tp), ("pipeline", "fsdp", "model"))
    model = M.build_llama() if kind == "llama" else M.build(kind == "tied")
    layer = M.llama_layer() if kind == "llama" else M.Layer
    if tp > 1:
        _annotate(model, mesh, kind)
    whole = sum(p.numel() for p in model.parameters())
    example = M.batches(rows)[0][0] if fsdp > 1 or fixed else None
    runner = ts.pipeline(model, mesh, split=layer, microbatches=microbatches, schedule=schedule,
                         example_inputs=example)
    canonical = {}  # (after pipeline(): the annotated parameters are the stages' own now)
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    opt = torch.optim.AdamW(runner.parameters(), lr=M.LR, eps=M.TP_EPS if tp > 1 else 1e-8)
    losses, grads = [], []
    for x, y in M.batches(rows):
        losses.append(runner.step(x, y, M.loss_fn).item())
        runner.clip_grad_norm_(M.MAX_NORM)
        grads.append({name: _full(p.grad).clone() for name, p in _named(runner, model, canonical)})
        opt.step()
        opt.zero_grad()
    final = {name: _full(p.detach()).clone() for name, p in _named(runner, model, canonical)}
    held_out = runner.evaluate(*M.held_out(rows), M.loss_fn).item()
    unique = {id(p): p for p in model.parameters()}.values()
    held = dict(model=sum(p.numel() for p in unique),
                runner=sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in runner.parameters()),
                split=sum(p.to_local().numel() for p in runner.parameters() if isinstance(p, DTensor)),
                whole=whole)
    return dict(losses=losses, grads=grads, final=final, stages=runner.describe()["this process's stages"],
                held_out=held_out,
                held=held, sizes=runner.describe()["parameters per stage"])


def _named(runner, model, canonical):
    """The runner's parameters by the model's first name for each (a tied one's name is the
    embedding's on every stage)."""
    for name, p in runner.named_parameters():
        yield canonical[id(model.get_parameter(name))], p


@functools.lru_cache(maxsize=None)
def _oracle(kind, rows, eps=1e-8):
    return run_clean(M.oracle, kind, rows, eps)


def _check(results, kind, rows, stages, eps=1e-8):
    ref_losses, ref_grads, ref_final, ref_held_out = _oracle(kind, rows, eps)
    held = set()
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(r["held_out"], ref_held_out, rtol=RTOL, atol=ATOL)  # runner.evaluate
        assert r["losses"] == results[0]["losses"]  # one program: the same loss on every process
        for step, (grads, want) in enumerate(zip(r["grads"], ref_grads), 1):
            for k, g in grads.items():
                torch.testing.assert_close(g, want[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {k}: {m}")
        for k, p in r["final"].items():
            torch.testing.assert_close(p, ref_final[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
        held |= set(r["final"])
    assert held == set(ref_final)  # every parameter is some process's
    assert sorted({k for r in results for k in r["stages"]}) == list(range(stages))


@pytest.mark.parametrize("schedule, kind, world, stages", [
    ("gpipe", "plain", 2, 2),
    ("1f1b", "plain", 2, 2),
    pytest.param("1f1b", "tied", 2, 2, marks=pytest.mark.smoke),
    ("interleaved-1f1b", "plain", 2, 4),
    ("zero-bubble", "tied", 2, 4),
    ("1f1b", "tied", 4, 4),
    ("1f1b", "llama", 2, 2),
    ("interleaved-1f1b", "llama", 2, 4),
    ("zero-bubble", "llama", 2, 4),
])
def test_stages_train_as_one_device(dist, schedule, kind, world, stages):
    """The loss function is given the last stage's output: a transformers model's logits. A
    Llama's rotary embeddings, computed before the first layer, are used by every stage: with
    two stages per process they travel through the stages between."""
    rows, micro = 8, 4
    results = dist(world).run(_train, schedule, kind, rows, micro)
    _check(results, kind, rows, stages)


@pytest.mark.parametrize("schedule, kind, world", [pytest.param("1f1b", "tied", 4, marks=pytest.mark.smoke),
                                                   ("gpipe", "llama", 4)])
def test_stages_with_fsdp_inside_train_as_one_device(dist, schedule, kind, world):
    """('pipeline', 'fsdp') = (world / 2, 2): each stage's parameters split over its two
    processes, the batch's rows too; the gradients and parameters are compared whole. (Four
    stages are tested without 'fsdp' in test_stages_train_as_one_device, and all three axes
    at 8 processes below: 8 processes on the 2 cores CI has take a minute a run.)"""
    stages = world // 2
    rows, micro = 4 * stages, stages  # (1f1b: a micro-batch per stage at least; 4 rows each, 2 per process)
    results = dist(world).run(_train, schedule, kind, rows, micro, 2)
    _check(results, kind, rows, stages)
    for r in results:  # the model's own parameters freed; the stage's held once, split in two
        assert r["held"]["model"] == 0
        assert r["held"]["runner"] < r["sizes"][r["stages"][0]] * 0.75, r["held"]


@pytest.mark.parametrize("schedule, kind, world, fsdp", [("1f1b", "tied", 4, 1), ("gpipe", "plain", 4, 1),
                                                         ("1f1b", "llama", 4, 1), ("1f1b", "tied", 8, 2)])
def test_stages_with_the_model_axis_inside_train_as_one_device(dist, schedule, kind, world, fsdp):
    """('pipeline', 'fsdp', 'model') = (2, world / 4, 2): each stage's annotated weights split
    over 'model' (tensor parallel, DTensor), at 8 processes also over 'fsdp' (2 x 2 x 2)."""
    rows, micro = 4 * fsdp, 2
    results = dist(world).run(_train, schedule, kind, rows, micro, fsdp, fsdp > 1, 2)
    _check(results, kind, rows, 2, M.TP_EPS)
    for r in results:
        assert r["held"]["split"] > 0


def test_stages_traced_when_made_free_the_other_stages(dist):
    """With example_inputs, the stages are traced when the runner is made, and each process
    keeps only the parameters its stage uses (a tied embedding on both)."""
    results = dist(2).run(_train, "1f1b", "tied", 8, 4, 1, True)
    _check(results, "tied", 8, 2)
    for r in results:
        assert r["held"]["model"] == r["held"]["runner"] == r["sizes"][r["stages"][0]] < r["held"]["whole"]


def _error(fn, *args):
    try:
        fn(*args)
    except ts.SpmdError as e:
        return str(e)
    return None


def _errors():
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("pipeline",))
    out = {}
    out["rows"] = _error(lambda: ts.pipeline(M.build(), mesh, split=M.Layer, microbatches=5).step(
        *M.batches(8)[0], M.loss_fn))
    out["stages"] = _error(lambda: ts.pipeline(M.build(), mesh, split=["layers.0"], microbatches=4))
    out["schedule"] = _error(lambda: ts.pipeline(M.build(), mesh, split=M.Layer, microbatches=2, schedule="pipedream"))
    out["axis"] = _error(lambda: ts.pipeline(M.build(), ts.Mesh(np.arange(n), (n,), ("fsdp",)), split=M.Layer,
                                             microbatches=2))
    out["split"] = _error(lambda: ts.pipeline(M.build(), mesh, split=torch.nn.Conv1d, microbatches=2))
    out["few"] = _error(lambda: ts.pipeline(M.build(), mesh, split=M.Layer, microbatches=2))
    model = M.build()
    runner = ts.pipeline(model, mesh, split=M.Layer, microbatches=4)
    x, y = M.batches(4)[0]
    out["direct"] = _error(lambda: model(x))
    whole = torch.optim.SGD(model.parameters(), lr=0.1)
    runner.step(x, y, M.loss_fn)
    out["optimizer"] = _error(whole.step)
    out["shape"] = _error(lambda: runner.step(x[:, :5], y[:, :5], M.loss_fn))  # a second shape
    gpipe = ts.pipeline(M.build(), mesh, split=M.Layer, microbatches=4, schedule="gpipe", example_inputs=x)
    out["example"] = _error(lambda: gpipe.step(*M.batches(8)[0], M.loss_fn))  # not example_inputs' shape
    out["registered"] = _error(lambda: ts.pipeline(M.build_head_first(), mesh, split=M.Layer, microbatches=4).step(
        *M.batches(8)[0], M.loss_fn))
    out["mixing"] = _error(lambda: ts.pipeline(M.build_mixing(), mesh, split=M.Layer, microbatches=4).step(
        *M.batches(8)[0], M.loss_fn))
    two_d = ts.Mesh(np.arange(n), (2, n // 2), ("pipeline", "fsdp"))
    out["fsdp"] = _error(lambda: ts.pipeline(M.build(), two_d, split=M.Layer, microbatches=4))
    out["axes"] = _error(lambda: ts.pipeline(M.build(), ts.Mesh(np.arange(n), (2, n // 2), ("pipeline", "data")),
                                             split=M.Layer, microbatches=4))
    return out


def test_errors_name_the_argument_on_every_process(dist):
    got = same_on_every_rank(dist(4).run(_errors))
    assert "the batch's 8 rows do not split into microbatches=5" in got["rows"]
    assert "4 stages need at least 4 split points" in got["stages"]
    assert "pipeline(schedule='pipedream'): choose one of gpipe, 1f1b" in got["schedule"]
    assert "pipeline(axis='pipeline'): the mesh has no such axis" in got["axis"]
    assert "the model has no Conv1d module" in got["split"]
    assert "the 1f1b schedule needs at least one micro-batch per stage (4)" in got["few"]
    assert "run it through its runner" in got["direct"]
    assert "build the optimizer after torchspmd.pipeline(...), from runner.parameters()" in got["optimizer"]
    assert "with 'fsdp' inside the stages, give one batch's inputs" in got["fsdp"]
    assert "the mesh's axes ['data'] have more than one device" in got["axes"]
    assert "micro-batches of shape (1, 5) (training True), but the stages were traced for (1, 6) " \
           "(training True, at the first step)" in got["shape"]
    assert "micro-batches of shape (2, 6) (training True), but the stages were traced for (1, 6) " \
           "(training True, at example_inputs)" in got["example"]
    # a parameter the forward uses in a later stage than the modules it is registered with: the
    # same error on every process (not only the stage's, which left the others waiting)
    assert "the forward pass uses 'lm_head.weight' in stage 3, but it is registered with the modules of " \
           "another stage" in got["registered"]
    # a layer mixing the batch's rows: named, with the operator (the stages would compute it per micro-batch)
    assert "the stages compute each micro-batch of 2 rows on its own" in got["mixing"]
    assert "torch.ops.aten.mean.dim in module 'layers.2' (BatchCentred) reduces over dim 0" in got["mixing"]


# -- checkpoints: saved by the stages, loaded split another way or unsplit ---------------------
def _resume_run(kind, fsdp, load_from, save_to):
    """Train the tied model: 2 steps then save to ``save_to``, or load ``load_from`` (saved
    after 2 steps) then the 3rd step. ``kind``: 'pipeline' (stages over n // fsdp processes,
    'fsdp' inside) or 'fsdpv2' (FSDPv2 over every process). The 3rd step's loss and the
    final parameters, whole."""
    from torchspmd import checkpoint

    n = ts.global_runtime_device_count()
    model = M.build(True)
    if kind == "pipeline":
        mesh = ts.Mesh(np.arange(n), (n // fsdp, fsdp), ("pipeline", "fsdp"))
        example = M.batches(8)[0][0] if fsdp > 1 else None
        runner = ts.pipeline(model, mesh, split=M.Layer, microbatches=4, example_inputs=example)
        target, params = runner, runner.named_parameters
    else:
        mesh = ts.Mesh(np.arange(n), (n,), ("fsdp",))
        target = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=functools.partial(
            ts.transformer_auto_wrap_policy, transformer_layer_cls={M.Layer}))
        params = target.named_parameters
    opt = torch.optim.AdamW(target.parameters(), lr=M.LR)
    steps = M.batches(8)
    if load_from:
        checkpoint.load(load_from, target, opt)
        steps = steps[2:]
    else:
        steps = steps[:2]
    losses = []
    for x, y in steps:
        if kind == "pipeline":
            losses.append(runner.step(x, y, M.loss_fn).item())
            runner.clip_grad_norm_(M.MAX_NORM)
        else:
            spec = ts.ShardingSpec(mesh, ("fsdp", None))
            loss = M.loss_fn(target(ts.shard_batch(x, spec)), ts.shard_batch(y, spec))
            loss.backward()
            ts.clip_grad_norm_(target, M.MAX_NORM)
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    if save_to:
        return str(checkpoint.save(save_to, 2, target, opt, {}, ""))
    return dict(losses=losses, final={k: _full(p.detach()).clone() for k, p in params()})


def _check_resumed(results):
    ref_losses, _, ref_final, _ = _oracle("tied", 8)
    held = set()
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses[2:], rtol=RTOL, atol=ATOL)
        for k, p in r["final"].items():
            torch.testing.assert_close(p, ref_final[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
        held |= set(r["final"])
    assert held == set(ref_final)


def test_a_checkpoint_of_the_stages_resumes_split_otherwise_or_unsplit(dist, tmp_path):
    """Saved by 2 stages after 2 steps; resumed on 4 stages, on 2 stages x 'fsdp' 2, and by
    FSDPv2 unsplit; and one saved by FSDPv2, resumed on 2 stages: the 3rd step is the
    uninterrupted one-device run's (optimizer state included)."""
    saved = dist(2).run(_resume_run, "pipeline", 1, None, str(tmp_path / "pp2"))[0]
    _check_resumed(dist(4).run(_resume_run, "pipeline", 1, saved, None))
    _check_resumed(dist(4).run(_resume_run, "pipeline", 2, saved, None))
    _check_resumed(dist(2).run(_resume_run, "fsdpv2", 1, saved, None))
    unsplit = dist(2).run(_resume_run, "fsdpv2", 1, None, str(tmp_path / "fsdp"))[0]
    _check_resumed(dist(2).run(_resume_run, "pipeline", 1, unsplit, None))


def _explained(schedule):
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("pipeline",))
    runner = ts.pipeline(M.build(True), mesh, split=M.Layer, microbatches=4, schedule=schedule)
    runner.step(*M.batches(8)[0], M.loss_fn)
    return runner.explain()


def test_explain_shows_the_stages_the_schedule_and_the_sends(dist):
    text = same_on_every_rank(dist(2).run(_explained, "1f1b"))
    assert "2 process positions, 2 stages, schedule 1f1b, 4 micro-batches per step" in text
    assert "stage 0 on process(es) [0]: embed, pos, layers.0 .. layers.1 (2 layers)" in text
    assert "stage 1 on process(es) [1]: layers.2 .. layers.4 (3 layers), norm, lm_head" in text
    # 1F1B: the first stage runs one forward ahead (2 stages), then alternates; the last alternates
    assert "position 0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3" in text
    assert "position 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3" in text
    rows = 8 // 4
    assert (f"4 activation sends forward and as many gradient sends backward; per micro-batch 0->1: "
            f"{rows}x{M.SEQ}x{M.DIM} ({rows * M.SEQ * M.DIM * 4:,} bytes)") in text
    zb = same_on_every_rank(dist(2).run(_explained, "zero-bubble"))
    assert "4 stages" in zb and "W0.0" in zb and "3 stage boundaries x 4 micro-batches = 12" in zb


def _with_dropout():
    M.Layer.DROPOUT = 0.5
    try:
        n = ts.global_runtime_device_count()
        torch.manual_seed(3)
        runner = ts.pipeline(M.build(), ts.Mesh(np.arange(n), (n,), ("pipeline",)), split=M.Layer, microbatches=2)
        losses = [runner.step(x, y, M.loss_fn).item() for x, y in M.batches(4)]
        return losses, torch.rand(3).tolist()
    finally:
        M.Layer.DROPOUT = 0.0


def test_dropout_draws_a_stream_of_its_own_and_leaves_the_programs_random_state_one(dist):
    """With dropout the stages draw masks from a stream of their own: the program's random
    state after the steps is the same on every process (it draws the same next batch), and a
    seeded program gets the same losses run after run; without dropout (every other test
    here) the losses are one device's."""
    first, second = dist(2).run(_with_dropout), dist(2).run(_with_dropout)
    assert first[0] == first[1] and first == second
    no_dropout = run_clean(M.oracle, "plain", 4)[0]
    assert first[0][0][0] != pytest.approx(no_dropout[0], rel=1e-3)  # the masks dropped something (same model)


def test_the_stages_hold_what_is_registered_around_layers_without_parameters():
    """The modules registered after the last layer go with the last stage even when no layer
    holds a parameter (a parameter's place among the layers' is no guide then: the head went
    to the first stage, and the traced step refused it; found by tests/test_fuzz.py)."""
    from torchspmd.engines.native.wrappers.pipeline_plan import plan_stages

    model = torch.nn.Sequential()
    model.add_module("fc_in", torch.nn.Linear(5, 6))
    model.add_module("layers", torch.nn.ModuleList([torch.nn.GELU(), torch.nn.Tanh(), torch.nn.ReLU()]))
    model.add_module("fc_out", torch.nn.Linear(6, 3))
    plan = plan_stages(model, 2, ["layers.0", "layers.1", "layers.2"])
    assert plan.params == (("fc_in.weight", "fc_in.bias"), ("fc_out.weight", "fc_out.bias"))
