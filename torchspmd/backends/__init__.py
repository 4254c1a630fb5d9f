"""Engines other than the native one. ``xla``: torch_xla's GSPMD (TPUs)."""
