"""The documentation site builds with mkdocs in strict mode (a warning fails it: a page left
out of the site, a docstring mkdocstrings cannot render), and its API reference
(docs/api.md) has an entry for every name of ``torchspmd.__all__``."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import torchspmd

ROOT = Path(__file__).resolve().parents[1]
#: names of __all__ that are another name's object, documented under that name
ALIASES = {"FSDPv2": "SpmdFullyShardedDataParallel"}


def test_the_site_builds_strictly_with_every_public_name(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    api = (site / "api" / "index.html").read_text()
    entries = {i.rsplit(".", 1)[-1] for i in re.findall(r'id="(torchspmd[\w.]*)"', api)}
    missing = [n for n in torchspmd.__all__ if ALIASES.get(n, n) not in entries]
    assert not missing, f"docs/api.md has no entry for {missing}"
    assert (site / "index.html").exists() and (site / "context" / "index.html").exists()
    shutil.rmtree(site)
