"""What a torch_xla name resolves to under ``--xla-compat`` when the layer's module does not
define it.

Every name of torch_xla's public modules (``torchspmd.compat.manifest``) imports, so that a
program's imports succeed as on torch_xla; what the layer does not provide fails where it is
used, with ``NotProvidedError`` naming the API and its equivalent:

- a function is a stand-in that raises when called;
- a class is a stand-in class: ``isinstance(x, C)`` is False and subclassing works; creating an
  instance (of it or of a subclass) raises, and so does reading a class attribute;
- any other object raises when called or when an attribute is read;
- a constant is torch_xla's value (provided as it is).

Before a stand-in, a name resolves to the object the layer provides under another of
torch_xla's names for the same object (``torch_xla.distributed.spmd.api.Mesh`` is
``xs.Mesh``). A name torch_xla does not have raises the ``AttributeError`` /
``ImportError`` torch_xla would.

A module of the layer ends with ``__getattr__ = not_provided("torch_xla.x")``; a module of
torch_xla that the layer has no file for is made by ``module(name)``."""

from __future__ import annotations

import abc
import functools
import importlib
import importlib.util
import types

from torchspmd.compat import manifest
from torchspmd.compat.names import PREFIXES, NotProvidedAttributeError, NotProvidedError, message, missing

__all__ = ["not_provided", "module", "function", "class_", "object_", "api_of", "layer_module", "own_module",
           "defined", "resolve", "StandInClass"]

_API = "__torchspmd_not_provided__"  # the attribute naming a stand-in's API


def api_of(obj) -> str | None:
    """The API a stand-in stands for; None for anything else."""
    try:
        api = object.__getattribute__(obj, _API) if not isinstance(obj, type) else obj.__dict__.get(_API)
    except AttributeError:
        return None
    return api if isinstance(api, str) else None


def _split(api: str) -> tuple[str, str]:
    module, _, name = api.rpartition(".")
    return module, name


def function(api: str):
    """A function that raises ``NotProvidedError`` for ``api`` when called."""
    module, name = _split(api)

    def stand_in(*args, **kwargs):
        raise NotProvidedError(message(api))

    stand_in.__name__ = name
    stand_in.__qualname__ = name
    stand_in.__module__ = module
    stand_in.__doc__ = f"{api}: not provided under --xla-compat (raises NotProvidedError when called)."
    setattr(stand_in, _API, api)
    return stand_in


class StandInClass(abc.ABCMeta):
    """The type of a stand-in class: creating an instance raises ``NotProvidedError`` (for a
    subclass too, naming the stand-in it derives from), a class attribute it lacks
    ``NotProvidedAttributeError``. (An ``ABCMeta``, so that a program's class may derive
    from a stand-in and an abstract class together.)"""

    def __call__(cls, *args, **kwargs):
        raise NotProvidedError(message(_class_api(cls)))

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotProvidedAttributeError(message(f"{_class_api(cls)}.{name}"))


def _class_api(cls) -> str:
    for klass in cls.__mro__:
        api = klass.__dict__.get(_API)
        if isinstance(api, str):
            return api
    return f"{cls.__module__}.{cls.__qualname__}"


def class_(api: str) -> type:
    """A class standing for ``api``: importable, subclassable, never instantiated."""
    module, name = _split(api)
    return StandInClass(name, (), {_API: api, "__module__": module, "__qualname__": name,
                                   "__doc__": f"{api}: not provided under --xla-compat (creating one raises "
                                              f"NotProvidedError)."})


class _StandInObject:
    """An object standing for an API: calling it or reading an attribute raises."""

    def __init__(self, api: str):
        object.__setattr__(self, _API, api)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotProvidedAttributeError(message(f"{object.__getattribute__(self, _API)}.{name}"))

    def __call__(self, *args, **kwargs):
        raise NotProvidedError(message(object.__getattribute__(self, _API)))

    def __getitem__(self, key):
        raise NotProvidedError(message(object.__getattribute__(self, _API)))

    def __iter__(self):
        raise NotProvidedError(message(object.__getattribute__(self, _API)))

    def __repr__(self) -> str:
        return f"<{object.__getattribute__(self, _API)}: not provided under --xla-compat>"


def object_(api: str):
    return _StandInObject(api)


_MAKERS = {"function": function, "class": class_, "object": object_}


@functools.lru_cache(maxsize=None)
def _stand_in(api: str, kind: str):
    return _MAKERS[kind](api)


def layer_module(module: str) -> str | None:
    """The name of the layer's own module for torch_xla's ``module`` (whether or not it exists)."""
    for prefix, ours in PREFIXES.items():
        if module == prefix or module.startswith(prefix + "."):
            return ours + module[len(prefix):]
    return None


def _has_file(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError, ValueError):  # (ModuleNotFoundError: a parent without a file)
        return False


def own_module(module: str) -> types.ModuleType | None:
    """The layer's own module (a file under ``torchspmd/compat/``) for torch_xla's ``module``, or
    None where the layer has no file for it."""
    ours = layer_module(module)
    if ours is None or not _has_file(ours):
        return None
    return importlib.import_module(ours)


def defined(module: str, name: str):
    """What the layer's own file for torch_xla's ``module`` defines as ``name`` (not a stand-in),
    or None."""
    own = own_module(module)
    value = vars(own).get(name) if own is not None else None
    return None if value is None or api_of(value) is not None else value


def resolve(module: str, name: str):
    """``module.name`` for a name the layer's module does not define: the object provided under
    another of torch_xla's names for it, torch_xla's constant, or a stand-in. Raises
    ``AttributeError`` for a name torch_xla's module does not have."""
    entry = manifest.entry(module, name)
    if entry is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if entry.kind == "constant":
        return entry.value
    for other_module, other_name in manifest.aliases(module, name):
        value = defined(other_module, other_name)
        if value is not None:
            return value
    return _stand_in(f"{module}.{name}", entry.kind)


def not_provided(module: str):
    """The ``__getattr__`` of the layer's module for ``module``: torch_xla's names it does not
    define resolve as this module's docstring says; names torch_xla lacks raise
    ``AttributeError``. For a module outside torch_xla's manifest (``optimum.tpu``), a public
    name raises ``NotProvidedError`` / ``NotProvidedAttributeError`` naming it."""
    described = manifest.has_module(module)
    private = manifest.is_private_module(module)
    ours = layer_module(module)

    def __getattr__(name: str):
        if private:  # (torch_xla's private module, names unrecorded: any public name is a stand-in)
            if name.startswith("__") or manifest.is_private_module(f"{module}.{name}"):
                raise AttributeError(f"module {module!r} has no attribute {name!r}")
            return _stand_in(f"{module}.{name}", "object")
        if described:
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(f"module {module!r} has no attribute {name!r}")
            return resolve(module, name)
        if name.startswith("_") or _has_file(f"{ours}.{name}"):
            # (a submodule not imported yet: the import system asks before loading it)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise missing(f"{module}.{name}")

    return __getattr__


def module(name: str) -> types.ModuleType:
    """torch_xla's module ``name``, which the layer has no file for: torch_xla's constants, the
    objects the layer provides under torch_xla's other names for them, stand-ins for the rest.
    torch_xla's private modules (``torch_xla._internal.tpu``, which its tests import) are made
    of stand-ins for whatever public name is asked."""
    mod = types.ModuleType(name, f"{name} under --xla-compat: torch_xla's names, each a stand-in that raises "
                                 f"NotProvidedError when used, except its constants and what the layer provides "
                                 f"under another name (docs/xla_compat.md)")
    if manifest.is_package(name):
        mod.__path__ = []  # (its submodules are found by the layer's import finder)
    for attribute, entry in manifest.names(name).items():
        if entry.kind == "constant":
            setattr(mod, attribute, entry.value)
    mod.__getattr__ = not_provided(name)
    return mod
