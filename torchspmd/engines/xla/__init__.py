"""The torch_xla engine: every call handed to torch_xla (TPUs; its CPU client for tests)."""
