"""Writing a generated table between two marker lines of a document (the tools' tables in docs/)."""

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
