"""Data parallelism on this machine: one process, DDP, ts.replicate, and Pattern 1, on
several families of models.

    python bench/data_parallel.py [--families seed mha llama cnn rnn] [--nproc 2 4] [--repeats 3]
                                  [--steps 12] [--warmup 3] [--strategies ...] [--out bench/results]

Same model, same global batch, same optimizer in every strategy:

- ``single``: one process, all cores;
- ``ddp``: PyTorch DDP, each process loading its own rows;
- ``replicate``: ``ts.replicate`` around the model;
- ``pattern1``: the seed's Pattern 1 as written (no wrapper, batches split by
  ``MpDeviceLoader``): torchspmd's automatic data-parallel path;
- ``pattern1-dtensor``: the same program with that path switched off
  (``TORCHSPMD_AUTO_REPLICATE=0``): every operation through DTensor;
- ``pattern1-gloo-sums`` (only when asked for): Pattern 1 with the exact loss's two small
  sums through gloo's all-reduce instead of shared memory (``TORCHSPMD_SHARED_SUMS=0``);
- ``pattern1-gloo-grads`` (only when asked for): Pattern 1 with the gradients' sum through
  gloo's all-reduce instead of shared memory (``TORCHSPMD_SHARED_GRADIENTS=0``), as DDP sums;
- ``pattern1-accelerator`` (only when asked for): Pattern 1 on the code path a GPU or TPU
  takes (``TORCHSPMD_ACCELERATOR_PATH=1``: every CPU-only shortcut off at once).

Families (``--families``; ``FAMILIES`` below has their sizes): ``seed``, the seed document's
decoder (torchspmd.models); ``mha``, a decoder of ``nn.MultiheadAttention`` (batch first),
RMSNorm and a GELU MLP; ``llama``, transformers' LlamaForCausalLM built from a config;
``cnn``, a convolutional classifier whose BatchNorm layers are in eval mode (running
statistics, no batch statistics); ``rnn``, an LSTM language model (batch first).

A run's tokens/s (for the CNN, images/s) is the median over its timed steps after warm-up,
a step timed from taking its batch from the loader to reading its loss (the loaders read
in different threads: DDP's in the program's, ``MpDeviceLoader``'s in its own on a GPU;
timing the whole iteration counts each where it runs); memory is rank 0's peak RSS. Each configuration runs ``--repeats`` times, the strategies
interleaved in a rotating order within each round, so that a slow stretch of this shared
machine falls on all of them; the table gives the median and the min-max over the runs, and
each strategy's ratio to DDP per round (median, min-max, and in how many rounds it was at
least 0.95 and at least 1), then Pattern 1 against DDP for every family in one table.
Writes ``<out>/data_parallel.md`` and ``.json`` (``--out``, default bench/results).
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

from _common import per_process_loader, run_worker, timed_steps, write_report, write_result

HERE = Path(__file__).resolve().parent
#: family -> (sizes, global batch rows, sequence length or image side)
FAMILIES = {
    "seed": (dict(vocab_size=3200, dim=256, num_layers=4, num_heads=4, intermediate_size=1024, max_seq_len=64), 8, 64),
    "mha": (dict(vocab=3200, dim=512, layers=4, heads=8, inter=2048), 8, 128),
    "llama": (dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128), 8, 128),
    "cnn": (dict(classes=100, width=32), 32, 32),
    "rnn": (dict(vocab=4096, dim=256, layers=2), 8, 64),
}


def build_model(family: str):
    """The family's model, built after ``torch.manual_seed(0)``, and its number of classes
    (the vocabulary) for the cross-entropy loss."""
    import torch
    import torch.nn as nn

    sizes = FAMILIES[family][0]
    torch.manual_seed(0)
    if family == "seed":
        from torchspmd.models import DecoderModel

        return DecoderModel(**sizes), sizes["vocab_size"]
    if family == "mha":  # the seed document's decoder layer, as written there (its RMSNorm: torchspmd's)
        from torchspmd.models.decoder import RMSNorm

        class Layer(nn.Module):
            def __init__(self, dim, heads, inter):
                super().__init__()
                self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
                self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
                self.mlp = nn.Sequential(nn.Linear(dim, inter, bias=False), nn.GELU(),
                                         nn.Linear(inter, dim, bias=False))

            def forward(self, x):
                h = self.norm1(x)
                h, _ = self.attn(h, h, h)
                x = x + h
                return x + self.mlp(self.norm2(x))

        class Decoder(nn.Module):
            def __init__(self, vocab, dim, layers, heads, inter):
                super().__init__()
                self.embed = nn.Embedding(vocab, dim)
                self.layers = nn.ModuleList([Layer(dim, heads, inter) for _ in range(layers)])
                self.norm = RMSNorm(dim)
                self.head = nn.Linear(dim, vocab, bias=False)

            def forward(self, ids):
                x = self.embed(ids)
                for layer in self.layers:
                    x = layer(x)
                return self.head(self.norm(x))

        return Decoder(**sizes), sizes["vocab"]
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**sizes, use_cache=False)), sizes["vocab_size"]
    if family == "cnn":
        w = sizes["width"]

        def block(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        side = FAMILIES[family][2]  # images come flat (one sharding spec for images and labels)
        model = nn.Sequential(nn.Unflatten(1, (3, side, side)), *block(3, w), *block(w, w), nn.MaxPool2d(2), *block(w, 2 * w), *block(2 * w, 2 * w),
                              nn.MaxPool2d(2), *block(2 * w, 4 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(4 * w, sizes["classes"]))
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):  # fine-tuning style: running statistics, trained affine
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.eval()
        return model, sizes["classes"]
    if family == "rnn":
        class LSTMModel(nn.Module):
            def __init__(self, vocab, dim, layers):
                super().__init__()
                self.embed = nn.Embedding(vocab, dim)
                self.rnn = nn.LSTM(dim, dim, layers, batch_first=True)
                self.head = nn.Linear(dim, vocab)

            def forward(self, ids):
                return self.head(self.rnn(self.embed(ids))[0])

        return LSTMModel(**sizes), sizes["vocab"]
    raise ValueError(f"--families: unknown family {family!r}; choose from {sorted(FAMILIES)}")


def family_batches(family: str, classes: int, steps: int):
    import torch

    _, rows, side = FAMILIES[family]
    g = torch.Generator().manual_seed(0)
    if family == "cnn":
        images = torch.randn(steps * rows, 3 * side * side, generator=g)
        return torch.utils.data.TensorDataset(images, torch.randint(0, classes, (steps * rows, 1), generator=g))
    tokens = torch.randint(0, classes, (steps * rows, side + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _per_step(family: str) -> int:
    """Tokens (for the CNN, images) per global batch."""
    _, rows, side = FAMILIES[family]
    return rows if family == "cnn" else rows * side


def worker(family: str, strategy: str, steps: int, warmup: int, result: str) -> None:
    if strategy == "pattern1-dtensor":
        os.environ["TORCHSPMD_AUTO_REPLICATE"] = "0"
    if strategy == "pattern1-gloo-sums":
        os.environ["TORCHSPMD_SHARED_SUMS"] = "0"
    if strategy == "pattern1-gloo-grads":
        os.environ["TORCHSPMD_SHARED_GRADIENTS"] = "0"
    if strategy == "pattern1-accelerator":
        os.environ["TORCHSPMD_ACCELERATOR_PATH"] = "1"
    import numpy as np
    import torch

    model, classes = build_model(family)
    batch = FAMILIES[family][1]
    data = family_batches(family, classes, steps)
    rank = 0
    if strategy == "single":
        loader = torch.utils.data.DataLoader(data, batch_size=batch)
    elif strategy == "ddp":
        rank, _, loader = per_process_loader(data, batch)
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        import torchspmd as ts

        ts.use_spmd()
        rank = ts.global_ordinal()
        n = ts.global_runtime_device_count()
        mesh = ts.Mesh(np.arange(n), (n,), ("data",))
        if strategy == "replicate":
            model = ts.replicate(model, mesh)
        loader = ts.MpDeviceLoader(torch.utils.data.DataLoader(data, batch_size=batch), ts.device(),
                                   input_sharding=ts.ShardingSpec(mesh, ("data", None)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = timed_steps(model, opt, loader, classes, warmup, loading=True)
    if rank == 0:
        write_result(result, strategy, _per_step(family), times)


STRATEGIES = ["single", "ddp", "replicate", "pattern1", "pattern1-dtensor", "pattern1-gloo-sums", "pattern1-gloo-grads",
              "pattern1-accelerator"]


def _round(args, configs: list, runs: dict, r: int) -> None:
    """One round: every configuration once, in a rotating order (each round starts elsewhere)."""
    k = r % len(configs)
    for family, strategy, nproc in configs[k:] + configs[:k]:
        row = run_worker(__file__, ["--worker", strategy, "--family", family, "--steps", str(args.steps),
                                    "--warmup", str(args.warmup)], nproc,
                         args.out / f".{family}-{strategy}{nproc}.json")
        runs[(family, strategy, nproc)].append(row)
        print(f"round {r + 1}/{args.repeats}: {family} {strategy} x{nproc} {row['tokens_per_s']:.0f} /s", flush=True)


NAMES = {"single": "one process", "ddp": "DDP", "replicate": "ts.replicate",
         "pattern1": "Pattern 1 as written (automatic path)",
         "pattern1-dtensor": "Pattern 1, automatic path off (DTensor)",
         "pattern1-gloo-sums": "Pattern 1, the loss's sums through gloo (TORCHSPMD_SHARED_SUMS=0)",
         "pattern1-gloo-grads": "Pattern 1, the gradients' sum through gloo (TORCHSPMD_SHARED_GRADIENTS=0)",
         "pattern1-accelerator": "Pattern 1, the accelerator path (TORCHSPMD_ACCELERATOR_PATH=1)"}


def main() -> None:
    import statistics

    p = argparse.ArgumentParser()
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=STRATEGIES[:5], choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker")
    p.add_argument("--family", default="seed", choices=list(FAMILIES))
    p.add_argument("--result")
    args = p.parse_args()
    if args.worker:
        return worker(args.family, args.worker, args.steps, args.warmup, args.result)
    cores = os.cpu_count() or 1
    configs = []
    for family in args.families:
        configs += [(family, "single", 1)] if "single" in args.strategies else []
        configs += [(family, s, n) for n in args.nproc for s in args.strategies if s != "single"]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):
        _round(args, configs, runs, r)
    command = (f"python bench/data_parallel.py --families {' '.join(args.families)} --repeats {args.repeats} "
               f"--steps {args.steps} --warmup {args.warmup} --nproc {' '.join(map(str, args.nproc))} "
               f"--strategies {' '.join(args.strategies)}"
               f"{'' if args.out == HERE / 'results' else f' --out {_shown(args.out)}'}")
    lines = [
        "# Data parallelism: throughput and memory by model family",
        "",
        f"`{command}`: Adam; gloo processes (OMP threads = cores / processes) except `one process` (1 process, "
        f"{cores} threads). A step is timed from taking its batch to reading its loss. Each run: median of "
        f"{args.steps - args.warmup} timed steps; {args.repeats} runs of each "
        f"configuration, interleaved. Machine: {platform.machine()}, {cores} cores, torch "
        f"{__import__('torch').__version__}.",
        "",
    ]
    rows = []
    for family in args.families:
        model, _ = build_model(family)
        params = sum(t.numel() for t in model.parameters())
        _, batch, side = FAMILIES[family]
        shape = f"{batch} images of 3 x {side} x {side}" if family == "cnn" else f"{batch} x {side} tokens"
        unit = "images/s" if family == "cnn" else "tokens/s"
        lines += [
            f"## {family}: {type(model).__name__}, {params / 1e6:.1f}M parameters, global batch {shape}",
            "",
            f"Sizes: {FAMILIES[family][0]}.",
            "",
            f"| strategy | processes | {unit}, median of runs | min-max of runs | vs DDP, median of rounds | "
            "min-max of rounds | rounds >= 0.95 / >= 1 | peak RSS per process (GB) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (fam, strategy, nproc), rs in runs.items():
            if fam != family:
                continue
            tps = [x["tokens_per_s"] for x in rs]
            ddp = runs.get((family, "ddp", nproc)) if nproc > 1 else None
            ratios = [x["tokens_per_s"] / d["tokens_per_s"] for x, d in zip(rs, ddp)] if ddp else []
            row = {"family": family, "strategy": strategy, "nproc": nproc, "per_s": statistics.median(tps),
                   "per_s_runs": tps, "unit": unit, "vs_ddp": statistics.median(ratios) if ratios else None,
                   "vs_ddp_runs": ratios, "peak_rss_gb": statistics.median(x["peak_rss_gb"] for x in rs)}
            rows.append(row)
            vs = f"{row['vs_ddp']:.2f}" if ratios else ""
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
            count = (f"{sum(x >= 0.95 for x in ratios)} / {sum(x >= 1 for x in ratios)} of {len(ratios)}"
                     if ratios and strategy != "ddp" else "")
            lines.append(f"| {NAMES[strategy]} | {nproc} | {row['per_s']:.0f} | {min(tps):.0f}-{max(tps):.0f} | "
                         f"{vs} | {spread} | {count} | {row['peak_rss_gb']:.2f} |")
        lines.append("")
    write_report(args.out, "data_parallel", lines + summary(rows), rows)


def _shown(path: Path) -> str:
    """``path`` as given on the command line: relative to the working directory when inside it."""
    rel = os.path.relpath(path)
    return path.as_posix() if rel.startswith("..") else rel


def summary(rows: list[dict]) -> list[str]:
    """Pattern 1 against DDP, one line per family and process count (from the report's rows)."""
    ddp = {(r["family"], r["nproc"]): r for r in rows if r["strategy"] == "ddp"}
    mine = [r for r in rows if r["strategy"] == "pattern1" and (r["family"], r["nproc"]) in ddp]
    if not mine:
        return []
    lines = ["## Pattern 1 against DDP", "",
             ("| family | processes | DDP, median of runs | Pattern 1 / DDP, median of rounds | min-max of rounds "
              "| rounds >= 0.95 |"), "|---|---|---|---|---|---|"]
    for r in mine:
        ratios = r["vs_ddp_runs"]
        lines.append(f"| {r['family']} | {r['nproc']} | {ddp[(r['family'], r['nproc'])]['per_s']:.0f} {r['unit']} | "
                     f"{r['vs_ddp']:.2f} | {min(ratios):.2f}-{max(ratios):.2f} | "
                     f"{sum(x >= 0.95 for x in ratios)} of {len(ratios)} |")
    return lines + [""]


if __name__ == "__main__":
    main()
