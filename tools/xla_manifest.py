"""Write torch_xla's public names as ``torchspmd/compat/xla_manifest.json``: what the
``--xla-compat`` layer answers for.

Run it with the torch_xla it describes (2.9.0 in the CI's xla environment):

    PJRT_DEVICE=CPU python tools/xla_manifest.py torchspmd/compat/xla_manifest.json

For every public module of torch_xla's Python tree (no component starting with ``_``), and for
``torch_xla._XLAC``, it records whether the module is a package and each name a program can
import from it, with its kind:

- ``["function", origin]`` / ``["class", origin]``: ``origin`` is the module and qualified name
  where torch_xla defines it (one object under several modules' names: the layer gives the
  same object), or null;
- ``["constant", value]`` for ``None``, booleans, numbers and strings (and tuples / lists of
  them, ``["constant", value, "tuple"]``): the layer gives torch_xla's value;
- ``["object"]``: any other value.

A module's names: its ``__all__`` (those that exist), the public names its source defines at
top level, and the public classes and functions it imports from torch_xla. A module that
torch_xla itself cannot import here (it needs jax or tensorflow) is read from its source and
marked with ``import_error``. ``private_modules`` lists torch_xla's other modules (their
names are not recorded)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import pkgutil
import sys
import types

SCALARS = (type(None), bool, int, float, str)


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


def _source_names(module: str) -> dict[str, object]:
    """Public names a module's source binds at top level: ``def`` / ``class`` (kind) and
    assignments (the constant's value where it is a literal, else ``"object"``)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return {}
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = "function"
        elif isinstance(node, ast.ClassDef):
            out[node.name] = "class"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    try:
                        value = ast.literal_eval(node.value) if node.value is not None else None
                    except ValueError:
                        out[target.id] = "object"
                    else:
                        out[target.id] = value if isinstance(value, SCALARS) else "object"
    return {k: v for k, v in out.items() if not k.startswith("_")}


def _constant(value):
    if isinstance(value, SCALARS):
        return ["constant", value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, SCALARS) for v in value):
        return ["constant", list(value), type(value).__name__]
    return None


def _origin(value) -> str | None:
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if isinstance(module, str) and module.startswith("torch_xla") and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return None


def _entry(value):
    if isinstance(value, types.ModuleType):
        return None
    if inspect.isclass(value):
        return ["class", _origin(value)]
    if callable(value):
        return ["function", _origin(value)]
    constant = _constant(value)
    if constant is not None:
        return constant
    return ["object"]


def describe(module: str) -> dict:
    try:
        # (_XLAC, the C extension, is imported as a top-level module and bound as torch_xla._XLAC)
        mod = importlib.import_module("torch_xla")._XLAC if module == "torch_xla._XLAC" else \
            importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (torch_xla's own optional dependencies)
        names = {}
        for name, kind in _source_names(module).items():
            if kind in ("function", "class"):
                names[name] = [kind, f"{module}.{name}"]
            elif kind == "object":
                names[name] = ["object"]
            else:
                names[name] = ["constant", kind]
        spec = importlib.util.find_spec(module)
        return {"package": bool(spec and spec.submodule_search_locations is not None),
                "import_error": f"{type(e).__name__}: {e}"[:200], "names": dict(sorted(names.items()))}
    if module == "torch_xla._XLAC":
        candidates = [n for n in dir(mod) if not n.startswith("__")]
    else:
        declared = [n for n in getattr(mod, "__all__", ()) if hasattr(mod, n) and not n.startswith("_")]
        defined = [n for n in _source_names(module) if hasattr(mod, n)]
        imported = [n for n, v in vars(mod).items()
                    if not n.startswith("_") and (inspect.isclass(v) or callable(v)) and
                    str(getattr(v, "__module__", "")).startswith("torch_xla")]
        candidates = list(dict.fromkeys(declared + defined + imported))
    names = {}
    for name in candidates:
        entry = _entry(getattr(mod, name))
        if entry is not None:
            names[name] = entry
    return {"package": hasattr(mod, "__path__"), "names": dict(sorted(names.items()))}


def _dumps(manifest: dict) -> str:
    """JSON with one module's header and one name per line (diffs read name by name)."""
    lines = ["{", f' "torch_xla": {json.dumps(manifest["torch_xla"])},',
             f' "generated_by": {json.dumps(manifest["generated_by"])},', ' "modules": {']
    modules = list(manifest["modules"].items())
    for i, (module, entry) in enumerate(modules):
        head = {k: v for k, v in entry.items() if k != "names"}
        lines.append(f"  {json.dumps(module)}: {json.dumps(head)[:-1]}, \"names\": {{")
        names = list(entry["names"].items())
        lines += [f"   {json.dumps(n)}: {json.dumps(e)}" + ("," if j < len(names) - 1 else "")
                  for j, (n, e) in enumerate(names)]
        lines.append("  }}" + ("," if i < len(modules) - 1 else ""))
    lines += [" },", f' "private_modules": {json.dumps(manifest["private_modules"])}', "}", ""]
    text = "\n".join(lines)
    assert json.loads(text) == json.loads(json.dumps(manifest))
    return text


def main(path: str) -> None:
    import torch_xla

    every = ["torch_xla"] + sorted(m.name for m in pkgutil.walk_packages(torch_xla.__path__, "torch_xla.",
                                                                         onerror=lambda name: None))
    public = [m for m in every if not _private(m)] + ["torch_xla._XLAC"]
    manifest = {
        "torch_xla": torch_xla.__version__,
        "generated_by": "tools/xla_manifest.py",
        "modules": {m: describe(m) for m in sorted(public)},
        "private_modules": sorted(m for m in every if _private(m)),
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write(_dumps(manifest))
    n = sum(len(v["names"]) for v in manifest["modules"].values())
    print(f"{path}: torch_xla {manifest['torch_xla']}, {len(manifest['modules'])} modules, {n} names")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tools/xla_manifest.py OUT.json  (in an environment with torch_xla)")
    main(sys.argv[1])
