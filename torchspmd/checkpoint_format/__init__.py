"""What a checkpoint is on disk, below the engines: its files (written durably, checksummed,
read safely, the errors that name what is wrong: ``files``) and its state-dict keys (the
unwrapped module's names under an FSDPv2 wrapper, a whole state dict matched to a model:
``keys``). Both engines use them; the public ``torchspmd.checkpoint`` builds saves and loads on
them."""
