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


reqs = [r for r in expand(project["dependencies"] + [f"torchspmd[{sys.argv[1]}]"]) if not r.startswith("torch>")]
print(" ".join(dict.fromkeys(reqs)))
