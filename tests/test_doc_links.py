"""The docs a person reads: every relative link in README.md, docs/ and benchmarks/results/ leads to a file that
exists (and, with a #fragment, to a heading there), and the benchmarks are named as they are run now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "benchmarks" / "results").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def relative_links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_resolve(page):
    dead = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            dead.append(f"{target} (no {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved})")
        elif fragment and resolved.suffix == ".md":
            headings = {anchor(h) for h in re.findall(r"^#+\s+(.*)$", resolved.read_text(encoding="utf-8"), re.M)}
            if fragment not in headings:
                dead.append(f"{target} (no heading #{fragment})")
    assert not dead, f"{page.relative_to(REPO)} links to what is not there:\n  " + "\n  ".join(dead)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_benchmarks_are_named_as_they_run(page):
    assert not re.search(r"lm_systems[./]bench\b", page.read_text(encoding="utf-8")), (
        f"{page.relative_to(REPO)} names lm_systems.bench: the runners are `python -m benchmarks.<name>`"
    )
