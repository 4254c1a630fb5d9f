"""Print the requirements of one of the project's extras (self-references expanded,
torchspmd itself left out): what the torch_xla environment installs beside torch_xla."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]


def expand(names: list[str]) -> list[str]:
    out: list[str] = []
    for req in names:
        m = re.fullmatch(r"torchspmd\[(.+)\]", req)
        out += expand([r for e in m.group(1).split(",") for r in extras[e.strip()]]) if m else [req]
    return out


def applies(req: str) -> bool:
    """A requirement's ``python_version`` marker, for this Python (the one that makes the
    environment): the list is passed to pip word by word, which a marker's spaces would split."""
    if ";" not in req:
        return True
    marker = req.split(";", 1)[1]
    m = re.fullmatch(r"\s*python_version\s*(<|<=|>|>=|==|!=)\s*['\"]([\d.]+)['\"]\s*", marker)
    if not m:
        raise SystemExit(f"requirements.py: unsupported marker in {req!r}")
    have, want = sys.version_info[:2], tuple(int(x) for x in m.group(2).split("."))
    return {"<": have < want, "<=": have <= want, ">": have > want, ">=": have >= want, "==": have == want,
            "!=": have != want}[m.group(1)]


reqs = [r.split(";")[0].strip() for r in expand(project["dependencies"] + [f"torchspmd[{sys.argv[1]}]"])
        if not r.startswith("torch>") and applies(r)]
print(" ".join(dict.fromkeys(reqs)))
