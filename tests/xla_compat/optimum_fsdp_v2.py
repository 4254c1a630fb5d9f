"""The optimum-tpu fsdp_v2 program (../shared/seeds/002_9e3678fface8775a.txt), run by
tests/test_xla_compat.py under `torchspmd run --xla-compat`.

The lines between the VERBATIM markers are copied unchanged from the document's "Basic
Usage" and "Integration with Transformers Trainer" blocks, except the trainer block's
`...` (the document's placeholder for the rest of the arguments, not Python), which is
`data_collator=data_collator` (the test also runs the block's own alternative: trl's
SFTTrainer, its two comments taken at their word). What they leave to the reader is defined
above them: the model under the name they load, in a local Hugging Face cache (no hub is
reachable here), the dataset, and the training length (added to ``fsdp_args`` before the
block unpacks it). The model is made fp32 after loading: the test compares fp32 losses."""

import sys

import _setup

_setup.local_hub(sys.argv[1])
OUT = sys.argv[2]

# ---- VERBATIM: Basic Usage ----
from optimum.tpu import fsdp_v2
from transformers import AutoModelForCausalLM, AutoTokenizer
import torch

# Enable FSDP_v2
fsdp_v2.use_fsdp_v2()

# Load model and tokenizer
model_id = "meta-llama/Llama-2-7b"
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(
    model_id, 
    torch_dtype=torch.bfloat16
)

# Get FSDP training configuration
fsdp_args = fsdp_v2.get_fsdp_training_args(model)
# ---- END VERBATIM ----

model = model.float()
dataset = _setup.lm_dataset(tokenizer)
data_collator = _setup.trainer_kwargs(tokenizer, OUT)["data_collator"]
fsdp_args.update(_setup.training_args(OUT))

# ---- VERBATIM: Integration with Transformers Trainer ----
from transformers import Trainer, TrainingArguments
# Or for instruction fine-tuning:
# from trl import SFTTrainer

trainer = Trainer(  # or SFTTrainer
    model=model,
    args=TrainingArguments(**fsdp_args),  # Unpack FSDP configuration
    train_dataset=dataset,
    data_collator=data_collator,
)
# ---- END VERBATIM ----

trainer.train()
_setup.report([r["loss"] for r in trainer.state.log_history if "loss" in r], trainer.model)
