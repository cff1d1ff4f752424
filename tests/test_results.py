"""docs/results holds results a reader can trace: every JSON file carries the same meta (date,
commit, machine, command), every file is linked from the results index, its history or a topic
page the index links, the docs' relative links resolve, and no doc names the work period that
made a result or the tools it ran through instead of its date, commit and machine."""

import datetime
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
INDEX = RESULTS / "README.md"
HISTORY = RESULTS / "history.md"

META_FIELDS = ("date", "commit", "machine", "command")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_REFERENCE = re.compile(r"^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)   # [label]: target
_FORBIDDEN = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)\s+(device\s+)?session"
    r"|\bsession\s*\d"
    r"|\bcall\s+\d"
    r"|\bdevice\s+(tool|call|calls|session|sessions)\b"
    r"|\$OUT\b"
    r"|nvidia-h200",
    re.IGNORECASE)
_TEXT_SUFFIXES = {".md", ".json", ".txt", ".csv", ""}


def _result_jsons() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


def _targets(page: Path) -> list[str]:
    """A markdown page's link targets: inline `[text](target)` and reference `[label]: target`."""
    text = page.read_text()
    return _LINK.findall(text) + _REFERENCE.findall(text)


def _links(page: Path) -> set[Path]:
    """The files a markdown page links to (relative links; anchors and URLs left out)."""
    found = set()
    for target in _targets(page):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.add((page.parent / target.split("#", 1)[0]).resolve())
    return found


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation but hyphens and
    underscores dropped, spaces as hyphens (a repeated heading's -1, -2 too)."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", page.read_text(), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_result_json_carries_the_same_meta():
    files = _result_jsons()
    assert files, "no JSON results under docs/results"
    wrong = []
    for path in files:
        name = path.relative_to(ROOT)
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or set(data) != {"meta", "results"}:
            wrong.append(f"{name}: the top level must be {{'meta': ..., 'results': ...}}")
            continue
        meta = data["meta"]
        for field in META_FIELDS:
            value = meta.get(field)
            if not isinstance(value, str) or not value.strip():
                wrong.append(f"{name}: meta.{field} missing or empty")
        date = meta.get("date", "")
        try:
            ok = isinstance(date, str) and datetime.date.fromisoformat(date).isoformat() == date
        except ValueError:
            ok = False
        if not ok:
            wrong.append(f"{name}: meta.date {date!r} is not YYYY-MM-DD")
        commit = meta.get("commit", "")
        if not (commit == "unknown" or re.fullmatch(r"[0-9a-f]{7,40}", str(commit))):
            wrong.append(f"{name}: meta.commit {commit!r} is not a git sha")
    assert not wrong, "\n".join(wrong)


def test_result_commits_exist():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    commits = sorted({json.loads(p.read_text())["meta"]["commit"] for p in _result_jsons()}
                     - {"unknown"})
    # one process for all of them: `git cat-file --batch-check` prints "<sha> missing" for
    # an object it does not find
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, text=True,
                         input="".join(f"{c}^{{commit}}\n" for c in commits),
                         capture_output=True, check=True).stdout.splitlines()
    missing = [c for c, line in zip(commits, out) if line.endswith("missing")]
    assert not missing, f"commits named in docs/results that git does not find: {missing}"


def test_every_result_file_is_linked():
    topic_pages = {p for p in _links(INDEX) if p.suffix == ".md" and p.parent == RESULTS.resolve()}
    linked = set()
    for page in {INDEX.resolve(), HISTORY.resolve(), *topic_pages}:
        assert page.is_file(), f"{page.relative_to(ROOT)} is linked from the index but missing"
        linked |= _links(page)
    unlinked = [str(p.relative_to(ROOT)) for p in sorted(RESULTS.rglob("*"))
                if p.is_file() and p.resolve() not in linked and p.resolve() != INDEX.resolve()]
    assert not unlinked, ("files under docs/results that neither docs/results/README.md, "
                          "history.md nor a topic page it links links to:\n" + "\n".join(unlinked))


def test_relative_links_in_the_docs_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for target in _links(page):
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_links_to_a_section_name_a_heading_of_that_page():
    # the results index points at topic pages' sections: a renamed heading must not leave a
    # link that lands at the top of the page
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for target in _targets(page):
            if re.match(r"[a-z]+:", target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            linked = (page.parent / path).resolve() if path else page
            if linked.suffix == ".md" and linked.is_file() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to sections that are not there:\n" + "\n".join(broken)


def test_heading_anchors_follow_githubs_rule(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Results\n## MoE: experts on grouped GEMMs (2026-12-05)\n"
                    "## Not compiled: `--cuda-graph` alone, and eager\n## Results\n")
    assert _anchors(page) == {"results", "moe-experts-on-grouped-gemms-2026-12-05",
                              "not-compiled---cuda-graph-alone-and-eager", "results-1"}


def test_docs_say_dates_and_machines_not_work_periods_or_tools():
    pages = [ROOT / "README.md", *(p for p in sorted(DOCS.rglob("*"))
                                   if p.is_file() and p.suffix in _TEXT_SUFFIXES)]
    wrong = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            match = _FORBIDDEN.search(line)
            if match:
                wrong.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not wrong, ("say the date, commit and machine (\"one H200\", \"2-core CPU\") "
                       "instead:\n" + "\n".join(wrong))


def test_the_forbidden_patterns_catch_what_they_should():
    for text in ["the seventh session's numbers", "fourth device session", "session7",
                 "session 4", "call 4", "Call 12 found", "write $OUT/x.json", "nvidia-h200-x2",
                 "the device tool"]:
        assert _FORBIDDEN.search(text), text
    for text in ["resumed sessions of a run", "recall 4 items", "one H200", "2-core CPU",
                 "--device cuda", "a call per 4 elements"]:
        assert not _FORBIDDEN.search(text), text


def test_the_demo_numbers_the_docs_quote_are_the_demo_results():
    """docs/qat.md and docs/rl.md quote `lowbit qat` and `lowbit rl` on their defaults from the
    newest docs/results/demos/ file (benchmarks/demos.py writes it): each quoted figure is that
    file's number, written as the page writes it, and the page names the file."""
    files = sorted((RESULTS / "demos").glob("demos-*.json"))
    assert files, "no docs/results/demos/demos-*.json (python benchmarks/demos.py)"
    newest = files[-1]
    for demo in json.loads(newest.read_text())["results"].values():
        page = ROOT / demo["quoted_in"]
        text = page.read_text()
        assert newest.resolve() in _links(page), f"{page.name} does not link {newest.name}"
        for key, quoted in demo["quoted"].items():
            value = demo["val_loss"][key] if "val_loss" in demo else demo[key]
            digits = len(quoted.split(".")[1])
            assert quoted == f"{value:.{digits}f}", (key, quoted, value)
            assert quoted in text, f"{page.name} does not quote {key} = {quoted} ({newest.name})"
