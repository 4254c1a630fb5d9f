"""import-linter contract types of the project's own (registered in pyproject.toml's
``[tool.importlinter]``; ``lint-imports`` runs them with the built-in ones, and
``tests/test_structure.py`` runs ``lint-imports`` in the suite).

- ``no_root_imports``: no module of the package imports the package root (``torchspmd``,
  whose ``__init__`` only re-exports): modules import the module that defines a name.
- ``acyclic``: the package's modules import each other without a cycle, counting the imports
  inside functions (grimp's graph has them all).
- ``function_imports``: at most ``max_imports`` import statements of the package's own
  modules inside functions (they hide dependencies: allowed for optional heavy libraries and
  the command line's start-up time).
- ``private_names``: no module uses another module's private name (``from m import _x``,
  ``m._x``): a helper several modules need is its module's internal API, without an
  underscore. Private modules inside their own package are import-linter's
  ``private_modules`` contract's business, not this one's.
- ``no_string_comparison``: no comparison with one of ``strings`` (an engine's name) outside
  ``allowed_modules``: integrations ask an engine's capabilities.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _files(package: str) -> dict[str, Path]:
    """``{module name: source file}`` of every module of ``package``."""
    spec = importlib.util.find_spec(package)
    root = Path(next(iter(spec.submodule_search_locations)))
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.with_suffix("").relative_to(root.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _render(check: ContractCheck) -> None:
    for line in check.metadata["problems"]:
        output.print_error(line, bold=False)
        output.new_line()


class NoRootImportsContract(Contract):
    type_name = "no_root_imports"
    package = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        problems = [f"{m} imports {self.package} (import from the module that defines the name)"
                    for m in sorted(graph.find_modules_that_directly_import(self.package))]
        return ContractCheck(kept=not problems, metadata={"problems": problems})

    def render_broken_contract(self, check: ContractCheck) -> None:
        _render(check)


class AcyclicContract(Contract):
    type_name = "acyclic"
    package = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        modules = sorted(m for m in graph.modules if m == self.package or m.startswith(self.package + "."))
        edges = {m: {n for n in graph.find_modules_directly_imported_by(m) if n in modules} for m in modules}
        problems = [" -> ".join(cycle) for cycle in _cycles(edges)]
        return ContractCheck(kept=not problems, metadata={"problems": problems})

    def render_broken_contract(self, check: ContractCheck) -> None:
        _render(check)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module
    (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(_path_in(sorted(component), edges))
    return found


def _path_in(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A cycle from the component's first module back to it (breadth-first)."""
    members = set(component)
    start = component[0]
    previous = {start: None}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for child in sorted(edges[node] & members):
            if child == start:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child not in previous:
                previous[child] = node
                todo.append(child)
    return component


def _function_imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module) of each import of the package inside a function."""
    found: list[tuple[int, str]] = []

    def visit(node, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            here = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if inside and isinstance(child, ast.ImportFrom) and (child.module or "").startswith(package):
                found.append((child.lineno, child.module))
            elif inside and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names if a.name.startswith(package))
            visit(child, here)

    visit(tree, False)
    return found


class FunctionImportsContract(Contract):
    type_name = "function_imports"
    package = fields.StringField()
    max_imports = fields.IntegerField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        found = []
        for name, path in _files(self.package).items():
            found += [f"{name}:{line} imports {module} inside a function"
                      for line, module in _function_imports(ast.parse(path.read_text()), self.package)]
        problems = found if len(found) > self.max_imports else []
        if problems:
            problems.insert(0, f"{len(found)} imports of {self.package}'s modules inside functions, more than "
                               f"{self.max_imports}:")
        return ContractCheck(kept=not problems, metadata={"problems": problems, "count": len(found)})

    def render_broken_contract(self, check: ContractCheck) -> None:
        _render(check)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class PrivateNamesContract(Contract):
    type_name = "private_names"
    package = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        files = _files(self.package)
        problems = []
        for name, path in files.items():
            tree = ast.parse(path.read_text())
            aliases: dict[str, str] = {}  # local name -> module of the package it is bound to
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith(self.package) and a.asname:
                            aliases[a.asname] = a.name
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(self.package):
                    for a in node.names:
                        full = f"{node.module}.{a.name}"
                        if full in files:
                            aliases[a.asname or a.name] = full
                        elif _private(a.name) and node.module != name:
                            problems.append(f"{name}:{node.lineno} imports {node.module}.{a.name}")
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                    module = aliases.get(node.value.id)
                    if module is not None and module != name and f"{module}.{node.attr}" not in files:
                        problems.append(f"{name}:{node.lineno} uses {module}.{node.attr}")
        return ContractCheck(kept=not problems, metadata={"problems": problems})

    def render_broken_contract(self, check: ContractCheck) -> None:
        _render(check)


class NoStringComparisonContract(Contract):
    type_name = "no_string_comparison"
    package = fields.StringField()
    strings = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        allowed = tuple(self.allowed_modules)
        problems = []
        for name, path in _files(self.package).items():
            if any(name == a or name.startswith(a + ".") for a in allowed):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):
                    operands = [node.left, *node.comparators]
                    for o in operands:
                        values = [o] if isinstance(o, ast.Constant) else list(getattr(o, "elts", []))
                        hit = [v.value for v in values if isinstance(v, ast.Constant) and v.value in self.strings]
                        if hit:
                            problems.append(f"{name}:{node.lineno} compares with {hit[0]!r} (ask the engine's "
                                            f"capabilities)")
        return ContractCheck(kept=not problems, metadata={"problems": problems})

    def render_broken_contract(self, check: ContractCheck) -> None:
        _render(check)
