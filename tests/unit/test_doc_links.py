"""Every relative link in README.md and docs/*.md reaches a file that exists, and every `#anchor` a heading
of that file, spelled as GitHub spells heading anchors. A page moved or a heading renamed fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the target ends at the first space (a title may follow) or ")"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The Markdown without its fenced blocks and code spans (a link shown as code is not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for match in _HEADING.finditer(_FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(prose(page.read_text()))]


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not ours to check
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: {dest.name} has no heading whose anchor is #{anchor}")
    return bad


def test_slug_spells_anchors_as_github_does():
    assert slug("Subjects, events and nats CLI recipes") == "subjects-events-and-nats-cli-recipes"
    assert slug("`haru status [--fleet F] [--json]`") == "haru-status---fleet-f---json"
    assert slug("The follower's catch-up: 0.8x in five runs of six") == "the-followers-catch-up-08x-in-five-runs-of-six"
    assert slug("What clients see of a failover (`bench/clientview.py`)") == (
        "what-clients-see-of-a-failover-benchclientviewpy"
    )


def test_the_checker_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [gone](missing.md) [no anchor](other.md#nowhere) "
        "[here](#page) `[not a link](missing.md)`\n\n```\n[in a block](missing-too.md)\n```\n"
    )
    assert broken(page) == [
        f"missing.md: no such file {tmp_path / 'missing.md'}",
        "other.md#nowhere: other.md has no heading whose anchor is #nowhere",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert links(page) or page.name != "README.md", "README.md links to nothing: where do newcomers go next?"
    assert not broken(page), f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken(page))
