"""Pattern 3: FSDPv2 with gradient checkpointing, applied BEFORE the wrapper.

    CPU_NUM_DEVICES=2 python examples/fsdp_v2_checkpointing.py

Two equivalent forms (not mixed in one model, as in torch_xla): checkpoint each layer
and wrap it yourself, ``FSDPv2(checkpoint_module(layer), mesh=mesh)`` (``--by-hand``), or
let the auto-wrap policy do it for every layer with ``auto_wrapper_callable``.
"""

import argparse
import functools

import numpy as np
import torch
import torch.nn as nn

import torchspmd as ts
from torchspmd.models import DecoderLayer, DecoderModel

ts.use_spmd()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--by-hand", action="store_true", help="wrap each checkpointed layer by hand")
    args = p.parse_args()
    torch.manual_seed(0)
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    vocab, seq, batch = 512, 32, 8

    model = DecoderModel(vocab_size=vocab, dim=args.dim, num_layers=4, num_heads=4, intermediate_size=4 * args.dim,
                         max_seq_len=seq)
    if args.by_hand:
        # Form 1: by hand, innermost first; checkpoint_module goes BEFORE FSDPv2.
        for i, layer in enumerate(model.layers):
            model.layers[i] = ts.FSDPv2(ts.checkpoint_module(layer), mesh=mesh)
        model = ts.FSDPv2(model, mesh=mesh)
    else:
        # Form 2: the auto-wrap policy wraps each layer through auto_wrapper_callable.
        policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
        model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=policy,
                          auto_wrapper_callable=lambda m, *a, **k: ts.FSDPv2(ts.checkpoint_module(m), *a, **k))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        tokens = (start + torch.arange(seq + 1)) % vocab
        x = ts.mark_sharding(tokens[:, :-1].contiguous(), mesh, ("fsdp", None))
        y = ts.mark_sharding(tokens[:, 1:].contiguous(), mesh, ("fsdp", None))
        with ts.step():
            out = model(x)
            loss = loss_fn(out.view(-1, vocab), y.view(-1))
            loss.backward()
            ts.clip_grad_norm_(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
        print(f"Step {step}, Loss: {loss.item():.4f}")


if __name__ == "__main__":
    main()
