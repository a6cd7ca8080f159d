"""The user's guide stays true: README.md, CONTRIBUTING.md and docs/*.md are checked against
the tree and the CLI.

- every relative link resolves, and every ``#anchor`` names a heading of its page (GitHub's
  slugs), in those pages and in PROTOCOL.md, RELIABILITY.md and BENCHMARKS.md;
- README.md is at most README_MAX_LINES lines;
- every ``redbatch <command> --option`` in a code span or block is an option of that
  command, as its ``--help`` says (asked in-process with click's CliRunner); every flag
  named alone in backticks is an option of some command; and every flag of the
  configuration page's table is one of ``redbatch worker``;
- every path in backticks that starts with a folder of the repository exists.

Each check is a function of the text, so that the tests at the end can show it failing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from redbatch.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
#: Pages whose links and anchors are checked too (their paths name generated files, such as
#: bench/out/*.csv, so only their links are).
LINKED = sorted({*PAGES, ROOT / "PROTOCOL.md", ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md"})
README_MAX_LINES = 300
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
#: Flags of other tools the pages name alone in backticks (pytest, Redis, compose, pip).
OTHER_TOOLS_FLAGS = frozenset({"--dist", "--cluster-enabled", "--cluster-announce-ip",
                               "--scale", "--profile", "--no-deps"})

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SPAN = re.compile(r"(`+)(.+?)\1")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_COMMAND = re.compile(r"(?:^|(?<=[\s`|$(]))redbatch ([a-z][a-z-]*)((?: [a-z]+)?)")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_COMMAND_END = re.compile(r"\s[|;#]\s|\s&&\s|\s\|\s*$")


def prose_and_code(text: str) -> Iterator[tuple[bool, str]]:
    """Each line of a page, with whether it sits in a fenced code block; backslash-continued
    lines of a block come joined as one."""
    in_block, pending = False, ""
    for line in text.splitlines():
        if _FENCE.match(line):
            in_block = not in_block
            continue
        if in_block and line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield in_block, pending + line
        pending = ""


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code marks dropped, lower case, punctuation
    removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' slugs, repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for in_block, line in prose_and_code(text):
        match = _HEADING.match(line)
        if in_block or not match:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> Iterator[str]:
    """Every link target in the prose of a page (not in code)."""
    for in_block, line in prose_and_code(text):
        if not in_block:
            yield from _LINK.findall(_SPAN.sub("", line))


def broken_links(page: Path, text: str) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    broken = []
    for target in links(text):
        if re.match(r"^[a-z][a-z+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if path and not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and \
                anchor not in anchors(dest.read_text() if path else text):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def code(text: str) -> Iterator[str]:
    """Every piece of code on a page: each line of a block, each inline span."""
    for in_block, line in prose_and_code(text):
        if in_block:
            yield line
        else:
            yield from (m.group(2) for m in _SPAN.finditer(line))


def command_options(text: str) -> Iterator[tuple[str, str]]:
    """(command, option) for every option written after ``redbatch <command>`` in code, up
    to the end of that command (a pipe, ``;``, ``&&`` or a comment)."""
    for piece in code(text):
        for match in _COMMAND.finditer(piece):
            if piece[:match.start()].rstrip().endswith(("from", "import")):
                continue
            name = match.group(1) + match.group(2)
            rest = piece[match.end():]
            end = _COMMAND_END.search(rest)
            for option in _OPTION.findall(rest[:end.start()] if end else rest):
                yield name, option


@cache
def help_options(command: str) -> frozenset[str]:
    """The options ``redbatch <command> --help`` lists (in-process), or raises KeyError."""
    words = command.split()
    group: click.Command = main
    for word in words:
        if not isinstance(group, click.Group) or word not in group.commands:
            raise KeyError(command)
        group = group.commands[word]
    result = CliRunner().invoke(main, [*words, "--help"])
    assert result.exit_code == 0, result.output
    return frozenset(_OPTION.findall(result.output.partition("Options:")[2]))


def unknown_options(text: str) -> list[str]:
    """``redbatch <command> --option`` pairs on a page that click does not know."""
    wrong = []
    for command, option in command_options(text):
        if not command.split()[0].islower():
            continue  # redbatch COMMAND --help: a placeholder
        words = command.split()
        try:
            known = help_options(command)
        except KeyError:
            try:  # `redbatch dlq list`: a subcommand; `redbatch job ID`: an argument
                known = help_options(words[0])
            except KeyError:
                wrong.append(f"redbatch {command}: no such command")
                continue
        if option not in known:
            wrong.append(f"redbatch {command} {option}")
    return wrong


@cache
def every_option() -> frozenset[str]:
    """The options of every redbatch command and subcommand."""
    found: set[str] = set()
    for name, command in main.commands.items():
        subs = command.commands if isinstance(command, click.Group) else {}
        found |= help_options(name)
        for sub in subs:
            found |= help_options(f"{name} {sub}")
    return frozenset(found)


def stray_flags(text: str) -> list[str]:
    """Inline spans that are a flag (`--bulk-share`, `--max-batch-size N`) which no redbatch
    command takes and no other tool named in the docs does (OTHER_TOOLS_FLAGS)."""
    stray = []
    for in_block, line in prose_and_code(text):
        if in_block:
            continue
        for span in (m.group(2) for m in _SPAN.finditer(line)):
            flag = _OPTION.match(span)
            if flag and flag.group(0) not in every_option() | OTHER_TOOLS_FLAGS:
                stray.append(span)  # another tool's flag? add it to OTHER_TOOLS_FLAGS
    return stray


def config_flags(text: str) -> list[str]:
    """The flags in the first column of the configuration page's table."""
    rows = (line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| `--"))
    return [flag for row in rows for flag in _OPTION.findall(row)]


def missing_paths(text: str) -> list[str]:
    """Paths in inline backticks that start with one of the repository's folders, and do
    not exist (``file.py::test`` and ``file.py:LINE`` are checked as the file)."""
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    missing = []
    for in_block, line in prose_and_code(text):
        if in_block:
            continue
        for span in (m.group(2) for m in _SPAN.finditer(line)):
            path = re.split(r"::|:(?=\d)", span)[0]
            if (" " in path or "/" not in path or re.search(r"[*<>{}]|\.\.\.", path)
                    or path.split("/")[0] not in folders):
                continue
            if not (ROOT / path).exists():
                missing.append(span)
    return missing


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page, page.read_text()) == []


def test_readme_is_a_short_guide() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move depth into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_option_named_is_one_the_command_takes(page: Path) -> None:
    assert unknown_options(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_named_alone_is_a_redbatch_option(page: Path) -> None:
    assert stray_flags(page.read_text()) == []


def test_the_configuration_table_names_worker_flags() -> None:
    flags = config_flags(CONFIG_PAGE.read_text())
    assert len(flags) > 30, "the table went missing"
    assert sorted(set(flags) - help_options("worker")) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repo_path_in_backticks_exists(page: Path) -> None:
    assert missing_paths(page.read_text()) == []


# ----------------------------------------------------------------------- the checks fail


def test_a_broken_link_or_anchor_is_found() -> None:
    text = ("# Top\n## The CPU path: lanes, threads\n[ok](#top) [ok](#the-cpu-path-lanes-threads)"
            " [bad](#nowhere) [file](PROTOCOL.md#partitions) [gone](nothing.md)\n"
            "```\n# not a heading\n[not a link](also-nothing.md)\n```\n")
    assert broken_links(ROOT / "README.md", text) == [
        "#nowhere: no heading #nowhere in README.md", "nothing.md: no such file"]


def test_slugs_follow_github() -> None:
    assert slug("Issue 15: the default latency budget (2026-12-02)") == \
        "issue-15-the-default-latency-budget-2026-12-02"
    assert slug("`redbatch submit`") == "redbatch-submit"
    assert anchors("# A\n## A\n") == {"a", "a-1"}


def test_a_made_up_option_or_command_is_found() -> None:
    text = ("```\nredbatch worker --max-batch-size 8 --no-such-flag | grep --color x\n"
            "redbatch acl --model m \\\n    --apply --bogus\nredbatch nocommand --x\n```\n"
            "Run `redbatch score --tune` or `redbatch dlq list --partition 1`, "
            "`redbatch COMMAND --help`, `from redbatch import Client`.\n")
    assert unknown_options(text) == ["redbatch worker --no-such-flag", "redbatch acl --bogus",
                                     "redbatch nocommand: no such command"]


def test_a_flag_no_command_takes_is_found() -> None:
    text = "Set `--bulk-share`, `--max-batch-size 16`, `--scale worker=2` or `--bulk-shares`.\n"
    assert stray_flags(text) == ["--bulk-shares"]


def test_a_missing_path_is_found() -> None:
    text = ("`gpu_worker/batching/batcher.py`, `tests/test_docs.py::test_slugs_follow_github`, "
            "`gpu_worker/batcher.py`, `redis://host:6379/0`, `bench/out/*.csv`, `<dir>/x`\n"
            "```\nbench/not_here.py\n```\n")
    assert missing_paths(text) == ["gpu_worker/batcher.py"]
