"""Every change torchspmd makes to another library's objects, in one place.

A ``Patch`` says what it changes and why, the versions it was checked on, and the names it
touches; ``apply`` checks that those names still exist (else a ``PatchUnavailable`` naming the
library's version and the feature that needs it), makes the change and records how to undo
it; ``remove`` undoes it; ``active()`` lists what this process has applied (``torchspmd
info``). Nothing is applied by ``import torchspmd``: ``use_spmd()`` applies the native
engine's, ``--xla-compat`` its own, and a few are held only for the length of a call
(``applied``).

The modules: ``torch`` (nn.Module, optimizers, Tensor methods), ``dtensor``
(torch.distributed.tensor), ``fsdp`` (FSDP2), ``elastic`` (torchelastic), ``transformers``,
``accelerate``, ``imports`` (Python's import system, for ``--xla-compat``).
A patch's new behaviour is its caller's; this package holds the mechanics, so that each
change to a library object is made, checked and undone the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
from typing import Any, Callable, Iterator

from torchspmd.errors import SpmdError

__all__ = ["Patch", "PatchUnavailable", "apply", "remove", "remove_all", "applied", "active", "is_active",
           "resolve", "replace_attribute"]


class PatchUnavailable(SpmdError, RuntimeError):
    """A patch's targets are missing on the installed version of its library."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to another library's objects."""

    name: str
    library: str  # the distribution: torch, transformers, ...
    what: str  # what it changes
    why: str  # why (the upstream issue or PR, where there is one)
    checked: str  # the library versions it was checked on
    feature: str  # the torchspmd feature that needs it (named in PatchUnavailable)
    targets: tuple[str, ...] = ()  # dotted names that must exist: "module:attribute.path"

    def check(self) -> None:
        for target in self.targets:
            try:
                resolve(target)
            except (ImportError, AttributeError) as e:
                raise PatchUnavailable(
                    f"{self.feature} needs {target} ({self.what}), which {self.library} {version(self.library)} "
                    f"does not have ({type(e).__name__}: {e}); torchspmd's patch {self.name!r} was checked on "
                    f"{self.library} {self.checked}: install one of those versions") from None


def version(library: str) -> str:
    if library == "python":
        import platform

        return platform.python_version()
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def resolve(target: str) -> Any:
    """The object a ``"module:attribute.path"`` target names."""
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


_ACTIVE: dict[str, tuple[Patch, list[Callable[[], None]]]] = {}


def apply(patch: Patch, install: Callable[[], Callable[[], None] | None]) -> bool:
    """Check ``patch`` and run ``install``, which makes the change and returns its undo.
    Applying an active patch again does nothing (returns False)."""
    if patch.name in _ACTIVE:
        return False
    patch.check()
    undo = install()
    _ACTIVE[patch.name] = (patch, [undo] if undo is not None else [])
    return True


def remove(name: str) -> None:
    """Undo patch ``name`` (nothing if it is not active)."""
    entry = _ACTIVE.pop(name, None)
    if entry is not None:
        for undo in reversed(entry[1]):
            undo()


def remove_all() -> None:
    for name in list(reversed(_ACTIVE)):
        remove(name)


def is_active(name: str) -> bool:
    return name in _ACTIVE


def active() -> list[Patch]:
    """The patches applied in this process, in the order they were applied."""
    return [patch for patch, _ in _ACTIVE.values()]


@contextlib.contextmanager
def applied(patch: Patch, install: Callable[[], Callable[[], None] | None]) -> Iterator[None]:
    """``patch`` for the length of a ``with`` block (a no-op where it is active already)."""
    fresh = apply(patch, install)
    try:
        yield
    finally:
        if fresh:
            remove(patch.name)


def replace_attribute(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``owner.name = value``; returns what puts the old value back (or deletes an
    attribute the owner did not have)."""
    had = name in vars(owner) if hasattr(owner, "__dict__") else hasattr(owner, name)
    old = vars(owner).get(name) if hasattr(owner, "__dict__") else getattr(owner, name, None)
    setattr(owner, name, value)

    def undo() -> None:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)

    return undo


MODULES = ("torch", "dtensor", "fsdp", "elastic", "transformers", "accelerate", "imports")


def catalogue() -> list[Patch]:
    """Every patch torchspmd defines (whether applied or not), module by module."""
    out = []
    for name in MODULES:
        module = importlib.import_module(f"torchspmd.patches.{name}")
        out += [v for v in vars(module).values() if isinstance(v, Patch)]
    return out


def markdown() -> str:
    """The catalogue as the table of docs/patches.md (``python -m torchspmd.patches``)."""
    rows = ["| patch | library (checked on) | what it changes | why | needed by |", "|---|---|---|---|---|"]
    for p in catalogue():
        cells = [p.name, f"{p.library} ({p.checked})", p.what, p.why, p.feature]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
