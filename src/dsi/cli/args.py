"""Argument types of the commands' flags: numbers with their allowed range, and file paths.

argparse calls a type while it parses, so a bad value ends the command before any work: exit 2
and one line, ``dsi CMD: error: --sp=0 must be an integer >= 1``, naming the flag and the value as
the commands' own checks do (:func:`flag_message`). Every numeric flag of every command is one
of :class:`Number`'s, and every path flag one of :func:`input_file`, :func:`output_file` or
:func:`output_dir` (tests/unit/cli/test_flag_types.py walks the parser and checks each). What a
flag's value means together with another flag is checked in the command, with the same kind of
message.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dsi.transport.base import MAX_SERVERS


_ASCII_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")


def ascii_int(text: str) -> int:
    """``text`` as an int written in ASCII digits; ``ValueError`` otherwise (``int`` alone also reads
    ``"٥"`` as 5 and ``"1_000"``), and, as ``int`` raises it, for more than 4300 digits."""
    if _ASCII_INTEGER.fullmatch(text) is None:
        raise ValueError(f"{text!r} is not an integer written in ASCII digits")
    return int(text)


@dataclass(frozen=True)
class Number:
    """An ``int`` or finite ``float`` flag value within ``[low, high]`` (an end open where
    ``low_open`` / ``high_open``; None: unbounded). ``sample`` is a value inside, for tests."""

    kind: type = int
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{what} in {left}{_show(self.low)}, {_show(self.high)}{right}"
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '>='} {_show(self.low)}"
        if self.high is not None:
            return f"{what} {'<' if self.high_open else '<='} {_show(self.high)}"
        return what

    def __call__(self, text: str) -> int | float:
        try:
            if not text.isascii():  # int and float also read other scripts' digits ("٥", "١.٥")
                raise ValueError(text)
            value = ascii_int(text) if self.kind is int else self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} must be {self.describe()}") from None
        if not math.isfinite(value) or not self.contains(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {self.describe()}")
        return value

    def contains(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))

    def sample(self) -> str:
        """A value inside the range (for tests and examples)."""
        if self.low is None:
            return "0" if self.high is None or self.high > 0 else str(self.kind(self.high) - 1)
        if self.high is None:
            return str(self.kind(self.low) + 1)
        middle = (self.low + self.high) / 2
        return str(round(middle) if self.kind is int else middle)


def _show(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


COUNT = Number(int, 1)  # how many of something, at least one
SERVERS = Number(int, 1, MAX_SERVERS)  # target servers (--sp): dsi.transport.MAX_SERVERS at most
NATURAL = Number(int, 0)  # a count that may be 0 (0 often switches the thing off)
SEED = Number(int, 0, 2**63 - 1)
POSITIVE = Number(float, 0, low_open=True)  # a time, a latency
NON_NEGATIVE = Number(float, 0)
PROBABILITY = Number(float, 0, 1)  # a rate in [0, 1]


def auto_or(number: Number, what: str):
    """A flag type taking ``auto`` (any case) or a ``number``; ``what`` says what the number is."""

    def parse(text: str) -> int | str:
        if text.strip().lower() == "auto":
            return "auto"
        try:
            return number(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r} must be {number.describe()} or 'auto' ({what})") from None

    return parse


LOOKAHEAD = auto_or(COUNT, "k drafts a window, or DSI's event-driven windows")  # --lookahead


def draft_tree(text: str) -> str:
    """``--draft-tree``: ``off``, ``auto`` (``auto:F``: its floor fixed), ``branches`` (``branches:F``),
    ``best-first`` or widths per depth such as ``3,2,1`` (:func:`dsi.trees.parse_shape`), returned in its
    canonical spelling."""
    from dsi.errors import ConfigError
    from dsi.trees import parse_shape

    try:
        shape = parse_shape(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} must be off, auto, branches, best-first, or widths per depth such "
                                         "as 3,2,1 (integers >= 1); auto:F and branches:F fix the floor (F in (0, 1])"
                                         ) from None
    return "off" if shape is None else shape.name


DRAFT_TREE = draft_tree


MERGES = auto_or(NATURAL, "shared tokens per position whose merged tokens are drafted; 0: none")  # --merges


def engine_url(text: str) -> str:
    """An engine's URL as OpenAI clients take it (``http://host:port/v1``: :func:`dsi.models.engines.target.check_url`),
    checked while parsing; whether it answers is checked when the decoder connects."""
    from dsi.errors import ConfigError
    from dsi.models.engines.target import check_url

    try:
        return check_url(text, "engine")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("engine server URL ", "")) from None


ENGINE_URL = engine_url


def scoring_port(text: str) -> int | None:
    """``dsi serve --scoring-port``: a port in [1, 65535], ``auto`` (0: the OS picks a free one) or
    ``off`` (None: no scoring channel)."""
    word = text.strip().lower()
    if word in ("off", "auto"):
        return None if word == "off" else 0
    try:
        port = ascii_int(word)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} must be a port in [1, 65535], 'auto' or 'off'") from None
    return port


SCORING_PORT = scoring_port


def input_file(text: str) -> str:
    """A file that must exist and be readable."""
    source = Path(text).expanduser()
    if not source.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not source.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(source, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def output_file(text: str) -> str:
    """A file that can be written: not a directory, in a folder that exists and is writable."""
    target = Path(text).expanduser()
    if target.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    _check_folder(text, target.parent)
    if target.exists() and not os.access(target, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


def output_dir(text: str) -> str:
    """A directory to write files into: an existing writable one, or one that can be made (with its
    missing parents) below a writable directory."""
    target = Path(text).expanduser()
    if target.exists() and not target.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give a directory")
    if target.is_dir():
        if not os.access(target, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text!r} is not writable")
        return text
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} cannot be made: {str(ancestor)!r} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be made: {str(ancestor)!r} is not writable")
    return text


def _check_folder(text: str, folder: Path) -> None:
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} is not writable")


_TYPE_ERROR = re.compile(r"^argument (?P<flags>[-\w/]+): "
                         r"(?P<value>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")(?P<rest>.*)$")


def flag_message(message: str) -> str:
    """argparse's ``argument --sp/-s: '0' must be ...`` of one of these types, as the commands say it:
    ``--sp=0 must be ...`` (a number bare, any other value quoted). Other messages are kept."""
    match = _TYPE_ERROR.match(message)
    if match is None:
        return message
    flag = max(match["flags"].split("/"), key=len)
    value = ast.literal_eval(match["value"])
    try:
        float(value)
        shown = value
    except ValueError:
        shown = match["value"]
    return f"{flag}={shown}{match['rest']}"
