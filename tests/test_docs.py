"""The README and docs/ stay true: every relative link resolves (file and heading), every ``--flag``
they mention exists in the ``--help`` of the command it is given to, every flag of every command is
documented in docs/cli.md, and the README stays a front page (at most ~250 lines).

Which command a flag belongs to is read from the command line it appears on: in a code block (or
an inline code span), the flags after ``parallel-dcp CMD`` (or ``python -m parallel_dcp CMD``,
``torchrun ... -m parallel_dcp CMD``) must be CMD's; after ``python bench/NAME.py``, that script's
``add_argument`` options. Flags in prose, or in a span without a command, must be some command's.
Lines of other programs (pip, torchrun's own options, srun) are not checked.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FLAG = re.compile(r"(?<![\w/-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
OUR_COMMAND = re.compile(r"(?:(?<![\w/.-])parallel-dcp|(?:^|\s)-m\s+parallel_dcp)(?![\w-])")
BENCH_SCRIPT = re.compile(r"(?:^|\s)(bench/[\w-]+\.py)(?![\w-])")


@dataclass(frozen=True)
class Mention:
    """One ``--flag`` in the docs: where it is, and the command it is given to (None: any)."""

    page: str
    line: int
    flag: str
    command: str | None  # "convert", "" for the top level, "bench/x.py" for a script, None for any


@dataclass(frozen=True)
class Block:
    """A page split into prose lines and code lines (with their line numbers)."""

    prose: list[tuple[int, str]]
    code: list[tuple[int, str, str]]  # line number, text, the fence's language


def split_page(text: str) -> Block:
    prose: list[tuple[int, str]] = []
    code: list[tuple[int, str, str]] = []
    language: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            language = line.strip().lstrip("`~").strip().lower() if language is None else None
            continue
        if language is None:
            prose.append((number, line))
        else:
            code.append((number, line, language))
    return Block(prose, code)


# --- links -------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in split_page(page.read_text()).prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """Relative links in prose (code blocks and inline code are not links)."""
    found = []
    for number, line in split_page(page.read_text()).prose:
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                found.append((number, target))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for number, target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            broken.append(f"{where}: no such file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{where}: no heading with anchor #{anchor} in {resolved.name}")
    assert not broken, "\n".join(broken)


def test_the_docs_have_their_pages_and_links() -> None:
    """The pages the README promises exist, and the README links each of them."""
    wanted = {
        "cli.md",
        "python-api.md",
        "conversion.md",
        "compression.md",
        "object-storage.md",
        "several-nodes.md",
        "guarantees.md",
        "performance.md",
        "architecture.md",
    }
    assert wanted <= {p.name for p in PAGES}
    linked = {Path(t.partition("#")[0]).name for _, t in links(ROOT / "README.md")}
    assert wanted <= linked, f"the README does not link {sorted(wanted - linked)}"


def test_the_slug_rule_matches_githubs() -> None:
    assert github_slug("Resuming a conversion that died: `--resume`") == "resuming-a-conversion-that-died---resume"
    assert github_slug("`parallel-dcp convert SRC... DST`") == "parallel-dcp-convert-src-dst"
    assert github_slug("tmpfs (/dev/shm)") == "tmpfs-devshm"


# --- flags -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def helps() -> dict[str, set[str]]:
    """The flags of the top level ("") and of every command, from the real ``--help`` output's usage.

    One subprocess per command, started together: each imports the package afresh."""

    def start(*args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "parallel_dcp", *args, "--help"]
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(process: subprocess.Popen[str]) -> str:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        return out

    top = finish(start())
    section = top.split("positional arguments:", 1)[1].split("options:", 1)[0]
    commands = re.findall(r"^ {4}([a-z][a-z-]*) {2,}\S", section, re.MULTILINE)
    assert commands, top
    running = {command: start(command) for command in commands}
    texts = {"": top} | {command: finish(process) for command, process in running.items()}
    return {command: defined_flags(text) for command, text in texts.items()}


def defined_flags(help_text: str) -> set[str]:
    """The options a ``--help`` defines: those its usage lines and option entries name (``-q,
    --quiet``), not flags a description merely mentions."""
    usage = help_text.split("\n\n", 1)[0]
    entries = re.findall(r"^ {2}(-\S.*?)(?: {2,}|$)", help_text, re.MULTILINE)
    return set(FLAG.findall(usage)) | {flag for entry in entries for flag in FLAG.findall(entry)}


def script_flags(script: str) -> set[str]:
    source = (ROOT / script).read_text()
    return set(re.findall(r"add_argument\(\s*(?:\"-\w\",\s*)?\"(--[a-z][a-z0-9-]*)\"", source)) | {"--help"}


def without_comment(line: str) -> tuple[str, str]:
    """A shell line split into its command and its trailing ``# comment`` (quotes respected)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def command_mentions(page: str, number: int, text: str, commands: set[str]) -> list[Mention]:
    """The flags of one command line: those after ``parallel-dcp CMD`` are CMD's, those after a
    bench script are the script's; a line of another program is not ours to check."""
    ours = OUR_COMMAND.search(text)
    script = BENCH_SCRIPT.search(text)
    if ours:
        rest = text[ours.end() :]
        words = rest.split()
        command = words[0] if words and words[0] in commands else None
        if words and words[0].startswith("-"):
            command = ""
        return [Mention(page, number, flag, command) for flag in FLAG.findall(rest)]
    if script:
        rest = text[script.end() :]
        return [Mention(page, number, flag, script.group(1)) for flag in FLAG.findall(rest)]
    if re.match(r"^\s*--", text):  # a bare flag (`--workers N`): some command's
        return [Mention(page, number, flag, None) for flag in FLAG.findall(text)]
    return []


def mentions(page: Path, commands: set[str]) -> list[Mention]:
    name = str(page.relative_to(ROOT))
    block = split_page(page.read_text())
    found: list[Mention] = []
    logical: list[tuple[int, str]] = []  # shell lines with their continuations joined
    for number, line, language in block.code:
        if language not in ("", "bash", "sh", "shell", "console"):
            continue
        if logical and logical[-1][1].endswith("\\"):
            logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + line.strip())
        else:
            logical.append((number, line))
    for number, line in logical:
        command, comment = without_comment(line)
        found += command_mentions(name, number, command, commands)
        found += [Mention(name, number, flag, None) for flag in FLAG.findall(comment)]
    for number, line in block.prose:
        for _, span in INLINE_CODE.findall(line):
            found += command_mentions(name, number, span, commands)
        outside = INLINE_CODE.sub(" ", line)
        found += [Mention(name, number, flag, None) for flag in FLAG.findall(outside)]
    return found


def test_every_flag_the_docs_mention_exists_in_its_commands_help(helps: dict[str, set[str]]) -> None:
    commands = set(helps) - {""}
    every = set().union(*helps.values())
    unknown = []
    checked = 0
    for page in PAGES:
        for mention in mentions(page, commands):
            checked += 1
            if mention.command is None:
                known, whose = every, "any command"
            elif mention.command.startswith("bench/"):
                known, whose = script_flags(mention.command), mention.command
            else:
                known, whose = helps[mention.command], f"parallel-dcp {mention.command}".strip()
            if mention.flag not in known:
                unknown.append(f"{mention.page}:{mention.line}: {mention.flag} is not a flag of {whose}")
    assert checked > 50, "the docs mention flags; finding none means the parser is broken"
    assert not unknown, "\n".join(unknown)


def test_the_checker_catches_a_flag_given_to_the_wrong_command(helps: dict[str, set[str]]) -> None:
    commands = set(helps) - {""}
    found = command_mentions("x", 1, "parallel-dcp inspect /ckpt --dry-run", commands)
    assert found == [Mention("x", 1, "--dry-run", "inspect")]
    assert "--dry-run" not in helps["inspect"] and "--dry-run" in helps["convert"]
    torchrun = "torchrun --nnodes=4 -m parallel_dcp convert /a /b --distributed"
    assert [m.flag for m in command_mentions("x", 1, torchrun, commands)] == ["--distributed"]
    assert command_mentions("x", 1, "pip install --upgrade pip", commands) == []


def test_every_flag_of_every_command_is_documented_in_the_cli_page(helps: dict[str, set[str]]) -> None:
    cli = (ROOT / "docs" / "cli.md").read_text()
    missing = [
        f"parallel-dcp {command} {flag}".replace("  ", " ")
        for command, flags in sorted(helps.items())
        for flag in sorted(flags - {"--help"})
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", cli)
    ]
    assert not missing, "docs/cli.md does not document: " + ", ".join(missing)
    for command in sorted(set(helps) - {""}):
        assert f"## `parallel-dcp {command}" in cli, f"docs/cli.md has no section for {command}"


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    assert "## Quick start" in readme and "docs/performance.md" in readme
