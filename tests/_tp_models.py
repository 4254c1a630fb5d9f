"""Models, batches and the one-device oracle of the tensor-parallel tests. Plain PyTorch and
transformers only: this module never imports torchspmd (the oracle runs it in a clean
process; see _clean.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 37  # divides by neither 2 nor 4: the vocabulary splits unevenly
DIM, INTER = 16, 24
STEPS = 3
LR = 1e-2
# Adam's eps: torch's default, 1e-8, except for the Llama. Adam's step lr * m / (sqrt(v) + eps)
# has slope up to lr / eps in the gradient near zero, so an element whose gradient is a
# near-cancelling sum (1e-7 from terms of 1e-3) moves by whatever the last bits of that sum say;
# the summation order of sharded reductions changes those bits. For the Llama that exceeds the
# tolerance (measured with eps 1e-8, torch 2.13: one element of lm_head.weight's step-2 gradient
# off by 1.4e-6 on a (2, 2) mesh, one of embed_tokens.weight after 3 steps by 1.6e-6 on (1, 2),
# against atol 1e-6; every other model here stays within a fifth of the tolerance). eps = 1e-3
# bounds the slope by 10: a wrong layout still differs at O(1), last-bit noise no longer does.
EPS = {"llama": 1e-3}


def adam_eps(kind: str) -> float:
    return EPS.get(kind, 1e-8)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.fc1 = nn.Linear(DIM, INTER)
        self.fc2 = nn.Linear(INTER, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MlpLM(nn.Module):
    """Embedding, two MLP blocks, an LM head: every weight of it can be split over 'model'."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


class AttnBlock(nn.Module):
    """Pre-norm attention (nn.MultiheadAttention with biases, 4 heads) and an MLP. ``batch_first``
    and the mask kind vary by layer: a float causal mask and no weights, or the sequence-first
    layout with a bool mask and the averaged weights returned (unused)."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.norm = RMSNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=batch_first)
        self.mlp = Block()

    def forward(self, x):
        t = x.shape[1]
        h = self.norm(x)
        if self.batch_first:
            mask = torch.full((t, t), float("-inf")).triu(1)
            a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        else:
            h = h.transpose(0, 1)
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            a, _ = self.attn(h, h, h, attn_mask=mask)
            a = a.transpose(0, 1)
        return self.mlp(x + a)


class AttnLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([AttnBlock(True), AttnBlock(False)])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


class PackedBlock(nn.Module):
    """Projections a program cuts itself (a packed key/value projection and a packed gate/up,
    split with `chunk`) and a norm over the whole query (OLMo2's q_norm, not per head): each
    needs all of its column-parallel output, so none may keep it split into its partner."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.q_norm = RMSNorm(DIM)
        self.w12 = nn.Linear(DIM, 2 * INTER, bias=False)
        self.w3 = nn.Linear(INTER, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        k, v = self.kv(h).chunk(2, dim=-1)
        q, k, v = (z.reshape(b, t, 4, DIM // 4).transpose(1, 2) for z in (self.q_norm(self.q(h)), k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.o(a)
        g, u = self.w12(self.norm(x)).chunk(2, dim=-1)
        return x + self.w3(F.silu(g) * u)


class PackedLM(MlpLM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([PackedBlock(), PackedBlock()])


class Dropping(nn.Module):
    """Dropout of probability 0.5 after ``fn``, or (``masks``, the oracle's) the given masks,
    in call order."""

    P = 0.5

    def __init__(self, fn=None):
        super().__init__()
        self.fn = fn
        self.masks = None

    def forward(self, x):
        if self.fn is not None:
            x = self.fn(x)
        if self.masks is None:
            return F.dropout(x, self.P, training=self.training)
        return x * self.masks.pop(0) * (1 / (1 - self.P))


class DropBlock(nn.Module):
    """Causal attention (q/k/v linears in a ModuleDict, o, 4 heads of 4, computed by hand)
    and an MLP, with dropout on the attention weights and on the MLP's hidden features (in a
    module of its own, with the GELU: split over 'model' under tensor parallelism, each
    process's heads, its features) and, with ``out_drop``, on the block's MLP output (whole on
    every process; without it, a checkpointed recomputation of the block stops before its
    last linear)."""

    def __init__(self, out_drop: bool = True):
        super().__init__()
        self.out_drop = out_drop
        self.qkv = nn.ModuleDict({n: nn.Linear(DIM, DIM, bias=False) for n in "qkv"})
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.fc1, self.fc2 = nn.Linear(DIM, INTER), nn.Linear(INTER, DIM)
        self.drop, self.act = Dropping(), Dropping(F.gelu)

    def forward(self, x):
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, -1, 4).transpose(1, 2)

        q, k, v = (heads(self.qkv[n](x)) for n in "qkv")
        causal = torch.full((t, t), float("-inf")).triu(1)
        probs = torch.softmax(q @ k.transpose(-2, -1) / 2 + causal, dim=-1)
        h = x + self.o((self.drop(probs) @ v).transpose(1, 2).reshape(b, t, -1))
        m = self.fc2(self.act(self.fc1(h)))
        return h + (self.drop(m) if self.out_drop else m)


class DropLM(MlpLM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([DropBlock(), DropBlock(out_drop=False)])

    #: what each dropout call of a forward drops out, in order
    KINDS = ("heads", "features", "whole", "heads", "features")


def dropout_oracle(batch: int, masks: list):
    """One device, one step, with the given dropout masks (in call order, DropLM.KINDS):
    the loss and the gradients."""
    model = build("drop")
    left = list(masks)
    for b in model.blocks:
        b.drop.masks = b.act.masks = left
    x, y = batches(batch)[0]
    loss = loss_of(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def llama_config():
    """The tiny Llama (_helpers.TINY_LLAMA: 2 layers, 4 heads, 2 key/value heads) at this module's sizes."""
    from _helpers import tiny_llama_config

    return tiny_llama_config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=INTER, head_dim=4,
                             tie_word_embeddings=False)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return MlpLM()
    if kind == "attn":
        return AttnLM()
    if kind == "packed":
        return PackedLM()
    if kind == "drop":
        return DropLM()
    if kind == "tied":  # the LM head is the embedding's table
        model = MlpLM()
        model.lm_head.weight = model.embed.weight
        return model
    if kind == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(llama_config()).float()
    raise ValueError(kind)


def batches(batch: int):
    """STEPS global batches of random tokens; ignored labels (-100) spread unevenly."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch * STEPS, 9), generator=g)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for s in range(STEPS):
        y[s * batch, :4] = -100
    return [(x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]) for s in range(STEPS)]


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def loss_of(out, y):
    out = logits_of(out)
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def oracle(kind: str, batch: int):
    """One device: losses, every step's gradients, the final parameters."""
    model = build(kind)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=adam_eps(kind))
    losses, grads = [], []
    for x, y in batches(batch):
        loss = loss_of(model(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def pair() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, INTER), nn.GELU(), nn.Linear(INTER, DIM))


def input_rows() -> torch.Tensor:
    return torch.randn(5, DIM, generator=torch.Generator().manual_seed(2))


def input_grad_oracle() -> torch.Tensor:
    """One device: the gradient of a mean-square loss with respect to the input rows."""
    x = input_rows().requires_grad_(True)
    pair()(x).pow(2).mean().backward()
    return x.grad
