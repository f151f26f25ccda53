"""Every ``dsi`` command the README and docs/ show uses flags its parser has: a renamed or removed
flag fails here instead of in a reader's shell. Commands are read from inline code (`dsi ...`) and
from code-block lines that start with ``dsi`` (with their ``\\`` continuations)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from dsi.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def documented_commands() -> list[tuple[str, int, str]]:
    """(file, line, command text) of every dsi command shown."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            for match in re.finditer(r"`(dsi [^`]+)`", line):
                found.append((path.name, i + 1, match.group(1)))
            stripped = line.strip()
            if stripped.startswith("dsi ") and "`" not in stripped:
                text, start = stripped, i
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                found.append((path.name, start + 1, text.split("  #")[0].split(" # ")[0]))
            i += 1
    return found


def resolve(text: str) -> tuple[str, argparse.ArgumentParser] | None:
    """The (sub)command a command line names, and its parser (None for a name that is no command)."""
    words = text.replace("\\|", "|").split()
    parser, name = build_parser(), "dsi"
    for word in words[1:]:
        choices = _subparsers(parser)
        if word not in choices:
            break
        parser, name = choices[word], f"{name} {word}"
    return (name, parser) if name != "dsi" else None


COMMANDS = documented_commands()


def test_the_docs_show_many_commands():
    assert len(COMMANDS) > 60, COMMANDS[:5]  # the reader guards itself: a broken reader finds none


@pytest.mark.parametrize("where, line, text", COMMANDS, ids=[f"{w}:{n}" for w, n, _ in COMMANDS])
def test_every_documented_flag_exists(where, line, text):
    resolved = resolve(text)
    if resolved is None:
        pytest.skip(f"{text!r} names no dsi command (prose)")
    name, parser = resolved
    known = {option for action in parser._actions for option in action.option_strings}
    unknown = sorted({flag for flag in FLAG.findall(text) if flag not in known})
    assert not unknown, f"{where}:{line}: {name} has no {', '.join(unknown)} (in {text!r})"
