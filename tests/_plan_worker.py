"""Measure the peak memory of FSDPv2 training steps on this process (run once per device
by ``torchspmd run``); rank 0 writes the peak RSS growth over the state before the model
was built. Used by test_plan.py to check ``torchspmd plan``'s prediction."""

import json
import resource
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(config_dir: str, batch: int, seq: int, dtype: str, steps: int, out: str, grad_accum: int = 1) -> None:
    import functools

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import torchspmd as ts

    ts.use_spmd()
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(list(range(n)), (n, 1), ("fsdp", "model"))
    config = AutoConfig.from_pretrained(config_dir)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, vocab, (batch * steps, seq), generator=g))
    loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=batch // grad_accum), ts.device(),
                               input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
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


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6],
         *(int(a) for a in sys.argv[7:8]))
