"""What the torch_xla programs in this folder leave to their reader: small models and data,
defined above the lines copied verbatim from the seeds (../shared/seeds/). Plain PyTorch
(and transformers for the optimum-tpu program): the oracle (``oracle.py``) imports this
too, in a process that never imports torchspmd.

Every program prints ``LOSSES [...]`` (the losses it saw, as floats) at its end."""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn

SEED = 0


class RecordingCrossEntropy(nn.CrossEntropyLoss):
    """The programs' ``loss_fn`` where the program leaves it to its reader: remembers each loss."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input, target):
        loss = super().forward(input, target)
        self.seen.append(loss.detach())
        return loss


def report(losses, model=None) -> None:
    """Print the losses; with ``model``, also the class names of its parameters (DTensor
    when sharded) and how many elements this process stores of them."""
    print("LOSSES " + json.dumps([float(l) for l in losses]), flush=True)
    if model is not None:
        params = list(model.parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        print("PARAMS " + json.dumps({"types": sorted({type(p).__name__ for p in params}), "local": local,
                                      "total": sum(p.numel() for p in params)}), flush=True)


# --- Pattern 1: images -------------------------------------------------------------------
class MyModel(nn.Module):
    """Pattern 1's model: a small convolutional classifier (3x6x5 images, 7 classes)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, kernel_size=3, padding=1)
        self.head = nn.Linear(5 * 6 * 5, 7)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def image_batches(n_batches=3, rows=12):
    """Global batches of random images and labels (12 rows: uneven pieces on 4 devices? no,
    3 each; the convolution's 6x5 images have sizes no device count divides)."""
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(rows, 3, 6, 5, generator=g), torch.randint(0, 7, (rows,), generator=g))
            for _ in range(n_batches)]


# --- Patterns 2-4: tokens ---------------------------------------------------------------
def token_batches(vocab, n_batches=3, rows=4, seq=6):
    """Global batches (inputs, next-token targets) of random token ids."""
    g = torch.Generator().manual_seed(321)
    out = []
    for _ in range(n_batches):
        t = torch.randint(0, vocab, (rows, seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


class Block(nn.Module):
    """A decoder block for Patterns 3 and 4 (RMSNorm-free, odd sizes: 20 wide, MLP 36)."""

    def __init__(self, dim=20, hidden=36, heads=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    """``my_module`` of Patterns 3 and 4: embedding, 2 blocks, head (vocab 37)."""

    def __init__(self, vocab=37, dim=20, layers=2, output_object=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)
        self.output_object = output_object

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return LMOutput(logits) if self.output_object else logits


class LMOutput:
    """A model output that is not a tensor (Pattern 4's ``output.logits``)."""

    def __init__(self, logits):
        self.logits = logits


def lm_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


# --- optimum-tpu: a Hugging Face model under the name the program loads -------------------
MODEL_ID = "meta-llama/Llama-2-7b"
WORDS = "the cat sat on a mat dog ran far big red sun".split()


def local_hub(home: str) -> None:
    """A Hugging Face cache in ``home`` holding a tiny random Llama and a word tokenizer
    under ``MODEL_ID``, read offline (no hub is reachable here)."""
    os.environ["HF_HOME"] = home  # (read when huggingface_hub is imported: set first)
    os.environ["HF_HUB_OFFLINE"] = "1"
    import sys

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared helpers
    from _helpers import tiny_llama  # (standard library and transformers only: no torchspmd)

    snap = os.path.join(home, "hub", "models--" + MODEL_ID.replace("/", "--"), "snapshots", "0" * 40)
    if not os.path.isfile(os.path.join(snap, "config.json")):
        vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                         unk_token="<unk>", eos_token="<eos>")
        tiny_llama(seed=SEED, vocab_size=len(vocab), hidden_size=24, intermediate_size=40, pad_token_id=0,
                   eos_token_id=2).save_pretrained(snap)
        tokenizer.save_pretrained(snap)
        refs = os.path.join(home, "hub", "models--" + MODEL_ID.replace("/", "--"), "refs")
        os.makedirs(refs, exist_ok=True)
        with open(os.path.join(refs, "main"), "w") as f:
            f.write("0" * 40)


def lm_dataset(tokenizer, n=12):
    """Sentences of 3..9 words, tokenized (rows of uneven length: padded in every batch)."""
    import datasets

    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(n):
        k = int(torch.randint(3, 10, (1,), generator=g))
        text = " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))
        rows.append({"input_ids": tokenizer(text)["input_ids"]})
    return datasets.Dataset.from_list(rows)


def trainer_kwargs(tokenizer, out):
    """What the program's ``Trainer(..., ...)`` leaves to its reader."""
    import transformers

    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return dict(data_collator=collator)


def training_args(out):
    return dict(output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=SEED, disable_tqdm=True)
