"""The engine registry: which engine a program runs on.

Engines are peers behind one interface (``torchspmd.engines.base.Engine``): the native engine
(PyTorch's DeviceMesh, DTensor, FSDP2, c10d; backends ``cpu``, ``cuda`` and any other
accelerator PyTorch knows) and the torch_xla
engine (backend ``xla``). ``use_spmd()`` chooses one (``choose``) and starts it (``start``);
the public API then asks ``current()``.

The choice: ``use_spmd(backend=...)``, else ``$TORCHSPMD_BACKEND``, else the first engine,
in registration order, whose environment asks for it (torch_xla's: ``PJRT_DEVICE`` set and
torch_xla installed), else the native engine (``cuda`` when available, else ``cpu``).
"""

from __future__ import annotations

import os

from torchspmd import device_plugins
from torchspmd.engines.base import Capabilities, Engine
from torchspmd.engines.native.engine import NativeEngine
from torchspmd.engines.xla.engine import XlaEngine, installed
from torchspmd.errors import SpmdError

__all__ = ["Engine", "Capabilities", "register", "registered", "exclude", "choose", "start", "current",
           "started", "planned", "counts_as", "ENV_BACKEND"]

ENV_BACKEND = "TORCHSPMD_BACKEND"  # cpu | cuda | xla

_ENGINES: list[Engine] = []
_EXCLUDED: dict[str, str] = {}  # engine name -> why it is not used in this process
_CURRENT: list[Engine] = []  # the started engine (at most one)
_PUBLIC: list[tuple[type, str]] = []  # public classes an engine's own classes count as


def xla_installed() -> bool:
    """torch_xla is installed (whether or not this process may use it)."""

    return installed()


def register(engine: Engine, first: bool = False) -> None:
    """Add an engine (``first``: before the others when the environment is asked)."""
    if any(e.name == engine.name for e in _ENGINES):
        raise SpmdError(f"an engine named {engine.name!r} is registered already")
    _ENGINES.insert(0 if first else len(_ENGINES), engine)


def registered() -> list[Engine]:
    return list(_ENGINES)


def exclude(name: str, why: str) -> None:
    """Leave engine ``name`` out of this process's choice (``--xla-compat``: the program's
    ``torch_xla`` is torchspmd's layer, so the torch_xla engine cannot be)."""
    _EXCLUDED[name] = why


def backends() -> tuple[str, ...]:
    """Every backend name some engine serves, sorted."""
    return tuple(sorted(b for e in _ENGINES for b in e.backends))


def serving(backend: str) -> Engine | None:
    """The engine listing ``backend``, else the first that serves it (the native engine: any
    device type PyTorch has a module for)."""
    for engine in _ENGINES:
        if backend in engine.backends:
            return engine
    return next((e for e in _ENGINES if e.serves(backend)), None)


def choose(requested: str | None = None) -> tuple[Engine, str]:
    """The engine and backend ``use_spmd(backend=requested)`` would start (nothing is started)."""
    name = requested or os.environ.get(ENV_BACKEND) or None
    if name is None:
        for engine in _ENGINES:
            if engine.name in _EXCLUDED:
                continue
            backend = engine.default_backend()
            if backend is not None:
                return engine, backend
        raise SpmdError("no engine can run here")  # (the native engine always can)
    name = name.lower()
    where = f"use_spmd(backend={name!r})" if requested else f"{ENV_BACKEND}={name}"
    engine = serving(name)
    if engine is None:
        plugins = device_plugins.installed()
        found = ""
        if plugins and os.environ.get(device_plugins.AUTOLOAD, "1") == "0":
            found = f"; the device plugins installed ({'; '.join(plugins)}) are not loaded ({device_plugins.AUTOLOAD}=0)"
        elif plugins:
            found = (f"; the device plugins installed ({'; '.join(plugins)}) registered no {name!r} device (a plugin "
                     f"may register its device only where it finds the hardware: torch-tpu only on a machine with a "
                     f"TPU chip)")
        raise SpmdError(f"{where}: unknown backend; choose one of {', '.join(backends())}, or a device type PyTorch "
                        f"has a module for (torch.get_device_module), or leave it unset to pick the accelerator "
                        f"PyTorch finds, else cpu{found}")
    if engine.name in _EXCLUDED:
        raise SpmdError(f"{where}: {_EXCLUDED[engine.name]}")
    why = engine.usable(name, where, explicit=bool(requested))
    if why:
        raise SpmdError(why)
    return engine, name


def start(engine: Engine, backend: str, *, auto: bool, num_devices: int | None):
    """Start ``engine`` on ``backend`` (``use_spmd``); returns this process's device."""
    device = engine.start(backend, auto=auto, num_devices=num_devices)
    _CURRENT[:] = [engine]
    for public, kind in _PUBLIC:
        _register_own(engine, public, kind)
    return device


def counts_as(public: type, kind: str) -> None:
    """The started engine's own class for ``kind`` ('Mesh', 'ShardingSpec', ...) is a
    virtual subclass of ``public`` (an ABC): ``isinstance(engine_object, public)`` holds."""
    _PUBLIC.append((public, kind))
    if _CURRENT:
        _register_own(_CURRENT[0], public, kind)


def _register_own(engine: Engine, public: type, kind: str) -> None:
    own = engine.own_class(kind)
    for cls in own if isinstance(own, tuple) else (own,) if own is not None else ():
        if not issubclass(cls, public):
            public.register(cls)


def started() -> Engine | None:
    """The engine ``use_spmd()`` started, or None."""
    return _CURRENT[0] if _CURRENT else None


def planned() -> Engine:
    """The engine in use, or the one ``use_spmd()`` would choose (for counts asked before it)."""
    return _CURRENT[0] if _CURRENT else choose(None)[0]


def current(api: str) -> Engine:
    """The started engine; ``api`` names the caller in the error when SPMD mode is off."""
    if not _CURRENT:
        raise SpmdError(f"{api} needs SPMD mode: call torchspmd.use_spmd() at the start of the program, before any "
                        f"sharded computation")
    return _CURRENT[0]


register(XlaEngine())
register(NativeEngine())
