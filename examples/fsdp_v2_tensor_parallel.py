"""Pattern 2 in 2D: FSDPv2 over 'fsdp' x tensor parallelism over 'model', torch_xla's recipe.

    CPU_NUM_DEVICES=4 python examples/fsdp_v2_tensor_parallel.py                   # a (2, 2) mesh
    CPU_NUM_DEVICES=4 python examples/fsdp_v2_tensor_parallel.py --model-axis 4    # a (1, 4) mesh
    CPU_NUM_DEVICES=4 python examples/fsdp_v2_tensor_parallel.py --dim 128 --layers 2 --explain

The weights are annotated in place, before the wrapper and the optimizer, as in torch_xla:
the attention's packed q/k/v projection over 'model' on dim 0 (split by heads) and its
output projection on dim 1; each MLP a column-parallel up-projection ('model', 'fsdp')
followed by a row-parallel down-projection ('fsdp', 'model'); the embedding and the LM
head split over the vocabulary. FSDPv2 computes those tensor-parallel over 'model' and
shards everything over 'fsdp' too, so each process stores 1/(fsdp x model) of them; the
norms are FSDP's alone.
"""

import argparse
import functools
from fractions import Fraction

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import torchspmd as ts
from torchspmd.models import DecoderLayer, DecoderModel

ts.use_spmd()


def synthetic_tokens(n: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    """Learnable sequences: each one counts up from a random start by a random stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-axis", type=int, default=2, help="devices on the 'model' (tensor-parallel) axis")
    p.add_argument("--vocab", type=int, default=3200)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="global batch size")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--log-every", type=int, default=10, help="print the loss every this many steps")
    p.add_argument("--explain", action="store_true", help="print every parameter's layout after the first step")
    args = p.parse_args()

    torch.manual_seed(0)
    n = ts.global_runtime_device_count()
    model_axis = args.model_axis
    if model_axis < 1 or n % model_axis:
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise ts.SpmdError(f"--model-axis {model_axis} does not divide the {n} device(s) of the "
                           f"('fsdp', 'model') mesh; choose one of {divisors}")
    mesh = ts.Mesh(np.arange(n), (n // model_axis, model_axis), ("fsdp", "model"))
    ts.set_global_mesh(mesh)
    model = DecoderModel(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                         intermediate_size=args.intermediate, max_seq_len=args.seq)

    # The torch_xla way: annotate in place (the result unused), before FSDPv2 and the optimizer.
    for layer in model.layers:
        ts.mark_sharding(layer.attn.in_proj_weight, mesh, ("model", None))  # attention split by heads
        ts.mark_sharding(layer.attn.out_proj.weight, mesh, (None, "model"))
        ts.mark_sharding(layer.up.weight, mesh, ("model", "fsdp"))  # column-parallel
        ts.mark_sharding(layer.down.weight, mesh, ("fsdp", "model"))  # row-parallel
    ts.mark_sharding(model.embed.weight, mesh, ("model", None))  # vocabulary split
    ts.mark_sharding(model.lm_head.weight, mesh, ("model", None))  # vocabulary split, output gathered

    auto_wrap_policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
    model = ts.FSDPv2(model, mesh=mesh, auto_wrap_policy=auto_wrap_policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = synthetic_tokens(args.batch * args.steps, args.seq, args.vocab)
    train_loader = ts.MpDeviceLoader(DataLoader(data, batch_size=args.batch, shuffle=True), ts.device(),
                                     input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    loss_fn = nn.CrossEntropyLoss()
    total = sum(p.numel() for p in model.parameters())  # a DTensor's numel() is its global one
    print(f"{n} device(s), mesh (fsdp={n // model_axis}, model={model_axis}), {total / 1e6:.1f}M parameters")
    for step, (data, target) in enumerate(train_loader):
        with ts.step():
            output = model(data)  # the global logits
            loss = loss_fn(output.view(-1, output.size(-1)), target.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if step == 0:
            up = dict(model.named_parameters())["layers.0.up.weight"]
            local = up.to_local().numel()
            print(f"layers.0.up.weight {tuple(up.shape)}: {local} of {up.numel()} elements on this process "
                  f"({Fraction(local, up.numel())}; fsdp x model = {n // model_axis} x {model_axis})")
            if args.explain:
                ts.explain(model)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"Step {step}, Loss: {loss.item():.4f}")


if __name__ == "__main__":
    main()
