"""The documentation a newcomer reads: README.md, docs/ and the engine's READMEs.

Every relative link must reach a file (or folder) of the checkout, and every #anchor in
such a link must be a heading of its target, by GitHub's rule for heading anchors
(lowercase; spaces become '-'; every other character but letters, digits, '-' and '_' is
dropped; a repeated heading gets -1, -2, ...). README.md stays short and starts with the
two commands.
"""

import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) and ![alt](target); the target ends at whitespace or ')'.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (a reference definition).
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files():
    files = [REPO / "README.md"]
    files += sorted((REPO / "docs").rglob("*.md"))
    files += sorted((REPO / "engine").glob("README.md"))
    files += sorted((REPO / "engine").glob("*/README.md"))
    return files


def prose_lines(path):
    """(line number, text) of the lines outside fenced code blocks, code spans blanked."""
    inside = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def slug(heading):
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    kept = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def anchors(path):
    seen = {}
    result = set()
    inside = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        m = None if inside else HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def links(path):
    for number, line in prose_lines(path):
        for m in INLINE_LINK.finditer(line):
            yield number, m.group(1)
        m = REFERENCE.match(line)
        if m:
            yield number, m.group(1)


def is_external(target):
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # http:, mailto:, ...


def broken_links(path):
    problems = []
    for number, target in links(path):
        if is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        file_part = file_part.split("?", 1)[0]
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading '#{anchor}' in {dest.relative_to(REPO)}")
    return problems


def test_the_slug_follows_githubs_rule():
    assert slug("The device seam") == "the-device-seam"
    assert slug("CPU-Adam on the device's sums") == "cpu-adam-on-the-devices-sums"
    assert slug("Partitioned construction (`strata::ZeroInit`)") == "partitioned-construction-stratazeroinit"
    assert slug("Parameters on NVMe too (`--params`)") == "parameters-on-nvme-too---params"
    assert slug("A — B") == "a--b"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_its_heading(path):
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## A part\n\nSee [b](b.md), [part](#a-part), "
                                   "[gone](#no-such-part) and `[code](c.md)`.\n")
    problems = broken_links(tmp_path / "a.md")
    assert len(problems) == 2, problems
    assert "b.md: no such file" in problems[0]
    assert "#no-such-part" in problems[1]


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines"
    start = next(i for i, line in enumerate(lines) if FENCE.match(line))
    assert start <= 3, "the two commands come first, right under the title"
    end = next(i for i in range(start + 1, len(lines)) if FENCE.match(lines[i]))
    commands = [line.split("#", 1)[0].strip() for line in lines[start + 1:end]]
    assert [c for c in commands if c] == ["scripts/train.sh", "scripts/test.sh"]
