"""The repository's docs stand alone: sources cite only the repo's own docs, and every cited
document and section exists.

A citation of a document that is not in the repository (a design file kept elsewhere) or of a
section that was renamed sends the reader nowhere; these tests turn either into a failure that
names the file and line.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from tests.paths import REPO_ROOT

#: the folders whose files may cite docs: the installed packages, tests, benchmarks, examples
CITING_FOLDERS = ("modelpack", "mediatypes", "signing", "mount", "loader", "tests", "benchmarks", "examples")
#: a citation of a design document outside the repository ("DESIGN §5", "DESIGN.md")
OUTSIDE_DESIGN = re.compile(r"\bDESIGN(?:\.md|\s*§)")
#: ``docs/<file>.md`` optionally followed by ``#<anchor>``, as written in docstrings and comments
DOC_CITATION = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)(?:#([\w-]+))?")
#: a relative Markdown link between docs: ``[text](file.md#anchor)`` or ``[text](#anchor)``
MARKDOWN_LINK = re.compile(r"\]\((?!https?://|mailto:)([^)\s#]*\.md)?(?:#([^)\s]+))?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _source_files() -> Iterator[Path]:
    for folder in CITING_FOLDERS:
        yield from sorted((REPO_ROOT / folder).rglob("*.py"))
    yield REPO_ROOT / "setup.py"


def _heading_slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: inline markup dropped, lower case,
    punctuation other than ``-`` and ``_`` removed, spaces to ``-``, repeats numbered ``-1``…"""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if in_fence or not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))  # a link keeps its text
        text = text.replace("`", "").replace("*", "").lower()
        slug = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _doc_cites(path: Path) -> Iterator[tuple[int, str, str | None]]:
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in DOC_CITATION.finditer(line):
            yield lineno, m.group(1), m.group(2)


def _missing(doc: Path, anchor: str | None) -> str | None:
    if not doc.is_file():
        return f"{doc.relative_to(REPO_ROOT)} does not exist"
    if anchor is not None and anchor not in _heading_slugs(doc.read_text(encoding="utf-8")):
        return f"{doc.relative_to(REPO_ROOT)} has no section #{anchor}"
    return None


def test_no_source_file_cites_a_design_document_outside_the_repository() -> None:
    """Sources, tests and docs point at the repository's own docs, never at an outside design file."""
    here = Path(__file__).resolve()
    cited = [
        f"{path.relative_to(REPO_ROOT)}:{lineno}: {line.strip()}"
        for path in [*_source_files(), *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "README.md"]
        if path.resolve() != here
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE_DESIGN.search(line)
    ]
    assert cited == [], "cite a section of docs/*.md instead:\n" + "\n".join(cited)


def test_every_docs_section_cited_from_source_exists() -> None:
    """Every ``docs/<file>.md#<section>`` a docstring or comment cites names a real file and heading."""
    broken: list[str] = []
    count = 0
    for path in _source_files():
        for lineno, name, anchor in _doc_cites(path):
            count += 1
            why = _missing(REPO_ROOT / "docs" / name, anchor)
            if why:
                broken.append(f"{path.relative_to(REPO_ROOT)}:{lineno}: {why}")
    assert count >= 20, f"only {count} citations of docs/*.md found: is the pattern still right?"
    assert broken == [], "\n".join(broken)


def test_every_relative_link_between_docs_and_from_the_readme_exists() -> None:
    """A ``[text](file.md#section)`` link in docs/*.md, the README or the changelog lands on a real
    file and heading."""
    broken: list[str] = []
    anchored = 0
    pages = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    for page in pages:
        in_fence = False
        for lineno, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if _FENCE.match(line):
                in_fence = not in_fence
            if in_fence:
                continue
            for m in MARKDOWN_LINK.finditer(line):
                target, anchor = m.group(1), m.group(2)
                if not target and not anchor:
                    continue
                doc = (page.parent / target).resolve() if target else page
                anchored += anchor is not None
                why = _missing(doc, anchor)
                if why:
                    broken.append(f"{page.relative_to(REPO_ROOT)}:{lineno}: {why}")
    assert anchored >= 30, f"only {anchored} links to a section found: is the pattern still right?"
    assert broken == [], "\n".join(broken)


def test_heading_slugs_follow_github() -> None:
    """The anchor rule matches GitHub's for the kinds of headings the docs use."""
    doc = "# Title\n## The image-shaped variant (`--format image`)\n```\n# not a heading\n```\n## Title\n"
    doc += "### The timeline (t0 … t9)\n## Each byte once per node: ranks that share their reads\n"
    assert _heading_slugs(doc) == {
        "title",
        "the-image-shaped-variant---format-image",
        "title-1",
        "the-timeline-t0--t9",
        "each-byte-once-per-node-ranks-that-share-their-reads",
    }
