"""Every change torchspmd makes to another library's objects, in one place.

A ``Patch`` says what it changes and why, the range of library versions it was verified on
(a PEP 440 specifier, checked), whether correctness needs it or it only buys speed, and the
names (and, for private functions it replaces, the signatures) it touches. ``apply`` checks
all of that before it changes anything:

- inside the range, with every target present and every signature as verified, the change is
  made and its undo recorded;
- otherwise a patch that correctness needs raises ``PatchUnavailable`` naming the library, its
  version, the verified range and the feature (``use_spmd()`` checks the engine's patches
  before any step: ``verify``); a patch that only buys speed is not applied, its feature takes
  the library's own path, and one ``PatchSkippedWarning`` per process says which and why;
- ``TORCHSPMD_UNTESTED_VERSIONS=1`` applies patches outside their range anyway (a missing name
  or a changed signature still stops them): for trying a new release.

``remove`` undoes a patch; ``active()`` lists what this process has applied, ``skipped()`` what
it left out and why (``torchspmd info`` prints both). Nothing is applied by ``import
torchspmd``: ``use_spmd()`` applies the native engine's, ``--xla-compat`` its own, and a few
are held only for the length of a call (``applied``).

The modules: ``torch`` (nn.Module, optimizers, Tensor methods, the process's output and
warnings), ``dtensor`` (torch.distributed.tensor), ``fsdp`` (FSDP2), ``elastic``
(torchelastic), ``transformers``, ``accelerate``, ``imports`` (Python's import system, for
``--xla-compat``). A patch's new behaviour is its caller's; this package holds the mechanics,
so that each change to a library object is made, checked and undone the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import warnings
from typing import Any, Callable, Iterator, Mapping

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from torchspmd.errors import SpmdError

__all__ = ["Patch", "PatchUnavailable", "PatchSkippedWarning", "UNTESTED_VERSIONS", "apply", "remove",
           "remove_all", "applied", "active", "skipped", "skip", "is_active", "verify", "resolve",
           "replace_attribute", "parameters"]

#: ``TORCHSPMD_UNTESTED_VERSIONS=1``: apply patches on library versions outside their verified range.
UNTESTED_VERSIONS = "TORCHSPMD_UNTESTED_VERSIONS"


class PatchUnavailable(SpmdError, RuntimeError):
    """A patch that correctness needs cannot be applied on the installed version of its library."""


class PatchSkippedWarning(UserWarning):
    """A patch that only buys speed was not applied: its feature takes the library's own path."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to another library's objects."""

    name: str
    library: str  # the distribution: torch, transformers, ... ("python": the interpreter)
    what: str  # what it changes
    why: str  # why (the upstream issue or PR, where there is one)
    versions: str  # the verified range, a PEP 440 specifier: ">=2.13,<2.16"
    feature: str  # the torchspmd feature that needs it (named in PatchUnavailable)
    needed: bool = True  # False: it only buys speed; where it cannot apply, the feature falls back
    targets: tuple[str, ...] = ()  # dotted names that must exist: "module:attribute.path"
    #: target -> the parameter lists it was verified with (any one of them); a replaced private
    #: function's parameters, compared when the patch is applied
    signatures: Mapping[str, tuple[tuple[str, ...], ...]] = dataclasses.field(default_factory=dict)
    #: a further check of what targets and signatures cannot say (e.g. a shape that depends on
    #: the version): returns why the patch cannot apply, or None
    also: Callable[[], str | None] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        try:
            SpecifierSet(self.versions)
        except InvalidSpecifier:
            raise ValueError(f"patch {self.name!r}: versions={self.versions!r} is not a PEP 440 specifier "
                             "(e.g. '>=2.13,<2.16')") from None
        unknown = set(self.signatures) - set(self.targets)
        if unknown:
            raise ValueError(f"patch {self.name!r}: signatures of {sorted(unknown)} not among its targets")

    def in_range(self) -> bool:
        """Whether the installed library is inside the verified range (its local label, such
        as ``+cpu``, and pre-releases of the next version count as their release)."""
        return in_range(version(self.library), self.versions)

    def problem(self) -> str | None:
        """Why the patch cannot be applied here (None: it can)."""
        have = version(self.library)
        if not self.in_range() and os.environ.get(UNTESTED_VERSIONS) != "1":
            return (f"{self.library} {have} is outside the versions torchspmd's patch {self.name!r} was verified on "
                    f"({self.library}{self.versions}); {UNTESTED_VERSIONS}=1 applies it anyway")
        for target in self.targets:
            try:
                obj = resolve(target)
            except (ImportError, AttributeError) as e:
                return (f"{target} ({self.what}) is missing in {self.library} {have} ({type(e).__name__}: {e}); "
                        f"torchspmd's patch {self.name!r} was verified on {self.library}{self.versions}")
            wanted = self.signatures.get(target)
            if wanted is not None:
                got = parameters(obj)
                if got not in wanted:
                    return (f"{target} takes ({', '.join(got or ('?',))}) in {self.library} {have}, not "
                            + " or ".join(f"({', '.join(w)})" for w in wanted)
                            + f" as torchspmd's patch {self.name!r} was verified with "
                              f"({self.library}{self.versions})")
        if self.also is not None:
            problem = self.also()
            if problem is not None:
                return (f"{problem} in {self.library} {have}; torchspmd's patch {self.name!r} was verified on "
                        f"{self.library}{self.versions}")
        return None

    def check(self) -> None:
        """Raise ``PatchUnavailable`` where the patch cannot be applied (whatever ``needed`` says)."""
        problem = self.problem()
        if problem is not None:
            raise PatchUnavailable(f"{self.feature} needs {self.what.split(';')[0]}: {problem}; install "
                                   f"{self.library}{self.versions}")


def in_range(have: str, specifier: str) -> bool:
    try:
        release = Version(have).base_version  # 2.13.0+cpu -> 2.13.0; 2.16.0.dev1 -> 2.16.0
    except InvalidVersion:
        return False
    return Version(release) in SpecifierSet(specifier)


def parameters(fn: Any) -> tuple[str, ...] | None:
    """The names of ``fn``'s parameters (None where it has no signature)."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


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
_SKIPPED: dict[str, tuple[Patch, str]] = {}


def apply(patch: Patch, install: Callable[[], Callable[[], None] | None]) -> bool:
    """Check ``patch`` and run ``install``, which makes the change and returns its undo.
    Returns whether the patch is active (applied now or before); False: a patch that only
    buys speed could not be applied here (skipped, with one warning), and its caller takes
    the library's own path. A patch that correctness needs raises ``PatchUnavailable``."""
    if patch.name in _ACTIVE:
        return True
    if patch.name in _SKIPPED:
        return False
    if not verify([patch]):
        return False
    undo = install()
    _ACTIVE[patch.name] = (patch, [undo] if undo is not None else [])
    return True


def verify(patches: list[Patch]) -> bool:
    """Check ``patches`` before they are needed (``use_spmd()`` does, for the patches its
    engine applies later, mid-run): a needed one that cannot apply raises ``PatchUnavailable``
    now; a speed one is marked skipped with one warning. True when all can apply."""
    ok = True
    for patch in patches:
        if patch.name in _ACTIVE:
            continue
        if patch.name in _SKIPPED:
            ok = False
            continue
        problem = patch.problem()
        if problem is None:
            continue
        if patch.needed:
            patch.check()
        ok = False
        _SKIPPED[patch.name] = (patch, problem)
        warnings.warn(f"torchspmd: {patch.feature} is off and takes {patch.library}'s own path: {problem}",
                      PatchSkippedWarning, stacklevel=3)
    return ok


def skip(patch: Patch, reason: str) -> None:
    """Record that ``patch`` is not applied here, and why, without a warning: for a patch
    this library version does not need (e.g. "not needed on this version: ...")."""
    if patch.name not in _ACTIVE:
        _SKIPPED.setdefault(patch.name, (patch, reason))


def remove(name: str) -> None:
    """Undo patch ``name`` (nothing if it is not active)."""
    entry = _ACTIVE.pop(name, None)
    if entry is not None:
        for undo in reversed(entry[1]):
            undo()


def remove_all() -> None:
    for name in list(reversed(_ACTIVE)):
        remove(name)
    _SKIPPED.clear()


def is_active(name: str) -> bool:
    return name in _ACTIVE


def active() -> list[Patch]:
    """The patches applied in this process, in the order they were applied."""
    return [patch for patch, _ in _ACTIVE.values()]


def skipped() -> list[tuple[Patch, str]]:
    """The patches this process left out, each with why."""
    return list(_SKIPPED.values())


@contextlib.contextmanager
def applied(patch: Patch, install: Callable[[], Callable[[], None] | None]) -> Iterator[bool]:
    """``patch`` for the length of a ``with`` block (a no-op where it is active already);
    yields whether it is active (False: a speed patch skipped on this version)."""
    fresh = patch.name not in _ACTIVE
    on = apply(patch, install)
    try:
        yield on
    finally:
        if fresh and on:
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


MODULES = ("torch", "dtensor", "fsdp", "elastic", "transformers", "accelerate", "imports", "python")


def catalogue() -> list[Patch]:
    """Every patch torchspmd defines (whether applied or not), module by module."""
    out = []
    for name in MODULES:
        module = importlib.import_module(f"torchspmd.patches.{name}")
        out += [v for v in vars(module).values() if isinstance(v, Patch)]
    return out


def markdown() -> str:
    """The catalogue as the table of docs/patches.md (``python -m torchspmd.patches``)."""
    rows = ["| patch | library (verified range) | needed for | what it changes | why | feature |",
            "|---|---|---|---|---|---|"]
    for p in catalogue():
        cells = [p.name, f"{p.library} `{p.versions}`", "correctness" if p.needed else "speed only", p.what, p.why,
                 p.feature]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
