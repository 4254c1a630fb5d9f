"""``--xla-compat``: torch_xla SPMD programs, unchanged, on torchspmd's native engine.

In a process started with the switch (``torchspmd run --xla-compat``, ``python -m
torchspmd.compat script.py``, ``torchrun ... -m torchspmd.compat script.py``), ``install()``
puts an import finder first on ``sys.meta_path``: ``torch_xla`` and its submodules, and
``optimum.tpu``, resolve to the modules under ``torchspmd/compat/torch_xla/`` and
``torchspmd/compat/optimum_tpu/``; the string device ``'xla'`` means this process's native
device (``_device.py``); transformers and accelerate are told that torch_xla is absent
(``USE_TORCH_XLA=0``, both libraries' documented switch), and ``transformers.Trainer`` is
torchspmd's (``torchspmd.hf.Trainer``) so that stock trainers given the FSDPv2 arguments
train sharded.

Nothing happens in a process without the switch: importing this package installs nothing.
Names the layer does not provide raise ``NotProvidedError`` naming the API and, where one
exists, the torchspmd (or PyTorch) equivalent. docs/xla_compat.md lists every name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from torchspmd._errors import SpmdError

__all__ = ["install", "active", "NotProvidedError", "NotProvidedAttributeError", "not_provided", "real_torch_xla"]

ENV_ACTIVE = "TORCHSPMD_XLA_COMPAT"  # set in processes running under the switch (and their children)
_PREFIXES = {"torch_xla": "torchspmd.compat.torch_xla", "optimum.tpu": "torchspmd.compat.optimum_tpu"}
_STATE = {"installed": False, "real": None}

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
    return (NotProvidedError if imported else NotProvidedAttributeError)(_message(api))


def _message(api: str) -> str:
    eq = EQUIVALENTS.get(api)
    text = (f"{api} is not provided under --xla-compat (torchspmd runs torch_xla SPMD programs on PyTorch's "
            f"engine; docs/xla_compat.md lists what is)")
    return text + (f"; use {eq} instead" if eq else "")


def not_provided(module: str, provided=()):
    """A module ``__getattr__`` raising ``NotProvidedError`` for public names (private
    and dunder names stay plain ``AttributeError``: probes such as ``hasattr(m, '__path__')``
    must keep working)."""

    real = next(ours + module[len(p):] for p, ours in _PREFIXES.items() if module == p or module.startswith(p + "."))

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


def active() -> bool:
    """Whether this process runs under ``--xla-compat``."""
    return _STATE["installed"]


def real_torch_xla():
    """The spec of an installed torch_xla (found past the layer), or None."""
    return importlib.machinery.PathFinder.find_spec("torch_xla")


class _AliasLoader(importlib.abc.Loader):
    """Loads the alias as the very module object of its target."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _PatchLoader(importlib.abc.Loader):
    """The real loader of a module, then a patch on the loaded module."""

    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        for prefix, ours in _PREFIXES.items():
            if fullname == prefix or fullname.startswith(prefix + "."):
                return self._alias(fullname, ours + fullname[len(prefix):])
        if fullname == "optimum" and importlib.machinery.PathFinder.find_spec("optimum") is None:
            # optimum itself is not installed: an empty namespace for optimum.tpu (no __file__, no
            # version: transformers' version probe keeps taking optimum for absent)
            return importlib.machinery.ModuleSpec("optimum", None, is_package=True)
        if fullname == "transformers.trainer":
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchLoader(spec.loader, _patch_trainer_module)
            return spec
        return None

    @staticmethod
    def _alias(fullname: str, target: str):
        if importlib.util.find_spec(target) is None:
            api = fullname
            raise ModuleNotFoundError(_message(api), name=fullname)
        target_spec = importlib.util.find_spec(target)
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(target),
                                              is_package=target_spec.submodule_search_locations is not None)
        return spec


def _patch_trainer_module(module) -> None:
    """transformers.trainer has just been loaded: its ``Trainer`` becomes torchspmd's
    subclass (stock behaviour unless the FSDPv2 arguments are given), so ``transformers.
    Trainer``, trl's ``SFTTrainer`` and user subclasses train sharded as ``torchspmd.hf.
    Trainer`` does."""
    ours = sys.modules.get("torchspmd.hf.trainer")
    if ours is not None and not hasattr(ours, "Trainer"):
        return  # torchspmd.hf.trainer is being imported (it loaded transformers.trainer): it patches at its end
    from torchspmd.hf import trainer as ours

    original = module.Trainer
    if original is ours.Trainer:
        return
    module.Trainer = ours.Trainer
    top = sys.modules.get("transformers")
    if top is not None and top.__dict__.get("Trainer") is original:  # resolved and kept by the lazy module
        top.Trainer = ours.Trainer
    for sub in list(original.__subclasses__()):  # defined before the patch (none in the usual order)
        if sub is not ours.Trainer:
            sub.__bases__ = tuple(ours.Trainer if b is original else b for b in sub.__bases__)


def _announce_shadowing(spec) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    where = os.path.dirname(spec.origin) if spec and spec.origin else "?"
    print(f"torchspmd --xla-compat: torch_xla is installed ({where}) and is shadowed in this run: `import "
          f"torch_xla` resolves to torchspmd on PyTorch's engine. To run on torch_xla itself, start the "
          f"program without --xla-compat.", file=sys.stderr, flush=True)


def install() -> None:
    """Turn the layer on in this process (idempotent). Call it before the program imports
    torch_xla, transformers or accelerate."""
    if _STATE["installed"]:
        return
    real = real_torch_xla()
    _STATE["real"] = real
    if real is not None:
        _announce_shadowing(real)
    # transformers and accelerate read this when imported: their torch_xla code paths stay off.
    os.environ["USE_TORCH_XLA"] = "0"
    os.environ[ENV_ACTIVE] = "1"
    for name in [n for n in sys.modules if n == "torch_xla" or n.startswith("torch_xla.")]:
        del sys.modules[name]  # a real torch_xla imported before the switch: drop it from the cache
    sys.meta_path.insert(0, _Finder())
    _STATE["installed"] = True
    from torchspmd.compat import _device

    _device.install()
    if "transformers.trainer" in sys.modules:
        _patch_trainer_module(sys.modules["transformers.trainer"])
