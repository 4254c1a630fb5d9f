"""Writing a generated table between two marker lines of a document (the tools' tables in docs/),
and the machine line of a results file (the benchmarks' own, ``bench/_common.provenance``)."""

from __future__ import annotations

from pathlib import Path


def replace_between(doc: Path, begin: str, end: str, table: str) -> bool:
    """Put ``table`` between the lines ``begin`` and ``end`` of ``doc``; False (nothing written)
    where the document or its markers are absent."""
    if not doc.exists():
        return False
    text = doc.read_text()
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + begin + "\n" + table + "\n" + end + tail)
    return True


def machine_line() -> str:
    """The benchmarks' ``Machine: ...; run <date>.`` line for a tool's results file."""
    import sys

    bench = str(Path(__file__).resolve().parent.parent / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from _common import provenance

    return provenance()
