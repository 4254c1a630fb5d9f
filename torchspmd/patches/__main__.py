"""``python -m torchspmd.patches``: the catalogue of patches as docs/patches.md's table."""

from torchspmd.patches import markdown

print(markdown(), end="")
