"""LoRA fine-tuning with trl's SFTTrainer on torchspmd FSDPv2: optimum-tpu's workflow on
any device.

    python examples/hf_finetune.py                  # 2 CPU devices (processes)
    python examples/hf_finetune.py --devices 4 --steps 60
    PJRT_DEVICE=TPU python examples/hf_finetune.py  # a TPU VM: transformers' own torch_xla FSDPv2

A small Llama is built from a config and saved with ``save_pretrained`` first (the
stand-in for a downloaded checkpoint), then loaded with ``from_pretrained`` and
fine-tuned with LoRA on a local text dataset (paragraphs of the Python standard
library's sources, which every machine has). The base model's parameters, the adapter's
gradients and its optimizer state are split over the devices; the adapter is saved as a
normal PEFT directory and loaded back with ``PeftModel.from_pretrained``.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import torchspmd as ts
from torchspmd.hf import fsdp_v2


def local_texts(n: int) -> list[str]:
    """Paragraphs of the standard library's Python sources."""
    from torchspmd.train.data import stdlib_files

    out: list[str] = []
    for path in stdlib_files():
        for para in path.read_text(errors="ignore").split("\n\n"):
            para = para.strip()
            if 80 <= len(para) <= 600:
                out.append(para)
                if len(out) == n:
                    return out
    return out


def make_base_model(directory: Path, texts: list[str], seed: int) -> None:
    """A byte-level BPE tokenizer trained on the texts and a small Llama, saved as a
    pretrained checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=None,
                   help="CPU devices (processes) on the native engine; default $CPU_NUM_DEVICES, else 2. "
                        "On the XLA backend PJRT decides")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="global batch (per_device_train_batch_size under SPMD)")
    p.add_argument("--out", default="runs/hf_finetune")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 shards, as transformers' Trainer")
    args = p.parse_args()

    if args.devices is None and not os.environ.get("PJRT_DEVICE"):
        args.devices = int(os.environ.get("CPU_NUM_DEVICES", 2))
    fsdp_v2.use_fsdp_v2(num_devices=args.devices)  # first: with 2 devices the script runs once per device

    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    from torchspmd.hf import SFTTrainer

    out = Path(args.out)
    base_dir = out / "base"
    texts = local_texts(512)
    first = ts.process_index() == 0  # the process that writes files and prints
    if first and not (base_dir / "config.json").exists():
        make_base_model(base_dir, texts, seed=0)
    if dist.is_initialized():  # one process per device (native engine): wait for the files
        dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    fsdp_args = fsdp_v2.get_fsdp_training_args(model)
    if first:
        print("fsdp args:", fsdp_args)
    config = SFTConfig(
        output_dir=str(out / "run"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=5, save_strategy="no", report_to=[],
        max_length=128, bf16=args.bf16, use_cpu=ts.device_type() == "cpu", seed=0, disable_tqdm=True,
        gradient_checkpointing=False,  # xla_fsdp_grad_ckpt checkpoints each decoder layer already
        **fsdp_args,
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                               task_type="CAUSAL_LM"),
    )
    shard = next(p for p in trainer.model.parameters())
    if first:
        print(f"parameters: {type(shard).__name__} {tuple(getattr(shard, 'placements', ()))} over "
              f"{ts.global_runtime_device_count()} devices ({ts.backend()} backend)")
    trainer.train()
    trainer.save_model(str(out / "adapter"))

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if first:
        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "adapter")
        n_lora = sum(p.numel() for n, p in tuned.named_parameters() if "lora_" in n)
        print(f"adapter saved to {out / 'adapter'} ({n_lora} LoRA weights) and loaded back")
        print("result:", json.dumps({"first_loss": losses[0], "last_loss": losses[-1], "lora_weights": n_lora}))


if __name__ == "__main__":
    main()
