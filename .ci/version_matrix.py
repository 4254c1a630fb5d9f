"""The version matrix of docs/versions.md: for each dependency, the range pyproject.toml
admits (all extras together) and the versions CI tests (the exact pins of .ci/lock/, per
environment). ``python3 .ci/version_matrix.py`` prints the table; tests/test_versions_doc.py
checks that docs/versions.md holds it."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["torch", "torch-xla", "transformers", "trl", "accelerate", "peft", "datasets", "tokenizers",
            "safetensors", "numpy"]
ENVIRONMENTS = {"native": "native.txt", "torch 2.15": "torch-2.15.txt", "torch_xla": "xla.txt"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def admitted() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs: dict[str, list[str]] = {}
    for req in [*project["dependencies"], *[r for reqs in project["optional-dependencies"].values() for r in reqs]]:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*([^;]*)", req)
        name, spec = _norm(m.group(1)), m.group(3).strip()
        if name != "torchspmd" and spec and spec not in specs.setdefault(name, []):
            specs[name].append(spec)
    return specs


def tested() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for env, lock in ENVIRONMENTS.items():
        for line in (ROOT / ".ci" / "lock" / lock).read_text().splitlines():
            m = re.match(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
            if m:
                out.setdefault(_norm(m.group(1)), {})[env] = m.group(2)
    return out


def table() -> str:
    specs, pins = admitted(), tested()
    lines = ["| package | admitted (pyproject.toml) | tested: " + " | ".join(ENVIRONMENTS) + " |",
             "|---|---|" + "---|" * len(ENVIRONMENTS)]
    for name in PACKAGES:
        row = [f"`{name}`", ", ".join(f"`{s}`" for s in specs.get(name, [])) or "(any)"]
        row += [pins.get(name, {}).get(env, "-") for env in ENVIRONMENTS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
