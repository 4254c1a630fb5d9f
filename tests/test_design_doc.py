"""docs/design.md's layer diagram shows every module of import-linter's layers contract
(pyproject.toml, the contract the code is held to), layer by layer in the contract's order:
a module added to the contract, or moved to another layer, must be drawn there."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layer_diagram_follows_the_layers_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers" and "containers" not in c)["layers"]
    text = (ROOT / "docs" / "design.md").read_text()
    diagram = text[text.index("## Layers"):]
    diagram = diagram[diagram.index("```") + 3:]
    diagram = diagram[:diagram.index("```")]
    where: list[list[int]] = []
    missing = []
    for layer in layers:
        spots = []
        for module in (m.strip() for m in layer.split("|")):
            name = module.split(".")[-1]
            found = re.search(rf"(?<![\w/]){re.escape(name)}(\.py|/)", diagram)
            if found is None:
                missing.append(module)
            else:
                spots.append(found.start())
        where.append(spots)
    assert not missing, f"in the layers contract, not in docs/design.md's diagram: {missing}"
    for upper, lower, name in zip(where, where[1:], layers[1:]):
        assert max(upper) < min(lower), f"docs/design.md's diagram draws the layer {name!r} before a layer above it"
