"""What the ``--xla-compat`` layer does not provide: the error, and each API's equivalent.

A module of the layer ends with ``__getattr__ = not_provided("torch_xla.x")``: a public name
it lacks raises ``NotProvidedError`` (from ``from m import name``) or
``NotProvidedAttributeError`` (a lookup), naming the API and, where one exists, the
torchspmd (or PyTorch) equivalent.
"""

from __future__ import annotations

import importlib.util
import sys

from torchspmd.errors import SpmdError

__all__ = ["NotProvidedError", "NotProvidedAttributeError", "missing", "message", "not_provided", "EQUIVALENTS",
           "PREFIXES"]

#: the modules the layer answers for, and where its own live
PREFIXES = {"torch_xla": "torchspmd.compat.torch_xla", "optimum.tpu": "torchspmd.compat.optimum_tpu"}

# What to use instead of a torch_xla API that the layer does not provide.
EQUIVALENTS = {
    "torch_xla.launch": "SPMD: call torch_xla.runtime.use_spmd() and start the program with "
                        "`torchspmd run --xla-compat --nproc N script.py`",
    "torch_xla.distributed.xla_multiprocessing": "SPMD: call torch_xla.runtime.use_spmd() and start the program "
                                                 "with `torchspmd run --xla-compat --nproc N script.py`",
    "torch_xla.distributed.xla_multiprocessing.spawn": "SPMD: call torch_xla.runtime.use_spmd() and start the "
                                                       "program with `torchspmd run --xla-compat --nproc N script.py`",
    "torch_xla.core.xla_model.all_reduce": "annotate shardings (xs.mark_sharding): the engine inserts the "
                                           "collectives; or torch.distributed.all_reduce",
    "torch_xla.core.xla_model.all_gather": "xs.mark_sharding / clear_sharding; or torch.distributed.all_gather",
    "torch_xla.core.xla_model.reduce_scatter": "annotate shardings (xs.mark_sharding); or "
                                               "torch.distributed.reduce_scatter_tensor",
    "torch_xla.core.xla_model.reduce_gradients": "nothing: under SPMD gradients are already those of the "
                                                 "global batch",
    "torch_xla.core.xla_model.set_rng_state": "torch.manual_seed(seed) (every process draws alike after "
                                              "use_spmd)",
    "torch_xla.core.xla_model.get_rng_state": "torch.get_rng_state() / torch.initial_seed()",
    "torch_xla.distributed.spmd.XLAShardedTensor": "torch.distributed.tensor.DTensor (what xs.mark_sharding "
                                                   "returns here)",
    "torch_xla.distributed.spmd.wrap_as_sharded_tensor": "xs.mark_sharding (it returns the sharded tensor)",
    "torch_xla.core.xla_model.mesh_reduce": "plain tensor arithmetic on global values (the program sees one "
                                            "device)",
    "torch_xla.distributed.parallel_loader.ParallelLoader": "torch_xla.distributed.parallel_loader.MpDeviceLoader",
    "torch_xla.distributed.fsdp.XlaFullyShardedDataParallel":
        "torch_xla.experimental.spmd_fully_sharded_data_parallel.SpmdFullyShardedDataParallel (FSDPv2)",
    "torch_xla.debug.profiler.trace": "torch_xla.debug.profiler.start_trace(log_dir) / stop_trace() (no profiler "
                                      "server runs here)",
    "torch_xla.runtime.use_spmd(auto=True)": "annotations (xs.mark_sharding) or FSDPv2: auto-sharding is the XLA "
                                             "compiler's",
    "torch_xla.amp.syncfree": "the torch.optim optimizers",
    "torch_xla.amp.GradScaler": "torch.amp.GradScaler",
    "torch_xla.distributed.xla_backend": "torch.distributed with the 'gloo' / 'nccl' backends (torchspmd "
                                         "starts them)",
}


class NotProvidedError(SpmdError, ImportError):
    """A torch_xla API that ``--xla-compat`` does not provide. (An ``ImportError``, so that
    ``from torch_xla.x import y`` reports it as is.)"""


class NotProvidedAttributeError(SpmdError, AttributeError):
    """The same, for a name looked up rather than imported: an ``AttributeError``, so that
    ``hasattr(xs, name)`` is False and ``getattr(xs, name, default)`` gives the default, as
    for a name torch_xla lacks. (``from m import name`` turns an ``AttributeError`` into a
    bare "cannot import name", which is why the import form raises ``NotProvidedError``.
    Python allows no class that is both.)"""


def missing(api: str) -> SpmdError:
    """The error for ``api``, looked up by the ``__getattr__`` that calls this: a
    ``NotProvidedError`` when the lookup serves ``from m import name`` (the caller's frame is
    at ``IMPORT_FROM``), else a ``NotProvidedAttributeError``."""
    import dis

    try:
        frame = sys._getframe(2)  # (0: here, 1: the __getattr__, 2: the code that looked the name up)
        imported = dis.opname[frame.f_code.co_code[frame.f_lasti]] == "IMPORT_FROM"
    except (AttributeError, IndexError, ValueError):
        imported = True
    return (NotProvidedError if imported else NotProvidedAttributeError)(message(api))


def message(api: str) -> str:
    eq = EQUIVALENTS.get(api)
    text = (f"{api} is not provided under --xla-compat (torchspmd runs torch_xla SPMD programs on PyTorch's "
            f"engine; docs/xla_compat.md lists what is)")
    return text + (f"; use {eq} instead" if eq else "")


def not_provided(module: str, provided=()):
    """A module ``__getattr__`` raising ``NotProvidedError`` for public names (private
    and dunder names stay plain ``AttributeError``: probes such as ``hasattr(m, '__path__')``
    must keep working)."""

    real = next(ours + module[len(p):] for p, ours in PREFIXES.items() if module == p or module.startswith(p + "."))

    def __getattr__(name: str):
        if name.startswith("_") or _is_module(f"{real}.{name}"):
            # (a submodule not imported yet: the import system asks before loading it)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise missing(f"{module}.{name}")

    return __getattr__


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError, ValueError):
        return False
