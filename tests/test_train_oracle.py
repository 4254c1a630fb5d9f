"""`torchspmd train`'s job features checked against an independent oracle.

What the jobs (2 CPU processes, a tiny Llama, a few steps) write — metrics.csv, their DCP
checkpoints, the exported transformers directory, `torchspmd generate`'s text — is read
back by code that shares nothing with torchspmd: torch's own DCP format utilities
(`dcp_to_torch_save`), safetensors, and transformers' `from_pretrained` / `generate`, each in
a clean process that never imports torchspmd.
"""

import csv
import json
import math
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import clean_env, dcp_state, dcp_states
from test_train import ROOT, losses, train

STEPS = 3
PROMPT = "def "
NEW_TOKENS = 40  # prompt + new tokens stay within the model's 64 positions
EOS = 256  # the byte tokenizer's end of text
# The job's settings the single-process oracle repeats (test_train.SMALL and the config defaults).
SEQ, BATCH, DIM, LAYERS, HEADS, MLP = 64, 8, 64, 2, 4, 128
LR, WARMUP, BETAS, DECAY, CLIP, SEED = 3e-3, STEPS, (0.9, 0.95), 0.1, 1.0, 0  # warm-up: the whole run (job())


def clean_python(code: str, *args) -> str:
    """Run ``code`` in a fresh interpreter that never imports torchspmd; return its stdout."""
    code += "\nassert not any(m.startswith('torchspmd') for m in sys.modules), 'the oracle imported torchspmd'\n"
    r = subprocess.run([sys.executable, "-c", "import sys\n" + code, *map(str, args)], capture_output=True, text=True,
                       env=clean_env(), timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def job_state(checkpoint: Path) -> dict:
    """A checkpoint's whole (unsharded) state as torch's DCP format utilities assemble it
    from the shards (_helpers.dcp_state, a clean process): {'model': {name: tensor}, 'optim':
    {'state': ..., 'param_groups': ...}}. Kept beside the job (jobs are shared by the test
    runners: written whole, by whichever gets here first)."""
    return dcp_state(checkpoint, keep=checkpoint.parent.parent / f"oracle-{checkpoint.name}.pt")


def ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def metrics_rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def optim_tensors(sd: dict) -> dict:
    """AdamW's per-parameter state (both moments and the step count), flat."""
    return {f"{name}.{k}": v for name, s in sd["optim"]["state"].items() for k, v in s.items()}


def learning_rates(sd: dict) -> list[float]:
    groups = sd["optim"]["param_groups"]  # torchspmd stores the groups pickled, as one value
    return [g["lr"] for g in (pickle.loads(groups) if isinstance(groups, bytes) else groups)]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("oracle")


def _write_corpus(folder: Path) -> None:
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8))) for _ in range(50)]
    (folder / "corpus.txt").write_text("".join(rng.choice(words) + rng.choice("  \n") for _ in range(1200)))


@pytest.fixture(scope="module")
def corpus(once):
    """Random text (words of random letters) in one file: one document. (This and the jobs
    below are made once for all the test runners: ``once`` in conftest.py.)"""
    return once("oracle-corpus", _write_corpus)[0] / "corpus.txt"


def job(out: Path, corpus: Path, *flags, steps: int = STEPS, **kw):
    if "--optim.warmup_steps" not in flags:  # warm-up only, as the oracle's schedule
        flags = (*flags, "--optim.warmup_steps", str(min(WARMUP, steps)))
    return train(out, "--data.path", str(corpus), "--optim.max_steps", str(steps), "--checkpoint.every", str(steps),
                 *flags, **kw)


def _shared_job(out: Path, corpus: Path, *flags, **kw) -> None:
    job(out, corpus, *flags, **kw)  # (its files are what the test runners share)


@pytest.fixture(scope="module")
def base(once, corpus):
    """The reference job: grad_accum 1, no layer checkpointing."""
    return once("oracle-base", lambda out: _shared_job(out, corpus))[0]


# --- the job against one process of plain PyTorch and transformers ---------------------------------------------

ONE_PROCESS = """
import json
import torch, torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
a = json.loads(sys.argv[1])
# the data, as docs/train.md describes it: bytes, end of text, windows of SEQ + 1, the last 2% held out,
# global batches from a permutation seeded per epoch
tokens = list(open(a["corpus"], encoding="utf-8").read().encode()) + [a["eos"]]
n = (len(tokens) - 1) // a["seq"]
n_train = n - max(1, int(n * 0.02))
per_epoch = n_train // a["batch"]
def batch(k):
    epoch, pos = divmod(k, per_epoch)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(a["seed"] * 1_000_003 + epoch))
    rows = torch.stack([torch.tensor(tokens[i * a["seq"]:(i + 1) * a["seq"] + 1])
                        for i in perm[pos * a["batch"]:(pos + 1) * a["batch"]].tolist()])
    return rows[:, :-1], rows[:, 1:]
torch.manual_seed(a["seed"])
config = AutoConfig.for_model("llama", vocab_size=a["eos"] + 1, hidden_size=a["dim"], num_hidden_layers=a["layers"],
                              num_attention_heads=a["heads"], num_key_value_heads=a["heads"],
                              intermediate_size=a["mlp"], max_position_embeddings=a["seq"], use_cache=False,
                              tie_word_embeddings=False, head_dim=a["dim"] // a["heads"])
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
params = list(model.parameters())
opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": a["decay"]},
                         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                        lr=a["lr"], betas=a["betas"], fused=True)  # torchspmd train's default
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / a["warmup"])  # warm-up only, in these steps
losses = []
for k in range(a["steps"]):
    x, y = batch(k)
    loss = F.cross_entropy(model(x).logits.reshape(-1, a["eos"] + 1), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, a["clip"])
    opt.step(); sched.step(); opt.zero_grad()
    losses.append(loss.item())
torch.save(model.state_dict(), a["weights"])
print(json.dumps(losses))
"""


@pytest.mark.smoke
def test_job_equals_one_process(work, corpus, base):
    weights = work / "one_process.pt"
    args = dict(corpus=str(corpus), eos=EOS, seq=SEQ, batch=BATCH, dim=DIM, layers=LAYERS, heads=HEADS, mlp=MLP,
                lr=LR, warmup=WARMUP, betas=BETAS, decay=DECAY, clip=CLIP, seed=SEED, steps=STEPS,
                weights=str(weights))
    want = json.loads(clean_python(ONE_PROCESS, json.dumps(args)))
    got = losses(base)
    assert want[-1] < want[0] - 0.05  # it trains: the weights move
    assert [got[s] for s in sorted(got)] == pytest.approx(want, rel=1e-5, abs=0)
    oracle, trained = torch.load(weights), job_state(ckpt(base, STEPS))["model"]
    assert oracle.keys() == trained.keys()
    for k in oracle:
        torch.testing.assert_close(trained[k], oracle[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# --- gradient accumulation, layer checkpointing, the sequence split over 'context' ---------------------------------


@pytest.mark.parametrize("flags", [("--optim.grad_accum", "2"), ("--precision.checkpointing", "true"),
                                   ("--mesh.context", "2")],
                         ids=["grad_accum_2", "layer_checkpointing", "context_2"])
def test_same_losses_and_weights_as_the_plain_job(work, corpus, base, flags):
    out = work / flags[0].split(".")[-1]
    job(out, corpus, *flags)
    want, got = losses(base), losses(out)
    assert sorted(want) == list(range(1, STEPS + 1)) and got.keys() == want.keys()
    assert want[STEPS] < want[1] - 0.05  # the reference job trains: its weights move
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), step
    a, b = job_state(ckpt(base, STEPS))["model"], job_state(ckpt(out, STEPS))["model"]
    assert a.keys() == b.keys()  # the checkpoint wrapper leaves the parameter names alone
    for k in a:  # atol as against the plain job: Adam divides by sqrt(v), so where a weight's gradient is
        # near zero, a last-bit difference in it (here: the sums of two micro-batches) moves that weight by ~5e-7
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_a_context_checkpoint_resumes_at_another_context_degree(work, corpus, base):
    """A checkpoint of the job with each sequence split over 'context' 2 (2 processes) resumes
    over 'context' 4 (4 processes) and over none ('fsdp' 2): the checkpoint holds whole tensors,
    whatever the degree; the losses after it and the final weights are the plain job's."""
    saved = work / "context-saved"
    job(saved, corpus, "--mesh.context", "2", "--checkpoint.every", "1", "--checkpoint.keep", "0")
    want = losses(base)
    for name, devices, flags in (("context4", 4, ("--mesh.context", "4")), ("plain", 2, ())):
        again = work / f"context-resumed-{name}"
        job(again, corpus, *flags, "--checkpoint.resume", str(ckpt(saved, 1)), devices=devices)
        got = losses(again)
        assert sorted(got) == [2, STEPS], (name, got)
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), (name, step)
        a, b = job_state(ckpt(base, STEPS))["model"], job_state(ckpt(again, STEPS))["model"]
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k, n=name: f"{n} {k}: {m}")


# --- export and generate -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(once, corpus):
    """A job trained long enough to have learnt the corpus's letters (so that its greedy
    text is ASCII: the byte tokenizer's text then gives back its token ids)."""
    return once("oracle-trained", lambda out: _shared_job(out, corpus, "--optim.warmup_steps", "5", steps=30))[0]


def _export(trained: Path, folder: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "export", str(trained), str(folder / "hf")],
                       capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    # no warning (DCP's "torch.distributed is disabled ..." among them; transformers' progress bar may show)
    assert not re.search(r"warn|(^|\]:)W\d{4} \d", r.stderr, re.IGNORECASE | re.MULTILINE), r.stderr[-3000:]


@pytest.fixture(scope="module")
def exported(once, trained):
    return once("oracle-exported", lambda folder: _export(trained, folder))[0] / "hf"


HF_GENERATE = """
import json, torch
from transformers import AutoModelForCausalLM
hf, prompt, n, weights = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = AutoModelForCausalLM.from_pretrained(hf).eval()
torch.save(model.state_dict(), weights)
ids = torch.tensor([prompt])
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
print(json.dumps(out[0].tolist()))
"""


@pytest.fixture(scope="module")
def transformers_oracle(once, exported):
    """transformers' own reading of the exported directory: its weights, and its greedy
    continuation of the prompt."""
    folder, ids = once("oracle-transformers", lambda folder: json.loads(clean_python(
        HF_GENERATE, exported, json.dumps(list(PROMPT.encode())), NEW_TOKENS, folder / "from_pretrained.pt")))
    return {"weights": torch.load(folder / "from_pretrained.pt"), "ids": ids}


def test_export_equals_the_trained_weights(trained, exported, transformers_oracle):
    from safetensors.torch import load_file

    final = job_state(ckpt(trained, 30))["model"]  # the job's final checkpoint, assembled by torch
    assert_equal(load_file(exported / "model.safetensors"), final)
    assert_equal(transformers_oracle["weights"], final)
    config = json.loads((exported / "config.json").read_text())
    assert config["eos_token_id"] == EOS  # the byte tokenizer's end of text, not llama's default 2


def test_greedy_generate_equals_transformers(trained, transformers_oracle):
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "generate", str(trained), "--prompt", PROMPT,
                        "--tokens", str(NEW_TOKENS), "--temperature", "0"],
                       capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not re.search(r"warn|(^|\]:)W\d{4} \d", r.stderr, re.IGNORECASE | re.MULTILINE), r.stderr[-3000:]
    text = r.stdout[:-1]  # print's newline
    ids = transformers_oracle["ids"]
    ids = ids[: ids.index(EOS)] if EOS in ids else ids  # generate stops at end of text and does not show it
    assert len(ids) > len(PROMPT)
    # The byte tokenizer's text is its ids, one byte each (no replacement characters, so nothing is lost).
    assert "\ufffd" not in text and list(text.encode()) == ids
    sampled = subprocess.run([sys.executable, "-m", "torchspmd.cli", "generate", str(trained), "--prompt", PROMPT,
                              "--tokens", "5"], capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT)
    assert sampled.returncode == 0 and sampled.stdout.startswith(PROMPT), sampled.stderr[-3000:]


@pytest.mark.parametrize("flags", [("--temperature", "-1"), ("--top-k", "0"), ("--tokens", "-3")])
def test_generate_refuses_a_negative_temperature_or_no_candidates(tmp_path, flags):
    r = subprocess.run([sys.executable, "-m", "torchspmd.cli", "generate", str(tmp_path), *flags],
                       capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    message = "--tokens -3: give the number of tokens to add, 0 or more" if flags[0] == "--tokens" else \
        "give a temperature of 0 or more (0: greedy) and a top-k of 1 or more"
    assert r.stderr.count(message) == 1, r.stderr[-3000:]


def test_exported_directory_fine_tunes(work, corpus, exported):
    out = work / "ft"
    job(out, corpus, "--model.pretrained", str(exported), steps=2)
    assert sorted(losses(out)) == [1, 2]


# --- the non-finite-loss guard -----------------------------------------------------------------------------------

NAN_STEPS = "2,4-6"  # one bad step, then three in a row
MAX_BAD = 3


def _bad_job(out: Path, corpus: Path) -> dict:
    r = job(out, corpus, "--checkpoint.every", "1", "--checkpoint.keep", "10", "--optim.max_bad_steps", str(MAX_BAD),
            steps=8, env={"TORCHSPMD_FAULT_NAN_AT_STEPS": NAN_STEPS}, check=False)
    return {"returncode": r.returncode, "stderr": r.stderr}


@pytest.fixture(scope="module")
def bad_job(once, corpus):
    out, r = once("oracle-nan", lambda out: _bad_job(out, corpus))
    return out, subprocess.CompletedProcess([], r["returncode"], "", r["stderr"])


def test_a_non_finite_step_changes_nothing_and_is_recorded(bad_job):
    out, _ = bad_job
    rows = metrics_rows(out)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [int(r["skipped"]) for r in rows] == [0, 1, 0, 1, 1, 1]
    assert [math.isfinite(float(r["loss"])) for r in rows] == [True, False, True, False, False, False]
    s = dict(zip((1, 2, 3, 4, 5), dcp_states(*(ckpt(out, step) for step in (1, 2, 3, 4, 5)))))
    for before, after in [(1, 2), (3, 4), (4, 5)]:  # a skipped step: weights, AdamW state and lr as they were
        assert_equal(s[after]["model"], s[before]["model"])
        assert_equal(optim_tensors(s[after]), optim_tensors(s[before]))
        assert learning_rates(s[after]) == learning_rates(s[before])
    # the good step in between trained (so the equalities above are not those of a stuck job)
    changed = [k for k in s[3]["model"] if not torch.equal(s[3]["model"][k], s[2]["model"][k])]
    assert len(changed) == len(s[3]["model"])
    assert all(torch.isfinite(v).all() for v in s[5]["model"].values())
    assert float(rows[2]["lr"]) > float(rows[1]["lr"]) == float(rows[0]["lr"])  # the schedule waits too


STOP_MESSAGE = (f"stopping at step 6: {MAX_BAD} consecutive steps had a non-finite loss or gradient "
                f"(optim.max_bad_steps = {MAX_BAD}); lower optim.lr, check the data, or raise optim.max_bad_steps")


def test_consecutive_non_finite_steps_stop_the_job(bad_job):
    out, r = bad_job
    assert r.returncode != 0 and f"torchspmd: {STOP_MESSAGE}" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not ckpt(out, 6).exists() and ckpt(out, 5).exists()  # it stopped at step 6, before saving


def test_the_stop_is_reported_once(bad_job):
    _, r = bad_job
    assert r.stderr.count(STOP_MESSAGE) == 1, r.stderr[-3000:]
