"""Pattern 4: FSDPv2 with a custom shard_output, for models whose output is not a tensor.

    CPU_NUM_DEVICES=2 python examples/fsdp_v2_shard_output.py

As in torch_xla, ``shard_output(output, mesh)`` marks the sharding of the output's parts
with ``mark_sharding``; mesh and shard_output can also be passed positionally.
"""

import argparse
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchspmd as ts
from torchspmd.models import DecoderModel

ts.use_spmd()


class CausalLMOutput(OrderedDict):
    """What a transformers model returns: a dict whose entries are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class LMWithOutput(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.decoder = DecoderModel(vocab_size=vocab, dim=dim, num_layers=2, num_heads=4, intermediate_size=4 * dim,
                                    max_seq_len=64)

    def forward(self, tokens):
        return CausalLMOutput(logits=self.decoder(tokens), hidden_tokens=tokens.shape[1])


def shard_output(output, mesh):
    ts.mark_sharding(output.logits, mesh, ("fsdp", None, None))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    n = ts.global_runtime_device_count()
    mesh = ts.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    vocab, seq, batch = 256, 32, 8
    my_module = LMWithOutput(vocab, 128)
    model = ts.FSDPv2(my_module, mesh, shard_output)  # positional form
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        tokens = (torch.randint(0, vocab, (batch, 1), generator=g) + 2 * torch.arange(seq + 1)) % vocab
        x = ts.mark_sharding(tokens[:, :-1].contiguous(), mesh, ("fsdp", None))
        y = ts.mark_sharding(tokens[:, 1:].contiguous(), mesh, ("fsdp", None))
        with ts.step():
            output = model(x)
            loss = F.cross_entropy(output.logits.reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"Step {step}, Loss: {loss.item():.4f}, logits {ts.get_sharding(output.logits)}")


if __name__ == "__main__":
    main()
