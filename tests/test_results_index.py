"""results/ a reader can use: every results file the README and docs cite exists (a run that left results/ is cited as
`git show COMMIT:results/NAME`, and exists there), every file is in the index, which says why where no page cites
it, every figure a page quotes is in a file it cites, and no citation points outside the repository."""

from __future__ import annotations

import decimal
import fnmatch
import functools
import json
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A results file cited as it is now (results/NAME, a glob or a family's stem: results/h200_bench) or as it was at a
# commit, after it left results/ (git show COMMIT:results/NAME): (COMMIT or None, NAME).
_CITE = re.compile(r"(?:\b([0-9a-f]{7,40}):)?results/([A-Za-z0-9_.*-]+)")


def _citations(text: str) -> set[tuple[str | None, str]]:
    return {(commit or None, name.rstrip(".")) for commit, name in _CITE.findall(text)}


@functools.cache
def _git(*args: str) -> str | None:
    """A git command's output in this repository, or None where git, the repository or the commit is not there (a
    shallow clone, an unpacked sdist): what a history citation names is then left unchecked."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _names_at(commit: str) -> list[str] | None:
    """The files results/ held at a commit, or None where that cannot be read."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None
    listing = _git("ls-tree", "--name-only", f"{commit}:results")
    return None if listing is None else listing.split()


def _named(name: str, names) -> list[str]:
    """The files a citation names: a glob, a file, or a family's stem (h200_bench: .json, .md, .png)."""
    return [n for n in names if fnmatch.fnmatch(n, name) or n.startswith(name + ".")]


def _cited() -> dict[str, set[str]]:
    """The results files (as they are now) each page cites, a glob or a family's stem counting for the files it
    names and their siblings of the same stem: file -> pages."""
    files = [p.name for p in (ROOT / "results").iterdir() if p.name != "README.md"]
    cited: dict[str, set[str]] = {}
    for page in PAGES:
        for commit, name in _citations(page.read_text()):
            if commit is None:
                stems = {n.split(".")[0] for n in _named(name, files)}
                for f in files:
                    if f.split(".")[0] in stems:
                        cited.setdefault(f, set()).add(page.relative_to(ROOT).as_posix())
    return cited


def test_every_cited_results_file_exists():
    files = [p.name for p in (ROOT / "results").iterdir()]
    missing = []
    for page in PAGES:
        for commit, name in sorted(_citations(page.read_text()), key=str):
            names = files if commit is None else _names_at(commit)
            if names is not None and not _named(name, names):
                missing.append((page.name, f"{commit}:results/{name}" if commit else f"results/{name}"))
    assert missing == []


def test_the_index_lists_every_results_file():
    index = (ROOT / "results" / "README.md").read_text()
    unlisted = [p.name for p in (ROOT / "results").iterdir() if p.name != "README.md" and f"`{p.name}`" not in index]
    assert unlisted == []


def test_the_index_says_which_pages_cite_a_file_and_why_a_file_no_page_cites_is_kept():
    """An index entry (a list item naming files in backticks) that says "cited in PAGE, ..." is true of every file it
    names; a file no page cites (itself, by a glob, or through a sibling of the same stem) sits in an entry that says
    "cited by no page" and why it is kept."""
    index = (ROOT / "results" / "README.md").read_text()
    cited = _cited()
    wrong, unexplained = [], []
    for entry in re.split(r"\n(?=- )", index):
        names = re.findall(r"`([^`/ ]+\.[a-z]+)`", entry.split(":")[0] if "cited in" in entry else entry)
        claim = re.search(r"cited in ((?:README\.md|docs/[a-z_]+\.md)(?:,\s+(?:README\.md|docs/[a-z_]+\.md))*)", entry)
        if claim:
            pages = set(re.split(r",\s+", claim.group(1)))
            wrong += [
                (name, sorted(pages - cited.get(name, set()))) for name in names if pages - cited.get(name, set())
            ]
        for name in names:
            if (ROOT / "results" / name).exists() and name not in cited and "cited by no page" not in entry:
                unexplained.append(name)
    assert wrong == []
    assert unexplained == []


def test_no_citation_points_outside_the_repository():
    sources = [*PAGES, *(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    outside = [str(p.relative_to(ROOT)) for p in sources if re.search(r"shared/research|\.\./shared", p.read_text())]
    assert outside == []


_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.M | re.S)
_NOT_PROSE = re.compile(
    r"\]\([^)]*\)|`[^`\n]*`|<!--.*?-->|https?://\S+|results/[A-Za-z0-9_.*-]+|\(computed[^:()]*:\s[^)]*\)", re.S
)
_FIGURE = re.compile(r"(?<![\w,])(?<!\d\.)(\d+\.\d+(?:e[+-]?\d+)?)(?!\.?\d)(%?)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LIST_ITEM = re.compile(r"(?:[-*+]|\d+\.) ")
_PLACES = 6  # the most decimal places a figure is compared at (a percentage's fraction takes two more)


def _units(text: str) -> list[tuple[str, set[tuple[str | None, str]]]]:
    """A page as the units whose figures are checked, each with the results files it cites ((commit or None, name
    as written), globs kept): paragraphs split at blank lines, where a heading, a top-level list item (its nested
    items stay in it) and a table start a unit of their own; a table's own citations and those of the paragraphs just
    above and below it count for it. Code blocks are left out."""
    units: list[list[str]] = []
    kind = None  # of the unit being read: "para", "table" or None after a blank line or a heading
    for line in _FENCE.sub("", text).splitlines():
        if not line.strip():
            kind = None
            continue
        now = "table" if line.lstrip().startswith("|") else "para"
        if line.startswith("#") or now != kind or (now == "para" and _LIST_ITEM.match(line)):
            units.append([now])
        units[-1].append(line)
        kind = None if line.startswith("#") else now
    cites = [_citations("\n".join(u[1:])) for u in units]
    out = []
    for i, unit in enumerate(units):
        cited = set(cites[i])
        if unit[0] == "table":
            for j in (i - 1, i + 1):
                if 0 <= j < len(units) and units[j][0] == "para":
                    cited |= cites[j]
        out.append(("\n".join(unit[1:]), cited))
    return out


def _figures(unit: str) -> list[str]:
    """The decimal figures a unit's prose quotes, a percentage with its %: outside link targets, inline code, URLs,
    citations and a "(computed: ...)" or "(computed per ...: ...)" aside (a value derived from figures quoted beside
    it). Version strings (2.5.1) are not figures; a range's ends (26.4..27.3) are two."""
    return [number + percent for number, percent in _FIGURE.findall(_NOT_PROSE.sub(" ", unit))]


def _family(name: str, names: list[str]) -> list[str]:
    """The files a citation lets a figure come from: those it names (a glob or a family's stem) and each one's
    siblings of the same stem (x.md -> x.json, x.jsonl, x.jsonl.meta.json); pictures left out."""
    files = [n for n in names if not n.endswith(".png")]
    stems = {n.split(".")[0] for n in _named(name, files)}
    return sorted(n for n in files if n.split(".")[0] in stems)


def _sources(cited, results: pathlib.Path) -> list[tuple[str, str]] | None:
    """(name, text) of each file a unit's citations let a figure come from: from results/, or for a history citation
    (git show COMMIT:results/NAME) from the commit, named COMMIT:NAME. None where a commit cannot be read."""
    out = []
    for commit, name in sorted(cited, key=str):
        if commit is None:
            out += [
                (n, (results / n).read_text(errors="replace"))
                for n in _family(name, [p.name for p in results.iterdir()])
            ]
            continue
        names = _names_at(commit)
        if names is None:
            return None
        for n in _family(name, names):
            text = _git("show", f"{commit}:results/{n}")
            if text is None:
                return None
            out.append((f"{commit}:{n}", text))
    return out


class _Num(str):
    """A number as a JSON file writes it."""


def _tokens(name: str, text: str) -> set[str]:
    """The numbers a file writes. In a .json or .jsonl file, a list of more than 8 numbers holds raw samples (per
    round, per step) and is left out: nearly any figure rounds to one of them, and a page quotes statistics of them,
    which the file's report holds."""
    suffix = pathlib.PurePath(name).suffix
    if suffix not in (".json", ".jsonl"):
        return set(_NUMBER.findall(text))
    try:
        lines = [text] if suffix == ".json" else [line for line in text.splitlines() if line.strip()]
        docs = [json.loads(line, parse_float=_Num, parse_int=_Num) for line in lines]
    except ValueError:
        return set(_NUMBER.findall(text))
    out: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            for key, value in x.items():
                out.update(_NUMBER.findall(key))
                walk(value)
        elif isinstance(x, list):
            if not (len(x) > 8 and all(isinstance(e, _Num) for e in x)):
                for e in x:
                    walk(e)
        elif isinstance(x, _Num):
            out.add(x.lstrip("-"))
        elif isinstance(x, str):
            out.update(_NUMBER.findall(x))

    for doc in docs:
        walk(doc)
    return out


@functools.cache
def _values(name: str, text: str) -> frozenset[str]:
    """Every number in a file as written (_tokens); each decimal one also rounded (half up and half even) or padded
    to 1 to _PLACES places, and one in scientific notation also normalised (1.5e+10 -> 1.5E+10)."""
    out = set()
    for token in _tokens(name, text):
        out.add(token)
        if "e" in token.lower():
            out.add(str(decimal.Decimal(token).normalize()))
        elif "." in token:
            value = decimal.Decimal(token)
            for places in range(1, _PLACES + 1):
                step = decimal.Decimal(1).scaleb(-places)
                out.add(str(value.quantize(step, decimal.ROUND_HALF_UP)))
                out.add(str(value.quantize(step, decimal.ROUND_HALF_EVEN)))
    return frozenset(out)


def _held(figure: str, values: frozenset[str]) -> bool:
    """Whether a file's values hold a figure: as written or rounded from more places; a percentage also as a
    fraction (0.4% -> 0.004, from 0.0037); scientific notation by value."""
    number = figure.rstrip("%")
    if "e" in number:
        return str(decimal.Decimal(number).normalize()) in values
    return number in values or (figure.endswith("%") and str(decimal.Decimal(number).scaleb(-2)) in values)


def _unsourced(text: str, results: pathlib.Path) -> list[tuple[str, list[str]]]:
    """The figures of a page's citing units that none of the files the unit cites holds, with those files."""
    missing = []
    for unit, cited in _units(text):
        files = _sources(cited, results)
        if not files:  # no results file cited, or a commit that cannot be read here
            continue
        held = frozenset().union(*(_values(name, content) for name, content in files))
        names = sorted({name for name, _ in files})
        missing += [(figure, names) for figure in _figures(unit) if not _held(figure, held)]
    return missing


def test_the_figure_check_finds_an_unsourced_figure(tmp_path):
    (tmp_path / "run.md").write_text("| case | ms |\n|---|---|\n| a | 26.93 |\n| b | 3.1 |\n| bound | 1.5e+10 |\n")
    samples = ", ".join(["5.55"] * 9)
    (tmp_path / "run.json").write_text(f'{{"ratio": 1.357, "err": 0.0037, "p20_p80": [6.04, 6.15], "ms": [{samples}]}}')
    (tmp_path / "other.md").write_text("ms 9.99")
    page = (
        "Case a took 26.9 ms ([run](results/run.md)), 1.36x b, error 0.4%; `python x.py --tol 7.5`, torch 2.5.1 and\n"
        "a bound of 1.5e10 aside (computed: 2.25x; computed per case: 3.3x).\n"
        "\n"
        "- b took 3.1 ms and 4.2 ms, 0.37% error, 6.0..6.2 ms, under 2.5e10 (results/run.md).\n"
        "- c took 9.99 ms, not cited.\n"
        "- e took 7.77 ms at a commit this repository does not hold (`git show 0000000:results/run.md`).\n"
        "- From results/run.md:\n"
        "\n"
        "  | case | ms |\n"
        "  |---|---|\n"
        "  | a | 26.93 |\n"
        "  | d | 26.4..27.5 |\n"
        "\n"
        "A step took 5.6 ms (results/run.md).\n"
        "\n"
        "```\n"
        "results/run.md 8.8\n"
        "```\n"
    )
    assert _figures("x 26.4..27.5 y 1.36x, v2.5 2.5.1 `3.3` [t](results/a_1.5.md) 0.4% 10,000.5 (computed: 1.1)") == [
        "26.4",
        "27.5",
        "1.36",
        "0.4%",
    ]
    assert _unsourced(page, tmp_path) == [
        ("4.2", ["run.json", "run.md"]),
        ("2.5e10", ["run.json", "run.md"]),
        ("26.4", ["run.json", "run.md"]),  # an indented table checked against the list item above it
        ("27.5", ["run.json", "run.md"]),
        ("5.6", ["run.json", "run.md"]),  # raw samples (a JSON list of more than 8 numbers) do not count
    ]


def test_every_quoted_figure_appears_in_a_file_its_paragraph_cites():
    """Every decimal figure (26.9, 1.36x, 0.4%, 1.5e10) that a paragraph, list item or table of the README or
    docs/*.md quotes appears in one of the results files that unit cites (a file's siblings of the same stem count):
    as written, or as a number the file holds rounded to the figure's places (26.93 -> 26.9), a percentage also as a
    fraction. A unit is a paragraph (blank-line separated), a top-level list item with its nested items, or a table;
    a table is checked against its own citations and those of the paragraphs just above and below it. In .json and
    .jsonl files, lists of more than 8 numbers (raw per-round or per-step samples) do not count.

    Not checked: units that cite no results file, code blocks, inline code, link targets, and a "(computed: ...)"
    aside, which states a value derived from figures quoted beside it. Integers are out of scope: head dims, token
    counts, years and shapes are integers too, and no simple rule tells a measured one apart. Version numbers are
    skipped when they have two dots (2.11.0); a two-part version (Python 3.12) in a citing paragraph would be checked,
    so such a paragraph keeps versions in inline code or leaves them to a paragraph of their own."""
    results = ROOT / "results"
    missing = [(page.relative_to(ROOT).as_posix(), *m) for page in PAGES for m in _unsourced(page.read_text(), results)]
    assert missing == []
