"""The rows' flow (torchspmd/engines/native/global_view/row_flow.py): on a forward traced with a symbolic
batch size, whether every output row is computed from its own input row alone. It may only
err towards "not proven": every program of issue #57's table that mixes rows is refused with
the operator (and the module) named; row-local programs, including real transformers
decoders, are proven."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _row_mixing_programs import LAYERS, Model

from torchspmd.engines.native.global_view.row_flow import MEAN, SUM
from torchspmd.engines.native.global_view.row_locality import batch_size_proof


class Lambda(nn.Module):
    def __init__(self, fn, width: int = 6):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return self.fn(self.lin(h))


def _why(module, *args, rows=None, scalars=()):
    rows = rows or args[0].shape[0]
    return batch_size_proof(module, args, {}, rows).rows_apart([rows, 2 * rows + 1], scalars=scalars)


#: the operator named for each program of the table that mixes rows
NAMED = {
    "amax0": "amax", "amin0": "amin", "abs-amax": "amax", "clamp-max": "aten.max", "topk0": "topk",
    "median0": "median", "argsort": "batch size", "softmax0": "batch size", "cummax0": "cummax",
    "cumsum0": "cumsum", "mean0": "mean.dim", "cumprod0": "cumprod", "argmax-gather": "argmax",
    "nonzero": "nonzero", "masked-select": "masked_select", "unique": "unique", "batch-size": "batch size",
    "arange-rows": "batch size",
}


@pytest.mark.parametrize("layer", list(LAYERS))
def test_every_program_that_mixes_rows_is_refused_naming_the_operator(layer):
    torch.manual_seed(0)
    why = _why(Model(layer), torch.randn(4, 5))
    if layer == "row-local":
        assert why is None
    else:
        assert why is not None and NAMED[layer] in why, why


@pytest.mark.parametrize("program, named", [
    (lambda h: h.transpose(0, 1).reshape(-1, 6).view(h.shape[0], -1, 6), "interleaving"),  # rows read as others
    (lambda h: h @ h.transpose(1, 2).sum(0), "reduces"),
    (lambda h: h.flatten(0, 1).softmax(0).view_as(h), "_softmax"),  # over every token of every row
    (lambda h: torch.zeros_like(h).copy_(h) + h.sum(), "in place"),  # batch data written into a new tensor
    (lambda h: h * (h > 0).sum().item(), "on the host"),
    (lambda h: h[1:], ("slices dim 0", "batch size")),
    (lambda h: torch.cat([h, h], 0), "joins along dim 0"),
])
def test_reshapes_products_and_writes_across_rows_are_refused(program, named):
    why = _why(Lambda(program), torch.randn(3, 4, 6))
    assert why is not None and any(n in why for n in ([named] if isinstance(named, str) else named)), why


@pytest.mark.parametrize("program", [
    lambda h: h.reshape(-1, 6).relu().view(h.shape[0], -1, 6),  # tokens flattened with their rows, and back
    lambda h: torch.softmax(h, -1) + h.mean(1, keepdim=True) + h.amax((1, 2), keepdim=True),
    lambda h: F.scaled_dot_product_attention(*(h.view(*h.shape[:2], 2, 3).transpose(1, 2),) * 3, is_causal=True),
    lambda h: h.gather(1, h.argsort(1)) + h.cumsum(2) + h.topk(2, dim=2).values.sum(-1, keepdim=True),
    lambda h: torch.cat([h, h.flip(1) if False else h], 2).chunk(2, dim=2)[0],
    lambda h: F.pad(h, (1, 1)).unsqueeze(1).squeeze(1)[..., 1:-1] * torch.ones(6),
])
def test_row_local_programs_are_proven(program):
    torch.manual_seed(0)
    assert _why(Lambda(program), torch.randn(3, 4, 6)) is None


def test_layers_by_mode_and_by_arguments():
    torch.manual_seed(0)

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

        def forward(self, x):
            h = F.adaptive_avg_pool2d(torch.relu(self.bn(self.c(x))), 1).flatten(1)
            return self.fc(h)

    conv = Conv()
    x = torch.randn(3, 3, 8, 8)
    why = _why(conv, x)  # training: batch statistics
    assert why is not None and "module 'bn' (BatchNorm2d)" in why, why
    assert _why(conv.eval(), x) is None  # running statistics: each row on its own

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.att = nn.Embedding(10, 8), nn.MultiheadAttention(8, 2, batch_first=True)
            self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 10)

        def forward(self, ids):
            h = self.emb(ids)
            a, _ = self.att(h, h, h, need_weights=False)
            return self.head(F.gelu(self.norm(h + a)))

    assert _why(Attention(), torch.randint(0, 10, (3, 5))) is None
    group = nn.Sequential(nn.Conv1d(4, 4, 3), nn.GroupNorm(2, 4), nn.Dropout(0.1))
    assert _why(group, torch.randn(3, 4, 9)) is None  # (dropout's masks: each row its own)


def test_a_loss_inside_is_a_mean_or_a_sum_over_the_rows():
    torch.manual_seed(0)
    mean = Lambda(lambda h: F.mse_loss(h, torch.zeros_like(h)) * 2)
    x = torch.randn(5, 6)
    assert "returns a mean over the rows" in _why(mean, x)  # weighed only where the caller says so
    assert _why(mean, x, scalars=(MEAN,)) is None
    total = Lambda(lambda h: (h ** 2).sum() + h.sum())
    assert _why(total, x, scalars=(SUM,)) is None and _why(total, x, scalars=(MEAN,)) is not None
    mixed = Lambda(lambda h: h.mean() + h.sum())  # a mean plus a sum: weighed neither way
    assert _why(mixed, x, scalars=(MEAN, SUM)) is not None
    ignored = Lambda(lambda h: F.cross_entropy(h, (h[:, 0] > 0).long()))
    assert "nll_loss" in _why(ignored, x, scalars=(MEAN, SUM))  # a mean over the targets not ignored


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("masked", [False, True])
def test_transformers_decoders_are_proven_for_one_row_too(family, attention, masked):
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
    else:
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    config._attn_implementation = attention
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (3, 7))
    kwargs = {"attention_mask": torch.ones(3, 7, dtype=torch.long)} if masked else {}
    proof = batch_size_proof(model, (ids,), kwargs, 3, one_row=True)
    assert proof.rows_apart([1, 3, 8]) is None, proof.rows_apart([1, 3, 8])
