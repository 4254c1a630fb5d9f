"""Layouts as values and formats, engine-neutral: XLA's HLO sharding text, DTensor's block split rule,
torch_xla's shard types, the device table of a layout, device-id layouts of meshes."""
