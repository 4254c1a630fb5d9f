"""Every results file under bench/results/ states its date (and machine): a ``Machine:`` line
the benchmark wrote (``bench/_common.provenance``) or, for files older than that, a
``Written:`` line with the date of the commit that wrote them. No benchmark runs here."""

import datetime
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATED = re.compile(r"^(Machine|Written): .*\b\d{4}-\d{2}-\d{2}\b", re.MULTILINE)


def test_every_results_file_has_a_dated_machine_or_written_line():
    files = sorted((ROOT / "bench" / "results").rglob("*.md"))
    assert files
    undated = [str(f.relative_to(ROOT)) for f in files if not DATED.search(f.read_text())]
    assert not undated, f"results files without a dated 'Machine:' or 'Written:' line: {undated}"


def test_provenance_measures_this_machine_and_today():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from _common import provenance
    finally:
        sys.path.remove(str(ROOT / "bench"))
    before = datetime.datetime.now(datetime.timezone.utc).date()
    line = provenance()
    after = datetime.datetime.now(datetime.timezone.utc).date()
    assert "\n" not in line and line.startswith("Machine: ")
    assert f"Machine: {os.cpu_count()} CPU cores (" in line
    assert any(line.endswith(f"; run {d.isoformat()}.") for d in (before, after)), line
    assert DATED.search(line)
