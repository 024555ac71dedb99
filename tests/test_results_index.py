"""results/ a reader can use: every results file the README and docs cite exists, every file is in the index, and no
citation points outside the repository."""

from __future__ import annotations

import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _cited() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    for page in PAGES:
        for name in re.findall(r"results/([A-Za-z0-9_.*-]+)", page.read_text()):
            cited.setdefault(name.rstrip("."), set()).add(page.name)
    return cited


def test_every_cited_results_file_exists():
    files = {p.name for p in (ROOT / "results").iterdir()}
    missing = [
        (name, pages)
        for name, pages in _cited().items()
        if not fnmatch.filter(files, name) and not any(f.startswith(name + ".") for f in files)  # a family: .json .md
    ]
    assert missing == []


def test_the_index_lists_every_results_file():
    index = (ROOT / "results" / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "results").iterdir() if p.name != "README.md" and f"`{p.name}`" not in index]
    assert unlisted == []


def test_no_citation_points_outside_the_repository():
    sources = [*PAGES, *(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    outside = [str(p.relative_to(ROOT)) for p in sources if re.search(r"shared/research|\.\./shared", p.read_text())]
    assert outside == []
