"""docs/environment.md lists exactly the ``TORCHSPMD_*`` variables the package's source reads
(a new one cannot go undocumented, a removed one cannot stay), and those the tests, CI and
benchmarks read."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"TORCHSPMD_[A-Z0-9_]+")


def _names(paths) -> set[str]:
    return {n for p in paths for n in NAME.findall(p.read_text())}


def test_the_environment_page_lists_the_variables_the_code_reads():
    page = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"`(TORCHSPMD_[A-Z0-9_]+)`", page))
    package = _names((ROOT / "torchspmd").rglob("*.py"))
    assert package - documented == set(), f"read by the package, missing from docs/environment.md: {package - documented}"
    others = _names([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(p for p in (ROOT / ".ci").rglob("*") if p.is_file() and p.suffix in ("", ".py", ".sh", ".txt"))])
    others |= _names((ROOT / "tools").rglob("*.py")) if (ROOT / "tools").is_dir() else set()
    assert documented - package - others == set(), \
        f"in docs/environment.md but read nowhere: {documented - package - others}"
    assert others - package - documented == set(), \
        f"read by the tests, CI or benchmarks, missing from docs/environment.md: {others - package - documented}"
