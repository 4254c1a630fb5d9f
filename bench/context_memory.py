"""Activation memory per process with the sequence split over a 'context' axis.

    python bench/context_memory.py                     # seed decoder and a Llama, context 1, 2, 4
    python bench/context_memory.py --seq 2048 --models seed

Trains a decoder wrapped in FSDPv2 (one unit per layer) on one global batch of ``--batch`` x
``--seq`` tokens annotated ``('fsdp', 'context')`` on a ``(1, c)`` mesh, for c = 1, 2, 4
processes (c = 1: one process, nothing split). For each process it counts the bytes autograd
saves for the backward pass in one step (each storage once, parameters left out: what the
sequence split is meant to divide), and reports the largest over the processes, with the
median time of the steps after the first. The models: the seed decoder
(``torchspmd.models.DecoderModel``, ``nn.MultiheadAttention``) and a transformers Llama with
grouped-query attention (SDPA), both built from configs. Writes
``bench/results/context_memory.md`` and ``context_memory.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def build(name: str, vocab: int):
    import torch

    torch.manual_seed(0)
    if name == "seed":
        from torchspmd.models import DecoderLayer, DecoderModel

        model = DecoderModel(vocab_size=vocab, dim=256, num_layers=4, num_heads=8, intermediate_size=1024,
                             max_seq_len=8192)
        return model, DecoderLayer, lambda m, x: m(x)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config), LlamaDecoderLayer, lambda m, x: m(input_ids=x).logits


def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    import torchspmd as ts

    ts.use_spmd()
    n = ts.global_runtime_device_count()
    vocab = 512
    model, layer_cls, call = build(args.model, vocab)
    mesh = ts.Mesh(np.arange(n), (1, n), ("fsdp", "context"))
    ts.set_global_mesh(mesh)
    model = ts.FSDPv2(model, auto_wrap_policy=functools.partial(ts.transformer_auto_wrap_policy,
                                                                transformer_layer_cls={layer_cls}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)

    params: set[int] = set()

    def note_params(module, _inputs):
        for p in module.parameters(recurse=False):
            local = p.to_local() if isinstance(p, DTensor) else p
            params.add(local.untyped_storage().data_ptr())

    for m in model.modules():
        m.register_forward_pre_hook(note_params)
    saved: dict[int, int] = {}

    def pack(t):
        with torch.no_grad():
            local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    times, activation_bytes, losses = [], None, []
    for step in range(args.steps):
        x = ts.mark_sharding(tokens[:, :-1].to(ts.device()), mesh, ("fsdp", "context"))
        y = ts.mark_sharding(tokens[:, 1:].to(ts.device()), mesh, ("fsdp", "context"))
        t0 = time.perf_counter()
        saved.clear()
        params.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = call(model, x)
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        if activation_bytes is None:
            activation_bytes = sum(b for ptr, b in saved.items() if ptr not in params)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, activation_bytes)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"activation_bytes": max(everyone), "per_process": everyone, "losses": losses,
                       "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0]}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="seed,llama")
    parser.add_argument("--contexts", default="1,2,4")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", default="seed")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for name in args.models.split(","):
        for c in (int(v) for v in args.contexts.split(",")):
            out = RESULTS / f".context_memory_{name}_{c}.json"
            env = {**os.environ, "TORCHSPMD_NUM_DEVICES": str(c)}
            cmd = [sys.executable, __file__, "--worker", "--model", name, "--seq", str(args.seq), "--batch",
                   str(args.batch), "--steps", str(args.steps), "--out", str(out)]
            subprocess.run(cmd, env=env, check=True)
            got = json.loads(out.read_text())
            out.unlink()
            rows.append({"model": name, "context": c, **got})
            print(f"{name} context {c}: {got['activation_bytes'] / 2**20:.1f} MiB saved for backward per process, "
                  f"step {got['step_s']:.2f} s", flush=True)
    base = {r["model"]: r["activation_bytes"] for r in rows if r["context"] == 1}
    from _common import provenance, with_machine

    machine = provenance()
    lines = ["# Activation memory with the sequence split over 'context'", "", machine, "",
             f"Command: `python bench/context_memory.py --seq {args.seq} --batch {args.batch}` "
             f"(FSDPv2, one global batch of {args.batch} x {args.seq} tokens, mesh (1, c) ('fsdp', 'context'); "
             "bytes autograd saves for backward in one step, parameters left out, the largest process).", "",
             "| model | context | saved for backward per process | vs context 1 | step time (median) | losses |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["activation_bytes"] / base[r["model"]] if r["model"] in base else float("nan")
        lines.append(f"| {r['model']} | {r['context']} | {r['activation_bytes'] / 2**20:.1f} MiB | {ratio:.2f} | "
                     f"{r['step_s']:.2f} s | {', '.join(f'{v:.4f}' for v in r['losses'])} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "context_memory.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "context_memory.json").write_text(json.dumps(with_machine(rows, machine), indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
