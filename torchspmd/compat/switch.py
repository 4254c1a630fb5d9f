"""Turning ``--xla-compat`` on in a process (``install``): the import finder, the ``'xla'``
device, the ``'xla'`` process-group backend and ``xla://`` init method, transformers' Trainer,
and the torch_xla engine left out of the engine choice."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from torchspmd import engines
from torchspmd.compat import _device, manifest, process_group, stand_ins
from torchspmd.compat.names import PREFIXES, message
from torchspmd.mesh import Mesh
from torchspmd.patches import dtensor as dtensor_patches
from torchspmd.patches import imports as import_patches
from torchspmd.patches import transformers as transformers_patches

__all__ = ["install", "active", "real_torch_xla", "ENV_ACTIVE"]

ENV_ACTIVE = "TORCHSPMD_XLA_COMPAT"  # set in processes running under the switch (and their children)
_STATE = {"installed": False, "real": None}


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


class _StandInLoader(importlib.abc.Loader):
    """Makes a module of torch_xla's that the layer has no file for (``stand_ins.module``)."""

    def create_module(self, spec):
        return stand_ins.module(spec.name)

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
        for prefix, ours in PREFIXES.items():
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
        try:
            target_spec = importlib.util.find_spec(target)
        except ModuleNotFoundError:  # (a parent the layer has no file for)
            target_spec = None
        if target_spec is not None:
            # (a package of torch_xla's may be one file of the layer's: its submodules are then made of
            # stand-ins and the names the layer provides)
            package = target_spec.submodule_search_locations is not None or \
                (manifest.has_module(fullname) and manifest.is_package(fullname))
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target), is_package=package)
        if manifest.has_module(fullname) or manifest.is_private_module(fullname):
            # torch_xla's module, the layer has no file for: made of stand-ins
            return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=manifest.is_package(fullname))
        if fullname.startswith("torch_xla.") and not manifest.is_private_module(fullname):
            return None  # a module torch_xla does not have: ModuleNotFoundError, as torch_xla gives
        raise ModuleNotFoundError(message(fullname), name=fullname)


def _patch_trainer_module(module) -> None:
    """transformers.trainer has just been loaded: its ``Trainer`` becomes torchspmd's
    subclass (stock behaviour unless the FSDPv2 arguments are given), so ``transformers.
    Trainer``, trl's ``SFTTrainer`` and user subclasses train sharded as ``torchspmd.hf.
    Trainer`` does (``torchspmd.patches.transformers.TRAINER_CLASS``)."""
    ours = sys.modules.get("torchspmd.hf.trainer")
    if ours is not None and not hasattr(ours, "Trainer"):
        # torchspmd.hf.trainer is being imported (it loaded transformers.trainer): done at its end
        transformers_patches.replace_trainer_once_defined()
        return
    from torchspmd.hf import trainer as ours

    transformers_patches.replace_trainer(module, ours.Trainer)


def _announce_shadowing(spec) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    where = os.path.dirname(spec.origin) if spec and spec.origin else "?"
    print(f"torchspmd --xla-compat: torch_xla is installed ({where}) and is shadowed in this run: `import "
          f"torch_xla` resolves to torchspmd on PyTorch's engine. To run on torch_xla itself, start the "
          f"program without --xla-compat.", file=sys.stderr, flush=True)


def _xla_redistribute_mesh(mesh, t, placements):
    """``sharded.redistribute(xs_mesh, placements)``, torch_xla's ``XLAShardedTensor.redistribute``:
    its argument checks (with its exception types), then the mesh's DeviceMesh."""
    if not isinstance(mesh, Mesh):
        return None
    from torch.distributed.tensor import Partial, Shard

    if placements is not None:
        if len(placements) != len(mesh.mesh_shape):
            raise ValueError(f"Number of placements ({len(placements)}) must match mesh dimensions "
                             f"({len(mesh.mesh_shape)})")
        for p in placements:
            if isinstance(p, Partial):
                raise NotImplementedError(  # by design: torch_xla refuses it too
                    "Partial placement is not supported by XLAShardedTensor.redistribute (torch_xla's rule); use "
                    "Shard or Replicate placements instead")
            if isinstance(p, Shard) and not -t.dim() <= p.dim < t.dim():
                raise IndexError(f"Shard dimension {p.dim} is out of bounds for tensor with {t.dim()} dimensions")
    return mesh.device_mesh


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
    import_patches.add_finder(_Finder())
    engines.exclude("xla", "under --xla-compat, torch_xla is torchspmd's layer: the program runs on the native "
                           "engine (start it without --xla-compat to run on torch_xla)")
    _STATE["installed"] = True
    _device.install()
    process_group.install()
    dtensor_patches.redistribute_to_meshes(_xla_redistribute_mesh)
    if "transformers.trainer" in sys.modules:
        _patch_trainer_module(sys.modules["transformers.trainer"])
