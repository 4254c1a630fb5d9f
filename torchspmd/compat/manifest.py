"""torch_xla's public modules and names, as ``--xla-compat`` answers for them.

``xla_manifest.json`` (beside this file) is written by ``tools/xla_manifest.py`` from an
installed torch_xla (2.9.0): every public module of its Python tree and ``torch_xla._XLAC``,
whether it is a package, and each name a program can import from it with its kind
(``function``, ``class``, ``constant`` with torch_xla's value, ``object``) and, for functions
and classes, its origin (where torch_xla defines the object; one object may be importable
under several modules' names)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["FILE", "Entry", "version", "modules", "has_module", "is_package", "is_private_module", "import_error",
           "names", "entry", "aliases"]

FILE = Path(__file__).with_name("xla_manifest.json")
ROOT = "torch_xla"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One name of a torch_xla module: ``kind`` is ``'function'``, ``'class'``, ``'constant'``
    (``value`` is torch_xla's) or ``'object'``; ``origin`` is where torch_xla defines it."""

    kind: str
    origin: str | None = None
    value: Any = None


def _entry(raw: list) -> Entry:
    kind = raw[0]
    if kind == "constant":
        value = raw[1]
        if len(raw) > 2 and raw[2] == "tuple":
            value = tuple(value)
        return Entry("constant", value=value)
    return Entry(kind, origin=raw[1] if len(raw) > 1 else None)


@functools.lru_cache(maxsize=None)
def _data() -> dict:
    with open(FILE, encoding="utf-8") as f:
        raw = json.load(f)
    modules = {name: {"package": m["package"], "import_error": m.get("import_error"),
                      "names": {n: _entry(e) for n, e in m["names"].items()}}
               for name, m in raw["modules"].items()}
    by_origin: dict[str, list[tuple[str, str]]] = {}
    for module, m in modules.items():
        for name, e in m["names"].items():
            if e.origin:
                by_origin.setdefault(e.origin, []).append((module, name))
    return {"version": raw["torch_xla"], "modules": modules, "private": frozenset(raw["private_modules"]),
            "by_origin": by_origin}


def version() -> str:
    """The torch_xla version the manifest describes."""
    return _data()["version"]


def modules() -> list[str]:
    """torch_xla's public modules (and ``torch_xla._XLAC``), sorted."""
    return sorted(_data()["modules"])


def has_module(module: str) -> bool:
    return module in _data()["modules"]


def is_package(module: str) -> bool:
    if module in _data()["private"]:  # (private modules are listed by name only)
        return any(m.startswith(module + ".") for m in _data()["private"])
    return _data()["modules"][module]["package"]


def is_private_module(module: str) -> bool:
    """A module of torch_xla's tree whose names the manifest does not record (``torch_xla._internal``...)."""
    return module in _data()["private"]


def import_error(module: str) -> str | None:
    """Why torch_xla itself could not import ``module`` where the manifest was written (its
    optional dependencies: jax, tensorflow); its names were read from its source."""
    return _data()["modules"][module]["import_error"]


def names(module: str) -> dict[str, Entry]:
    """The names a program can import from ``module`` (empty for a module torch_xla lacks)."""
    m = _data()["modules"].get(module)
    return dict(m["names"]) if m else {}


def entry(module: str, name: str) -> Entry | None:
    m = _data()["modules"].get(module)
    return m["names"].get(name) if m else None


def aliases(module: str, name: str) -> list[tuple[str, str]]:
    """The other (module, name) pairs torch_xla gives the same object under."""
    e = entry(module, name)
    if e is None or not e.origin:
        return []
    return [pair for pair in _data()["by_origin"].get(e.origin, []) if pair != (module, name)]
