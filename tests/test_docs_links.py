"""Relative links in README.md and docs/*.md: the file exists and a ``#anchor`` names a heading by GitHub's slug
(issue 34: ``task.md#which-reward-exact-measures`` pointed at no heading)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"(?<![!\\])\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: inline links reduced to their text, markup (`` ` ``, ``*``) dropped,
    lowercased, characters other than letters, digits, spaces, hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def prose_lines(path: Path) -> list[str]:
    """The lines of a markdown file outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "``", line))
    return out


def anchors(path: Path) -> set[str]:
    """The anchors a file defines: each heading's slug, a repeated one suffixed -1, -2, ... as GitHub does, and
    explicit ``<a name|id="...">`` anchors."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slug_matches_github():
    # worked out by hand from GitHub's rule
    assert slug("Which reward exact/* measure") == "which-reward-exact-measure"
    assert slug("The hackable variant (`data.embedded_task=digitsum_hack`)") == (
        "the-hackable-variant-dataembedded_taskdigitsum_hack"
    )
    assert slug("KL(π‖π_ref) per token") == "klππ_ref-per-token"
    assert slug("A [linked](x.md) heading") == "a-linked-heading"
    assert slug("β = 0 -- two  spaces") == "β--0----two--spaces"


def test_duplicate_headings_get_suffixes(tmp_path):
    p = tmp_path / "d.md"
    p.write_text('# Usage\n\n```\n# Usage\n```\n## Usage\n### Usage\n<a name="here"></a>\n')
    assert anchors(p) == {"usage", "usage-1", "usage-2", "here"}


def relative_links(line: str) -> list[str]:
    """The targets of a line's markdown links and images that are not URLs (http:, https:, mailto: ...)."""
    targets = [m.group(1) or m.group(2) for m in LINK.finditer(line)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_relative_links_found():
    line = (
        "see [a](b.md#c), [t](#top), ![fig](figures/x.png), [web](https://x.org/a.md), E_{π*}\\[r\\](β) and [[n]](d.md)"
    )
    assert relative_links(line) == ["b.md#c", "#top", "figures/x.png", "d.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    bad = []
    cache: dict[Path, set[str]] = {}
    for target in (t for line in prose_lines(doc) for t in relative_links(line)):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
            continue
        if anchor and dest.suffix == ".md":
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not bad, f"{doc.name}: broken links:\n" + "\n".join(bad)
