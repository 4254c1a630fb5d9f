"""Hugging Face integration (optimum-tpu's ``fsdp_v2`` conveniences, for every model)."""
