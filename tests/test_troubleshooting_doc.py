"""docs/troubleshooting.md lists every error and warning class the package defines (a class
deriving from ``SpmdError``, ``PeerLost`` or ``Warning``), and names none that does not exist."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = {"SpmdError", "PeerLost", "Warning", "UserWarning", "DeprecationWarning", "RuntimeWarning",
         "FutureWarning"}


def _classes() -> set[str]:
    bases: dict[str, set[str]] = {}
    for path in (ROOT / "torchspmd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)

    def reported(name: str, seen=()) -> bool:
        if name in ("SpmdError", "PeerLost"):
            return True
        return any(b in ROOTS or (b in bases and b not in seen and reported(b, (*seen, name)))
                   for b in bases.get(name, ()))

    return {name for name in bases if not name.startswith("_") and reported(name)} | {"SpmdError", "PeerLost"}


def test_the_troubleshooting_page_lists_every_error_and_warning():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)`", page, re.MULTILINE))
    defined = _classes()
    assert defined - listed == set(), f"defined in the package, missing from docs/troubleshooting.md: {defined - listed}"
    assert listed - defined == set(), f"in docs/troubleshooting.md but not defined: {listed - defined}"
