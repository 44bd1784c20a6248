"""The user's pages hold: every `bamboo`, `python -m bamboo` and `make` command shown in a
code block of README.md and docs/*.md parses with the project's own argument parsers (or
names a real Makefile target), every repository path and `bamboo.x.y` name they give exists,
and every relative link and its anchor resolve. (The README's quick start really trains, a
killed run ending with the bits of the run without the kill: tests/integration/test_docs_runs.py.)

The parse checks start no process: they build each command's real parser
(`bamboo.cli.COMMANDS` -> its module's `<command>_parser`, `build_parser` or `_parser`) and
parse the command's arguments, as `bamboo` would before it imports torch."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.pages import Command, logical_lines, page_commands, program, split_commands

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

NO_PARSER: dict[str, str] = {
    "config": "bamboo config builds its parser inside main(); there is no parser to import",
}
"""Commands whose module has no importable parser (each must still be a real command)."""

TARGETS_TO_COME: dict[str, str] = {
    "test-smoke": "the smoke tier (one end-to-end run per capability), added beside these pages",
}
"""Make targets a page may name before the Makefile has them: target -> why."""

PATH_ROOTS = ("traces", "examples", "bamboo", "docs", "benchmarks", "deploy", "tests")
"""The repository folders whose paths the pages name and that must exist."""

NOT_MODULES: dict[str, str] = {
    "bamboo.env": "deploy/systemd's environment file, not a module",
}
"""Dotted names the pages use that are not Python names of the package."""

MODULE_PATTERN = re.compile(r"(?<![\w./-])bamboo(?:\.[A-Za-z_]\w*)+(?![\w/-])")

PATH_PATTERN = re.compile(r"(?<![\w./~$-])(?:" + "|".join(PATH_ROOTS) + r")/[\w./*-]*")


# -- the commands of the pages ----------------------------------------------------------------


def inline_makes(page: Path) -> list[Command]:
    """The `make TARGET` commands a page names in inline code (the README's test table)."""
    rel = page.relative_to(REPO).as_posix()
    text = page.read_text(encoding="utf-8")
    return [Command(rel, text.count("\n", 0, m.start()) + 1, m.group(1), tuple(m.group(1).split()))
            for m in re.finditer(r"(?<!`)`(make [\w -]+)`(?!`)", text)]


def all_commands() -> list[Command]:
    return [c for page in PAGES for c in [*page_commands(page), *inline_makes(page)]]


def is_synopsis(command: Command) -> bool:
    """A usage synopsis (`[--flag X]`, `FILE...`, `a|b`) describes a command; it is not one."""
    return any(re.search(r"^\[|\]$|\.\.\.$|^[\w-]*\|[\w-]*$", w) for w in command.words)


# -- parsing them with the real parsers -------------------------------------------------------


def command_parser(name: str) -> argparse.ArgumentParser | None:
    """The real parser of `bamboo NAME`: its module's `NAME_parser`, `build_parser` or
    `_parser`; None when the module has none."""
    from bamboo.cli import COMMANDS
    assert name in COMMANDS, f"`bamboo {name}` is not a command (choose one of {sorted(COMMANDS)})"
    module = importlib.import_module(COMMANDS[name])
    for attr in (f"{name}_parser", "build_parser", "_parser"):
        factory = getattr(module, attr, None)
        if callable(factory):
            return factory()
    return None


def parse(parser: argparse.ArgumentParser, args: list[str], known: bool = False) -> list[str]:
    """Parse as the command does; a usage error fails with argparse's own line."""
    try:
        if known:
            return parser.parse_known_args(args)[1]
        parser.parse_args(args)
        return []
    except SystemExit as e:
        if e.code not in (0, None):
            raise AssertionError(f"does not parse (exit {e.code})") from None
        return []


def check_bamboo(words: list[str]) -> None:
    """`bamboo NAME ARGS` parses with NAME's parser; soak's and lab's job flags with train's."""
    name, args = words[0], words[1:]
    parser = command_parser(name)
    if parser is None and name in NO_PARSER:
        return
    assert parser is not None, (f"`bamboo {name}` has no importable parser: give its module a "
                                f"{name}_parser() or list it in NO_PARSER with a reason")
    if name == "soak":
        rest = parse(parser, args, known=True)
        parse(command_parser("train"), rest)
    elif name == "lab" and "--" in args:
        parse(parser, args[:args.index("--")])
        parse(command_parser("train"), args[args.index("--") + 1:])
    else:
        parse(parser, args)


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", text, flags=re.M))


def check(command: Command, targets: set[str]) -> None:
    words = list(command.words)
    if words[0] == "make":
        for target in [w for w in words[1:] if not w.startswith("-") and "=" not in w]:
            if target in TARGETS_TO_COME and target not in targets:
                continue
            assert target in targets, f"make has no target {target!r} (Makefile: {sorted(targets)})"
        return
    if words[0] == "python -m":
        assert runnable(words[1]), f"`python -m {words[1]}` is not a runnable module"
        return
    if len(words) < 2 or words[1] in ("-h", "--help"):
        return
    check_bamboo(words[1:])


def runnable(module: str) -> bool:
    """`python -m MODULE` runs something: a module with a `__main__` guard, or a package
    with a `__main__` module."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    if spec is None or spec.origin is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(f"{module}.__main__") is not None
    return "__main__" in Path(spec.origin).read_text(encoding="utf-8")


# -- the tests --------------------------------------------------------------------------------


def test_the_pages_show_commands_of_every_kind() -> None:
    """The extractor finds the commands a user meets first (a broken extractor checks
    nothing)."""
    seen = {c.words[:2] for c in all_commands()}
    for first in [("bamboo", "train"), ("bamboo", "coordinator"), ("bamboo", "agent"),
                  ("bamboo", "simulate"), ("bamboo", "data"), ("make", "demo"),
                  ("make", "setup"), ("make", "test-fast"), ("make", "test")]:
        assert first in seen, f"no `{' '.join(first)}` command found in the pages"


def test_every_command_parses() -> None:
    targets = make_targets()
    failures = []
    for command in all_commands():
        if is_synopsis(command):
            continue
        try:
            check(command, targets)
        except AssertionError as e:
            failures.append(f"{command}\n    {e}")
    assert not failures, "commands in the pages that would not run:\n" + "\n".join(failures)


def test_a_broken_command_is_caught() -> None:
    """The check is not vacuous: a wrong flag, a wrong value and an unknown command fail."""
    for words in (["train", "--nodes", "4", "--stagez", "2"], ["train", "--steps", "ten"],
                  ["simulate", "--policies"], ["agent", "--join"]):
        with pytest.raises(AssertionError):
            check_bamboo(words)
    with pytest.raises(AssertionError):
        check_bamboo(["nosuchcommand"])
    assert runnable("bamboo.sim") and not runnable("bamboo.chaos.bits")
    with pytest.raises(AssertionError):
        check(Command("x", 1, "python -m bamboo.nosuch", ("python -m", "bamboo.nosuch")), set())
    with pytest.raises(AssertionError):
        check(Command("x", 1, "make nosuchtarget", ("make", "nosuchtarget")), make_targets())
    line = ".venv/bin/bamboo train --nodes 4 --stages 4 \\\n    --steps 2 > log.txt 2>&1  # note"
    (command,) = [c for _, text in logical_lines(1, line.split("\n"))
                  for c in [program(w) for w in split_commands(text)] if c]
    assert command == ["bamboo", "train", "--nodes", "4", "--stages", "4", "--steps", "2"]


def named_paths(text: str) -> Iterator[str]:
    for match in PATH_PATTERN.finditer(text):
        path = match.group(0).rstrip(".,:;")
        if not path.endswith("/..."):
            yield path


def path_exists(path: str) -> bool:
    """A path the pages name, the package's (`bamboo/...`) under src/ as the pages say it."""
    if path.startswith("bamboo/"):
        path = f"src/{path}"
    return any(REPO.glob(path)) if "*" in path else (REPO / path).exists()


def link_targets(page: Path) -> Iterator[tuple[str, str]]:
    """(file, anchor) of the page's relative markdown links ("" for none)."""
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if not re.match(r"^\w+:", target):
            file, _, anchor = target.partition("#")
            yield file, anchor


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces
    to hyphens, -1, -2 ... for repeats); fenced code is not headings."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_named_path_exists() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path in sorted(set(named_paths(text))):
            if not path_exists(path):
                missing.append(f"{page.relative_to(REPO)}: {path}")
        for file, anchor in sorted(set(link_targets(page))):
            target = page.parent / file if file else page
            if not target.exists():
                missing.append(f"{page.relative_to(REPO)}: link ({file})")
            elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
                missing.append(f"{page.relative_to(REPO)}: link ({file}#{anchor}): "
                               f"no such heading")
    assert not missing, "paths the pages name that do not exist:\n" + "\n".join(missing)


def test_a_missing_path_is_caught() -> None:
    names = list(named_paths("see `traces/aws-p3-2xlarge.csv`, traces/nosuch.csv and "
                             "bamboo/engine/engine.py, docs/*.md."))
    assert names == ["traces/aws-p3-2xlarge.csv", "traces/nosuch.csv",
                     "bamboo/engine/engine.py", "docs/*.md"]
    assert [path_exists(n) for n in names] == [True, False, True, True]


def resolves(dotted: str) -> bool:
    """`bamboo.a.b.name`: the longest importable module prefix has the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_named_module_exists() -> None:
    """Every `bamboo.x.y` the pages name is a module of the package (or a name in one)."""
    missing = []
    for page in PAGES:
        for name in sorted(set(MODULE_PATTERN.findall(page.read_text(encoding="utf-8")))):
            if name not in NOT_MODULES and not resolves(name):
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, "names the pages give that the package lacks:\n" + "\n".join(missing)
    assert resolves("bamboo.chaos.bits.bits_must_match")
    assert not resolves("bamboo.chaos.bits.no_such_rule") and not resolves("bamboo.nosuch")


def _module_table() -> set[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    return set(re.findall(r"^\| `(bamboo/[\w/]+\.py)` \|", text, flags=re.M))


def test_the_module_table_lists_every_module() -> None:
    """docs/architecture.md's module table names every module of bamboo/ and no other (no line
    counts: what each module is for, which a reader needs, not how long it is)."""
    src = REPO / "src"
    tree = {str(p.relative_to(src)) for p in (src / "bamboo").rglob("*.py")}
    table = _module_table()
    assert len(table) > 100, "the module table was not found"
    assert sorted(tree - table) == [], "modules missing from docs/architecture.md's table"
    assert sorted(table - tree) == [], "docs/architecture.md's table names modules that are gone"

