"""The parallel wrappers: FSDPv2, data parallelism (``replicate`` and the automatic path), tensor parallelism with
and without a wrapper, pipeline stages, activation checkpointing, and the proof that a tensor-parallel pair keeps its activation split."""
