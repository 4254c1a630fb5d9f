"""The oracle for the programs in this folder: the same models, data and training in plain
PyTorch (transformers' stock Trainer for the optimum-tpu program), one process, one device.
torchspmd is never imported here.

    python oracle.py pattern1|pattern2|pattern3|pattern4          prints LOSSES [...]
    python oracle.py optimum HF_HOME OUT [sft]"""

import os
import re
import sys

import _setup
import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))


def _verbatim_model_code(program: str) -> str:
    """Pattern 2's model classes, as the program defines them (plain nn code)."""
    text = open(os.path.join(HERE, program)).read()
    return re.search(r"(# --- Model .*?)# --- Setup ---", text, re.S).group(1)


def pattern1():
    torch.manual_seed(_setup.SEED)
    loss_fn = _setup.RecordingCrossEntropy()
    batches = _setup.image_batches()
    model = _setup.MyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for data, target in batches:
        opt.zero_grad()
        loss = loss_fn(model(data), target)
        loss.backward()
        opt.step()
    return [l.item() for l in loss_fn.seen]


def pattern2():
    torch.manual_seed(_setup.SEED)
    batches = _setup.token_batches(vocab=3200)
    scope = {"torch": torch, "nn": nn}
    exec(_verbatim_model_code("pattern2.py"), scope)
    model = scope["DecoderModel"](vocab_size=3200, dim=1024, num_layers=8, num_heads=8, intermediate_size=4096)
    opt = torch.optim.Adam(model.parameters(), lr=0.0001)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for data, target in batches:
        output = model(data)
        loss = loss_fn(output.view(-1, output.size(-1)), target.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return [losses[0], losses[-1]]


def _tiny_lm(output_object):
    torch.manual_seed(_setup.SEED)
    model = _setup.TinyLM(output_object=output_object)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for data, target in _setup.token_batches(vocab=37):
        out = model(data)
        loss = _setup.lm_loss(out.logits if output_object else out, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pattern3():
    return _tiny_lm(False)


def pattern4():
    return _tiny_lm(True)


def optimum(home, out, sft=False):
    _setup.local_hub(home)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(_setup.MODEL_ID)
    model = transformers.AutoModelForCausalLM.from_pretrained(_setup.MODEL_ID, dtype=torch.bfloat16).float()
    dataset = _setup.lm_dataset(tokenizer)
    collator = _setup.trainer_kwargs(tokenizer, out)["data_collator"]
    args = transformers.TrainingArguments(**_setup.training_args(out))
    if sft:
        from trl import SFTTrainer as cls
    else:
        cls = transformers.Trainer
    extra = {} if sft else {"data_collator": collator}  # SFTTrainer brings its own
    trainer = cls(model=model, args=args, train_dataset=dataset, **extra)
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


if __name__ == "__main__":
    name = sys.argv[1]
    if name == "optimum":
        losses = optimum(sys.argv[2], sys.argv[3], sft=len(sys.argv) > 4 and sys.argv[4] == "sft")
    else:
        losses = globals()[name]()
    assert "torchspmd" not in sys.modules
    _setup.report(losses)
