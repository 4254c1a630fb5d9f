"""Every relative link in the README and docs/ points to a file that exists, and every anchor
(``page.md#section``) to a heading or an ``<a id>`` of that page (GitHub's anchors: the
heading lowercased, punctuation other than ``-`` and ``_`` dropped, spaces made ``-``). CI has
no web access: links to other sites are not followed."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
CODE = re.compile(r"```.*?```", re.DOTALL)


def _slug(heading: str) -> str:
    text = re.sub(r"`|\*\*|\*", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = CODE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for h in HEADING.findall(text):
        slug = _slug(h)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def test_relative_links_and_anchors_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(CODE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not followed
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_pages_are_reference_sized_and_not_a_diary():
    """Every page of docs/ fits ~400 lines (a topic per page: docs/index.md lists them), the
    README 250; no user-facing page cites a commit (a hash pip users and shallow clones do not
    have) or an issue number."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in pages
            if (n := len(p.read_text().splitlines())) > (250 if p.name == "README.md" else 400)]
    assert not long, long
    cited = []
    for page in pages:
        text = CODE.sub("", page.read_text())
        for m in re.finditer(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|\bissues? #?\d+|\(#\d+\)", text):
            cited.append(f"{page.relative_to(ROOT)}: {m.group(0)!r}")
    assert not cited, cited
