"""The package's structure: import-linter's contracts (pyproject.toml) hold, and the project's
own contract types (tests/import_contracts.py) catch what they are for."""

import subprocess
import sys
import textwrap

from _helpers import ROOT, clean_env


def _lint(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", *args], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(PYTHONPATH=str(cwd)), timeout=300)


def test_the_packages_contracts_are_kept():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


BAD = {
    "pkg/__init__.py": "from pkg.a import f\n",
    "pkg/a.py": "from pkg import b\n\ndef f():\n    return b.g()\n",
    "pkg/b.py": textwrap.dedent("""
        from pkg.c import _hidden


        def g():
            from pkg import a  # (the only import back: a cycle through a function)
            from pkg import c

            return c._hidden, a, _hidden


        def engine(name):
            return name == "xla"
        """),
    "pkg/c.py": "_hidden = 1\n",
    "pkg/d.py": "import pkg\n",
}

CONFIG = textwrap.dedent("""
    [importlinter]
    root_package = pkg
    contract_types =
        no_root_imports: tests.import_contracts.NoRootImportsContract
        acyclic: tests.import_contracts.AcyclicContract
        function_imports: tests.import_contracts.FunctionImportsContract
        private_names: tests.import_contracts.PrivateNamesContract
        no_string_comparison: tests.import_contracts.NoStringComparisonContract

    [importlinter:contract:root]
    name = root
    type = no_root_imports
    package = pkg

    [importlinter:contract:cycles]
    name = cycles
    type = acyclic
    package = pkg

    [importlinter:contract:functions]
    name = functions
    type = function_imports
    package = pkg
    max_imports = 1

    [importlinter:contract:private]
    name = private
    type = private_names
    package = pkg

    [importlinter:contract:strings]
    name = strings
    type = no_string_comparison
    package = pkg
    strings = xla
    allowed_modules = pkg.c
    """)


def test_the_projects_contract_types_catch_each_breach(tmp_path):
    for name, text in BAD.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    (tmp_path / ".importlinter").write_text(CONFIG)
    r = _lint(tmp_path, "--config", str(tmp_path / ".importlinter"))
    assert r.returncode == 1, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "Contracts: 0 kept, 5 broken." in out, out
    assert "pkg.d imports pkg (import from the module" in out  # the root
    assert "pkg.a -> pkg.b -> pkg.a" in out  # the cycle, through an import inside a function
    assert "2 imports of pkg's modules inside functions, more than 1" in out
    assert "pkg.b:2 imports pkg.c._hidden" in out and "pkg.b:9 uses pkg.c._hidden" in out
    assert "pkg.b:13 compares with 'xla'" in out
