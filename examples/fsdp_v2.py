"""Pattern 2: FSDPv2, the PyTorch/XLA full example ported by changing the imports.

    python examples/fsdp_v2.py                        # every local device
    CPU_NUM_DEVICES=2 python examples/fsdp_v2.py      # two CPU processes
    python examples/fsdp_v2.py --dim 128 --layers 2   # a smaller decoder

Every parameter, gradient and optimizer state of the decoder is split over the
'fsdp' axis; each decoder layer is one communication unit.
"""

import argparse
import functools

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
    p.add_argument("--vocab", type=int, default=3200)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="global batch size")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpointing", action="store_true", help="recompute each layer's activations")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every this many steps")
    args = p.parse_args()

    torch.manual_seed(0)
    num_devices = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(num_devices), (num_devices, 1), ("fsdp", "model"))  # MUST have 'fsdp'
    ts.set_global_mesh(mesh)
    model = DecoderModel(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                         intermediate_size=args.intermediate, max_seq_len=args.seq)
    auto_wrap_policy = functools.partial(ts.transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer})
    model = ts.FSDPv2(model, auto_wrap_policy=auto_wrap_policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = synthetic_tokens(args.batch * args.steps, args.seq, args.vocab)
    train_loader = ts.MpDeviceLoader(DataLoader(data, batch_size=args.batch, shuffle=True), ts.device(),
                                     input_sharding=ts.ShardingSpec(mesh, ("fsdp", None)))
    loss_fn = nn.CrossEntropyLoss()
    total = sum(p.full_tensor().numel() if hasattr(p, "full_tensor") else p.numel() for p in model.parameters())
    print(f"{num_devices} device(s), {total / 1e6:.1f}M parameters sharded over 'fsdp'")
    for step, (data, target) in enumerate(train_loader):
        with ts.step():
            output = model(data)
            loss = loss_fn(output.view(-1, output.size(-1)), target.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"Step {step}, Loss: {loss.item():.4f}")


if __name__ == "__main__":
    main()
