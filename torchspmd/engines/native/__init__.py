"""The native engine: PyTorch's DeviceMesh, DTensor, FSDP2, c10d and torchrun."""
