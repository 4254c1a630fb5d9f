"""Measure the peak memory of FSDPv2 training steps on this process (run once per device
by ``torchspmd run``); rank 0 writes the peak RSS growth over the state before the model
was built. Used by test_plan.py to check ``torchspmd plan``'s prediction.

``_plan_worker.py CONFIG BATCH SEQ DTYPE STEPS OUT [GRAD_ACCUM [CONTEXT]]``: FSDPv2, each
sequence split over a 'context' axis of CONTEXT processes when it is over 1.

``_plan_worker.py stages CONFIG BATCH SEQ STEPS OUT FSDP MICROBATCHES SCHEDULE``: the same
for pipeline stages (:func:`stages`), the largest growth over the processes."""

import json
import resource
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(config_dir: str, batch: int, seq: int, dtype: str, steps: int, out: str, grad_accum: int = 1,
         context: int = 1) -> None:
    import functools

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import torchspmd as ts

    ts.use_spmd()
    n = ts.global_runtime_device_count()
    # context > 1: each sequence split over a 'context' axis of that size (FSDPv2 shards over both)
    mesh = (ts.Mesh(list(range(n)), (n // context, context), ("fsdp", "context")) if context > 1 else
            ts.Mesh(list(range(n)), (n, 1), ("fsdp", "model")))
    config = AutoConfig.from_pretrained(config_dir)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, vocab, (batch * steps, seq), generator=g))
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=batch // grad_accum), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", "context" if context > 1 else None)))
    batches = list(loader)
    base = rss_bytes()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layer = type(model.model.layers[0])
    policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={layer})
    model = ts.FSDPv2(model, mesh, auto_wrap_policy=policy, mixed_precision="bf16" if dtype == "bf16" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i, (x,) in enumerate(batches):  # grad_accum micro-batches per step
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x.reshape(-1)) / grad_accum
        loss.backward()
        if (i + 1) % grad_accum == 0:
            opt.step()
            opt.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if ts.global_ordinal() == 0:
        with open(out, "w") as f:
            json.dump({"peak_growth": peak - base, "base": base}, f)


def _hwm_bytes() -> int:
    """The peak RSS since the process began or since :func:`_reset_hwm` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    """Linux: the peak RSS (VmHWM) restarts from the RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _load_the_tracers_code(config) -> None:
    """Trace a two-layer copy of the model's architecture, 16 wide, with torch's pipeline
    tracer: the first trace imports torch.export's modules (some 400, about 50 MB of Python
    code and objects), which stay imported. That is code on the host, as torch's own imports
    before the base are, not a device's memory; what the trace of the real model leaves is
    still measured (its size grows with the model, this one's does not)."""
    import copy

    import torch
    import torch.distributed.pipelining as pipelining
    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    small.hidden_size, small.intermediate_size, small.num_hidden_layers, small.vocab_size = 16, 24, 2, 37
    small.num_attention_heads = small.num_key_value_heads = 2
    small.head_dim = 8
    model = AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    pipelining.pipeline(model, mb_args=(torch.zeros(2, 8, dtype=torch.long),),
                        split_spec={"model.layers.1": pipelining.SplitPoint.BEGINNING})


def stages(config_dir: str, batch: int, seq: int, steps: int, out: str, fsdp: int, microbatches: int,
           schedule: str) -> None:
    """Pipeline stages (``ts.pipeline``, 'pipeline' x 'fsdp' x 'model' 1), fp32, AdamW: each
    process's peak RSS over the training steps (the peak reset after the runner and the
    optimizer are made) above its RSS before the model was built. The whole-model build
    before the split is the host's, not a device's: it is not in the peak, but whatever of it
    the runner keeps alive is (it is in the RSS the steps start from). Rank 0 writes every
    rank's growth. Before the base, torch's pipeline tracer runs once on a tiny model
    (:func:`_load_the_tracers_code`)."""
    import gc

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining  # noqa: F401  (the library's code, imported before the base)
    from transformers import AutoConfig, AutoModelForCausalLM

    import torchspmd as ts

    ts.use_spmd()
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n // fsdp, fsdp, 1), ("pipeline", "fsdp", "model"))
    config = AutoConfig.from_pretrained(config_dir)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    _load_the_tracers_code(config)
    gc.collect()
    base = rss_bytes()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    built = rss_bytes()
    layer = type(model.model.layers[0])
    runner = ts.pipeline(model, mesh, split=layer, microbatches=microbatches, schedule=schedule,
                         example_inputs=batches[0])
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)
    gc.collect()
    start = rss_bytes()
    _reset_hwm()
    for x in batches:
        runner.step(x, x, loss_fn)
        opt.step()
        opt.zero_grad()
    mine = {"peak_growth": _hwm_bytes() - base, "base": base, "built": built - base, "start": start - base,
            "stages": runner.describe()["this process's stages"],
            "params": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in runner.parameters())}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if ts.global_ordinal() == 0:
        with open(out, "w") as f:
            json.dump({"peak_growth": max(r["peak_growth"] for r in everyone), "ranks": everyone}, f)


if __name__ == "__main__":
    if sys.argv[1] == "stages":  # stages CONFIG BATCH SEQ STEPS OUT FSDP MICROBATCHES SCHEDULE
        stages(sys.argv[2], *(int(a) for a in sys.argv[3:6]), sys.argv[6], int(sys.argv[7]), int(sys.argv[8]),
               sys.argv[9])
        sys.exit(0)
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6],
         *(int(a) for a in sys.argv[7:9]))
