"""A differential fuzzer's programs: small models drawn from a grammar of layers and ops,
each trained a few steps with SGD on one plain process (the oracle; this module never
imports torchspmd at import time) and sharded, and compared.

A program is ``Linear(5, 6)``, then 2 to 4 ops from ``OPS`` on the ``(batch, 6)`` activation
(row-local ones, ones that mix the batch's rows, views and permutes, residuals, a tied weight),
then ``Linear(6, 3)`` and a mean squared error. Values come from a normal distribution, so
the orders and extrema ops take have no ties; ops whose outputs could grow are followed by a
``tanh``. No dropout: one device's masks cannot be matched by a sharded run."""

from __future__ import annotations

import functools
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

W = 6
STEPS = 2
RTOL, ATOL = 1e-5, 1e-6


def _in_batch_attention(h):
    scores = torch.softmax(h @ h.T / 2, dim=-1)  # every row attends to every row of the batch
    return scores @ h


def _kth(h):
    k = 1 if h.shape[0] < 2 else 2
    return h - h.kthvalue(k, dim=0, keepdim=True).values


def _gather_argmax(h):
    idx = h.argmax(0, keepdim=True)
    return h - h.gather(0, idx)


def _index_select_sorted(h):
    return torch.tanh(h + h.index_select(0, h[:, 0].argsort()))


def _gather_argmin(h):
    return h - h.gather(0, h.argmin(0, keepdim=True))


def _index_add(h):
    # rows added into the places of their order: a permutation through index_add
    return torch.zeros_like(h).index_add(0, h[:, 0].argsort(), h) + h


def _scatter_add(h):
    order = h[:, 1].argsort()[:, None].expand(-1, h.shape[1])
    return torch.zeros_like(h).scatter_add(0, order, h) - h


def _masked_select(h):
    return h * torch.tanh(h.masked_select(h > 0).sum() / 8)


def _nonzero(h):
    picked = h[(h[:, 0] > 0).nonzero().squeeze(1)]
    return h + torch.tanh(picked.sum(0, keepdim=True))


def _unique(h):
    kinds = torch.unique((h[:, :2] > 0).long().sum(1))
    return h * (1 + kinds.numel() / 4)


def _heads(h):
    # a (batch, 2, 3) view: a softmax over the last dim, a mean over the heads, back
    v = h.view(h.shape[0], 2, 3)
    return (torch.softmax(v, -1) * v.mean(1, keepdim=True)).reshape(h.shape[0], -1)


def _transposed(h):
    # the batch moved off dim 0 and back: row-local
    return torch.tanh(h.t().contiguous() * 1.5).t()


def _permuted_mix(h):
    # mixing over the batch through a transpose: (features, batch) reduced over the batch
    return h - h.t().amax(1)[None, :]


#: name -> (kind, function of the activation, or a module factory)
OPS = {
    # row-local
    "relu": ("local", torch.relu),
    "tanh": ("local", torch.tanh),
    "gelu": ("local", F.gelu),
    "softmax-1": ("local", lambda h: torch.softmax(h, -1) * W),
    "log-softmax-1": ("local", lambda h: torch.log_softmax(h, -1)),
    "amax-1": ("local", lambda h: h * torch.sigmoid(h.amax(1, keepdim=True))),
    "sort-1": ("local", lambda h: h.sort(1).values),
    "cumsum-1": ("local", lambda h: torch.tanh(h.cumsum(1))),
    "heads": ("local", _heads),
    "transposed": ("local", _transposed),
    "layernorm": ("local", lambda: nn.LayerNorm(W)),
    "linear": ("local", lambda: nn.Linear(W, W)),
    "residual": ("local", "residual"),
    "tied": ("local", "tied"),
    # mixing the batch's rows
    "amax-0": ("mix", lambda h: h + h.amax(0, keepdim=True)),
    "amin-0": ("mix", lambda h: h - h.amin(0, keepdim=True)),
    "abs-amax": ("mix", lambda h: h / h.abs().amax()),
    "clamp-max": ("mix", lambda h: torch.clamp(h, max=h.max() * 0.5)),
    "topk-0": ("mix", lambda h: h - h.topk(min(2, h.shape[0]), dim=0).values.mean(0, keepdim=True)),
    "median-0": ("mix", lambda h: h - h.median(dim=0, keepdim=True).values),
    "kthvalue-0": ("mix", _kth),
    "sort-0": ("mix", lambda h: h + h.sort(0).values),
    "argsort-0": ("mix", lambda h: h * (1 + h[:, 0].argsort().float()[:, None] / h.shape[0])),
    "argmax-gather": ("mix", _gather_argmax),
    "index-select": ("mix", _index_select_sorted),
    "argmin-gather": ("mix", _gather_argmin),
    "max-0-indices": ("mix", lambda h: h - torch.max(h, 0).values + torch.min(h, 0).indices.float()[None, :] / 8),
    "mode-0": ("mix", lambda h: h - h.mode(0).values),
    "cumprod-0": ("mix", lambda h: torch.tanh(torch.cumprod(1 + 0.1 * torch.tanh(h), 0))),
    "index-add": ("mix", _index_add),
    "scatter-add": ("mix", _scatter_add),
    "masked-select": ("mix", _masked_select),
    "nonzero": ("mix", _nonzero),
    "unique": ("mix", _unique),
    "softmax-0": ("mix", lambda h: torch.softmax(h, dim=0) * h.shape[0]),
    "cummax-0": ("mix", lambda h: torch.cummax(h, dim=0).values),
    "cummin-0": ("mix", lambda h: torch.cummin(h, dim=0).values),
    "cumsum-0": ("mix", lambda h: torch.tanh(h.cumsum(0))),
    "logcumsumexp-0": ("mix", lambda h: torch.tanh(torch.logcumsumexp(h, 0))),
    "flip-0": ("mix", lambda h: h + h.flip(0)),
    "roll-0": ("mix", lambda h: h + h.roll(1, 0)),
    "mean-0": ("mix", lambda h: h - h.mean(0, keepdim=True)),
    "var-0": ("mix", lambda h: h / (1 + h.var(0, keepdim=True))),
    "batchnorm": ("mix", lambda: nn.BatchNorm1d(W)),
    "in-batch-attention": ("mix", _in_batch_attention),
    "permuted-mix": ("mix", _permuted_mix),
    "batch-size": ("mix", lambda h: h * h.shape[0] / 8),
    "arange": ("mix", lambda h: h + torch.arange(h.shape[0], dtype=h.dtype)[:, None] / 8),
}


def draw(seed: int) -> list[str]:
    """A program: 2 to 4 op names, at least one mixing the batch's rows in half of them."""
    r = random.Random(seed)
    names = sorted(OPS)
    ops = [r.choice(names) for _ in range(r.randint(2, 4))]
    if seed % 2 and all(OPS[o][0] == "local" for o in ops):
        ops[r.randrange(len(ops))] = r.choice([n for n in names if OPS[n][0] == "mix"])
    return ops


class Op(nn.Module):
    """One drawn op, a module of its own (the automatic path decides per module, FSDPv2's
    nested policy wraps each op as a unit, pipeline stages are cut between ops)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        fn = OPS[name][1]
        if name in ("residual", "tied"):
            self.layer = nn.Linear(W, W)
        elif getattr(getattr(fn, "__code__", None), "co_argcount", 1) == 0:
            self.layer = fn()
        else:
            self.layer = None

    def forward(self, h):
        if self.name == "residual":
            return h + torch.tanh(self.layer(h))
        if self.name == "tied":  # the same weight twice, once transposed
            return torch.tanh(F.linear(torch.tanh(self.layer(h)), self.layer.weight.t()))
        if self.layer is not None:
            return self.layer(h)
        return OPS[self.name][1](h)


class Program(nn.Module):
    def __init__(self, ops: list[str]):
        super().__init__()
        self.ops = ops
        self.fc_in = nn.Linear(5, W)  # (registered in the order the forward uses them: pipeline
        self.layers = nn.ModuleList([Op(name) for name in ops])  # stages hold what is
        self.fc_out = nn.Linear(W, 3)  # registered before the first op in the first stage)

    def forward(self, x):
        h = self.fc_in(x)
        for op in self.layers:
            h = op(h)
        return self.fc_out(h)


def batches(seed: int, rows: int):
    g = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(STEPS)]


def train(seed: int, rows: int, strategy: str = "plain", dtype=torch.float32):
    """(losses, gradients of the last step, final state) of program ``seed`` (drawn in fp32,
    then computed in ``dtype``)."""
    torch.manual_seed(seed)
    model = Program(draw(seed)).to(dtype)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(seed, rows)]
    if strategy != "plain":
        import torchspmd as ts

        n = ts.global_runtime_device_count()
        if strategy == "pattern1-2d":  # ('data', 'model'): the outer weights split over 'model'
            mesh = ts.Mesh(np.arange(n), (n // 2, 2), ("data", "model"))
            ts.mark_sharding(model.fc_in.weight, mesh, ("model", None))
            ts.mark_sharding(model.fc_out.weight, mesh, (None, "model"))
            axis = "data"
        elif strategy == "fsdpv2-2d":  # ('fsdp', 'model'): both outer weights column-parallel
            # over 'model' (fc_out's 3 outputs unevenly); no pair, so each output is gathered
            mesh = ts.Mesh(np.arange(n), (n // 2, 2), ("fsdp", "model"))
            ts.mark_sharding(model.fc_in.weight, mesh, ("model", None))
            ts.mark_sharding(model.fc_out.weight, mesh, ("model", None))
            axis = "fsdp"
        elif strategy == "fsdpv2-2d-paired":  # fc_in column-, fc_out row-parallel: a pair, the
            # activation between them kept split over 'model' (each process its features)
            mesh = ts.Mesh(np.arange(n), (n // 2, 2), ("fsdp", "model"))
            ts.mark_sharding(model.fc_in.weight, mesh, ("model", None))
            ts.mark_sharding(model.fc_out.weight, mesh, (None, "model"))
            axis = "fsdp"
        elif strategy.startswith("fsdpv2"):
            mesh = ts.Mesh(np.arange(n), (n,), ("fsdp",))
            axis = "fsdp"
        else:
            mesh = ts.Mesh(np.arange(n), (n,), ("data",))
            axis = "data"
        if strategy.startswith("fsdpv2"):
            # "fsdpv2-nested": each op a unit of its own inside the root unit
            policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={Op}) \
                if strategy == "fsdpv2-nested" else None
            model = ts.FSDPv2(model, mesh, auto_wrap_policy=policy)
        data = list(ts.MpDeviceLoader(data, ts.device(), input_sharding=ts.ShardingSpec(mesh, (axis, None))))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], {}
    for x, y in data:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = {k: _whole(p.grad).clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    state = {k: _whole(v).detach().clone() for k, v in model.state_dict().items()}  # (BatchNorm's statistics too)
    return losses, grads, state


def train_all(seeds: list[int], rows: int, strategy: str = "plain", dtype=torch.float32) -> dict:
    """Every program's result, or the error it raised (as text)."""
    out = {}
    for seed in seeds:
        try:
            out[seed] = train(seed, rows, strategy, dtype)
        except Exception as e:  # noqa: BLE001 - reported as the program's result, compared with the oracle's
            out[seed] = f"{type(e).__name__}: {e}"
    return out


def train_stages(seeds: list[int], rows: int, microbatches: int = 2) -> dict:
    """Each program as pipeline stages, one per process of a ``('pipeline',)`` mesh, cut
    between its ops (``1f1b``, ``microbatches`` micro-batches): this process's losses, and the
    gradients and final values of the parameters its stages hold (the caller joins the
    processes'), or the error it raised (as text)."""
    out = {}
    for seed in seeds:
        try:
            out[seed] = _train_stages(seed, rows, microbatches)
        except Exception as e:  # noqa: BLE001 - reported as the program's result
            out[seed] = f"{type(e).__name__}: {e}"
    return out


def _train_stages(seed: int, rows: int, microbatches: int):
    import torchspmd as ts

    torch.manual_seed(seed)
    model = Program(draw(seed))
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n,), ("pipeline",))
    runner = ts.pipeline(model, mesh, split=Op, microbatches=microbatches, schedule="1f1b")
    opt = torch.optim.SGD(runner.parameters(), lr=0.05)
    losses, grads = [], {}
    for x, y in batches(seed, rows):
        losses.append(runner.step(x, y, F.mse_loss).item())
        grads = {k: p.grad.clone() for k, p in runner.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: p.detach().clone() for k, p in runner.named_parameters()}


def join_stages(results: list) -> dict:
    """The processes' ``train_stages`` results as one: every process's losses (they must agree),
    each parameter from the process that holds it."""
    out = {}
    for seed, first in results[0].items():
        if any(isinstance(r[seed], str) for r in results):
            out[seed] = next(r[seed] for r in results if isinstance(r[seed], str))
            continue
        if any(r[seed][0] != first[0] for r in results):
            out[seed] = f"the processes' losses differ: {[r[seed][0] for r in results]}"
            continue
        grads, state = {}, {}
        for r in results:
            grads.update(r[seed][1])
            state.update(r[seed][2])
        out[seed] = (first[0], grads, state)
    return out


def oracle(seeds: list[int], rows: int) -> dict:
    """One device's results in fp32 and in fp64 (the fp32 run's own rounding error, which sets
    each program's tolerance: some programs are ill-conditioned, e.g. a batch norm over 5 rows
    after an attention over the batch)."""
    return {"fp32": train_all(seeds, rows), "fp64": train_all(seeds, rows, dtype=torch.float64)}


def differences(ref: dict, got: dict) -> list[str]:
    """What differs between one device's results (``oracle``) and a sharded run's, program by
    program. A value may differ from one device's fp32 value by ``ATOL + RTOL * |value|`` plus
    4 times the tensor's own rounding error (its largest distance from the fp64 run's)."""
    found = []
    for seed, want in ref["fp32"].items():
        exact = ref["fp64"][seed]
        have = got[seed]
        where = f"program {seed} {draw(seed)}"
        if isinstance(want, str) or isinstance(have, str):
            if isinstance(want, str) != isinstance(have, str):
                found.append(f"{where}: one device gave {want if isinstance(want, str) else 'a result'}, "
                             f"sharded {have if isinstance(have, str) else 'a result'}")
            continue
        for part, a, a64, b in zip(("losses", "gradients", "state"), want, exact, have):
            if part == "losses":
                a, a64, b = ({str(i): torch.tensor(v) for i, v in enumerate(x)} for x in (a, a64, b))
            if a.keys() != b.keys():
                found.append(f"{where}: {part} keys differ")
                continue
            for k in a:
                if not a[k].is_floating_point():
                    if not torch.equal(a[k], b[k]):
                        found.append(f"{where}: {part} {k} differs")
                    continue
                own = (a[k].double() - a64[k].double()).abs()
                allowed = ATOL + RTOL * a[k].double().abs() + 4 * own.max()
                err = (b[k].double() - a[k].double()).abs()
                if not bool((err <= allowed).all()) or bool(b[k].isnan().any()) != bool(a[k].isnan().any()):
                    found.append(f"{where}: {part} {k} off by {err.max().item():.2e} "
                                 f"(one device's own rounding error {own.max().item():.2e})")
                    break
    return found


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- bugs planted in torchspmd, to show the fuzzer's seeds catch them (tests/test_fuzz.py) --

def _plant(bug: str):
    """Plant ``bug`` in this process's torchspmd; returns what takes it out again."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial

    from torchspmd.engines.native.communication import gradient_sums
    from torchspmd.engines.native.global_view import row_locality
    from torchspmd.engines.native.wrappers import data_parallel

    if bug == "proof-says-local":  # the automatic path takes every checked module as row-local
        proof, stop = row_locality.batch_size_proof, data_parallel._Redistributions.stop

        def blind_stop(self):
            stop(self)
            self.count = 0

        row_locality.batch_size_proof = lambda *a, **k: None
        data_parallel._Redistributions.stop = blind_stop

        def undo():
            row_locality.batch_size_proof = proof
            data_parallel._Redistributions.stop = stop
        return undo
    if bug == "per-process-mean-loss":  # the global loss as the mean of each process's mean
        table = DTensor._op_dispatcher._custom_op_handlers
        op = torch.ops.aten.mse_loss.default
        exact = table[op]

        def per_process_mean(op, args, kwargs):
            x, y = args[0], args[1]
            with torch.no_grad():
                local = op(x.to_local(), y.redistribute(x.device_mesh, x.placements).to_local(), *args[2:])
                return DTensor.from_local(local / dist.get_world_size(), x.device_mesh,
                                          [Partial()] * x.device_mesh.ndim, run_check=False)

        table[op] = per_process_mean

        def undo():
            table[op] = exact
        return undo
    if bug == "dropped-gradient-sum":  # the local path's gradients left unreduced
        register = gradient_sums.register

        def unreduced(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        gradient_sums.register = lambda ddp, group, params: ddp.register_comm_hook(None, unreduced) or "planted"

        def undo():
            gradient_sums.register = register
        return undo
    if bug == "unit-proof-says-local":  # FSDPv2 computes every model on this process's rows
        from torchspmd.engines.native.global_view import unit_rows

        decide = unit_rows.RowPaths.local
        unit_rows.RowPaths.local = lambda self, *a, **k: True

        def undo():
            unit_rows.RowPaths.local = decide
        return undo
    if bug == "whole-batch-gradient-n-times":  # FSDPv2's global view: every process's gradient
        from torchspmd.engines.native.global_view import unit_rows  # counted as the whole batch's (n times)

        convert = unit_rows.outputs_from_whole

        def n_times(output, layout, data_dims, who):
            n = layout.device_mesh.size()
            scaled = output * n - output.detach() * (n - 1)  # (the same values, n times the gradient)
            return convert(scaled, layout, data_dims, who)

        unit_rows.outputs_from_whole = n_times

        def undo():
            unit_rows.outputs_from_whole = convert
        return undo
    raise ValueError(bug)


#: the strategy each planted bug is in
PLANTED_IN = {"proof-says-local": "pattern1", "per-process-mean-loss": "pattern1",
              "dropped-gradient-sum": "pattern1", "unit-proof-says-local": "fsdpv2",
              "whole-batch-gradient-n-times": "fsdpv2"}


def planted(bug: str, seeds: list[int], rows: int) -> dict:
    """``train_all`` on the strategy ``bug`` is in, with ``bug`` planted (and taken out after)."""
    undo = _plant(bug)
    try:
        return train_all(seeds, rows, PLANTED_IN[bug])
    finally:
        undo()
