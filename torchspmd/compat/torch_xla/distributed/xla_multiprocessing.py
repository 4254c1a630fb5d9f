"""``torch_xla.distributed.xla_multiprocessing`` (``xmp``) under ``--xla-compat``: its
multi-process mode is not SPMD and is not provided; ``spawn`` says what to do instead."""

from torchspmd.compat.names import NotProvidedError, message, not_provided


def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method="spawn"):
    raise NotProvidedError(message("torch_xla.distributed.xla_multiprocessing.spawn"))


__getattr__ = not_provided("torch_xla.distributed.xla_multiprocessing")
