"""docs/versions.md holds the version matrix ``.ci/version_matrix.py`` computes from
pyproject.toml's ranges and .ci/lock/'s pins (a changed range or lock changes the page)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_page_holds_the_current_matrix():
    table = subprocess.run([sys.executable, str(ROOT / ".ci" / "version_matrix.py")], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert table in (ROOT / "docs" / "versions.md").read_text(), \
        f"docs/versions.md is out of date; put in the output of python3 .ci/version_matrix.py:\n{table}"
