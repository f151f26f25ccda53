"""Class-wide checks of every command's flags (issue 23), walking the real parser.

- Every flag that takes a value is a :class:`dsi.cli.args.Number` with its range, a path type, a
  choice, or listed in ``TEXT_FLAGS`` with where its text is checked; a new ``type=int`` fails here.
- Every numeric flag refuses each value outside its range, and NaN / inf / non-numbers, while
  parsing (before any work): exit 2 and one line naming the flag and the value.
- Every path flag refuses a missing input, a directory for a file, a missing folder.
- No error message in the library states a numeric bound without the value it got.
"""

from __future__ import annotations

import argparse
import ast
import pathlib

import pytest

from dsi.cli.args import (DRAFT_TREE, ENGINE_URL, LOOKAHEAD, MERGES, SCORING_PORT, Number, flag_message, input_file,
                          output_dir, output_file)
from dsi.cli.main import build_parser

PATH_TYPES = (input_file, output_file, output_dir)

# Flags whose value is text, and where that text is checked (tests named where it is refused).
TEXT_FLAGS = {
    "--prompt": "any text",
    "--prompt-ids": "comma-separated ids: test_generate (1,,2 refused)",
    "--target": "a model: loading says what is missing",
    "--drafter": "a model: loading says what is missing",
    "--model": "a model: loading says what is missing",
    "--device": "torch device: dsi.models.devices checks it before loading",
    "--ray-address": "needs --transport ray: test_generate",
    "--target-devices": "checked before loading: test_generate",
    "--target-servers": "URLs, checked before loading: test_generate / test_engines",
    "--logit-bias": "ID=BIAS pairs: test_generate, SamplingParams bounds",
    "--stop-token-ids": "comma-separated ids: test_generate",
    "--host": "an address; binding it reports a bad one: test_cli_serve",
    "--api-key": "printable ASCII: ServeConfig",
    "--served-model-name": "non-empty: test_cli_serve",
    "--panel": "a panel name: dsi.sim.heatmap.check_panels",
    "--rows": "row numbers: test_cli_sim",
    "--prompts": "demo: N or a file; measure: a set or a file; checked before work: test_generate",
    "--regex": "a pattern: llguidance refuses a bad one with its message: test_constraints",
    "--choice": "any text (one option; empty refused by Constraint.choice): test_constraints",
}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        elif action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
            yield path, parser, action


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _sample(action: argparse.Action) -> str:
    if isinstance(action.type, Number):
        return action.type.sample()
    if action.choices:
        return str(next(iter(action.choices)))
    return "1" if action.type is LOOKAHEAD else "x"


def _base(parser: argparse.ArgumentParser, path: tuple[str, ...], skip: argparse.Action) -> list[str]:
    """The sub-command and a valid value for each required flag (``skip``: the one under test)."""
    argv = list(path)
    for action in parser._actions:
        if action.required and action.option_strings and action is not skip:
            argv += [action.option_strings[0], _sample(action)]
    for group in parser._mutually_exclusive_groups:
        if group.required and skip not in group._group_actions:
            argv += [group._group_actions[0].option_strings[0], "x"]
    return argv


FLAGS = list(_walk(build_parser()))
NUMBERS = [(p, parser, a) for p, parser, a in FLAGS if isinstance(a.type, Number)]


def _bad_values(number: Number) -> list[str]:
    step = 1 if number.kind is int else 0.5
    bad = ["x", "nan", "inf", "-inf"]
    # a value inside the range in Arabic-Indic digits, which int() and float() read (issue 64): ASCII digits only
    bad.append(number.sample().translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")))
    if number.kind is int:
        bad.append("1.5")
    if number.low is not None:
        bad.append(_text(number.low if number.low_open else number.low - step))
    if number.high is not None:
        bad.append(_text(number.high if number.high_open else number.high + step))
    return bad


def _text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _shown(text: str) -> str:
    try:
        float(text)
    except ValueError:
        return repr(text)
    return text


def _refused(capsys, parser, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert err.count("\n") == 1, err  # one line, no usage dump
    return err


def test_every_flag_with_a_value_is_typed_or_a_choice_or_listed():
    unchecked = sorted({f"{' '.join(path)} {_flag(a)}" for path, _, a in FLAGS
                        if not (isinstance(a.type, Number) or a.type in (*PATH_TYPES, LOOKAHEAD, DRAFT_TREE, MERGES, ENGINE_URL, SCORING_PORT)
                                or a.choices)
                        and _flag(a) not in TEXT_FLAGS})
    assert not unchecked, f"flags without a checked type (use dsi.cli.args): {unchecked}"
    assert len(NUMBERS) > 80  # the walk reaches every sub-command (measure's too)
    assert {p for p, _, _ in NUMBERS} >= {("generate",), ("demo",), ("serve",), ("selftest",), ("bench",),
                                          ("simulate",), ("heatmap",), ("table",), ("plan",),
                                          ("measure", "latency"), ("measure", "acceptance")}


@pytest.mark.parametrize("path, parser, action", NUMBERS, ids=[f"{' '.join(p)} {_flag(a)}" for p, _, a in NUMBERS])
def test_every_numeric_flag_refuses_what_is_outside_its_range_naming_flag_and_value(capsys, path, parser, action):
    number, flag = action.type, _flag(action)
    defaults = action.default if isinstance(action.default, list) else [action.default]
    assert all(d is None or number.contains(d) for d in defaults), (flag, action.default)
    base = _base(parser, path, action)
    root = build_parser()
    for text in _bad_values(number):
        err = _refused(capsys, root, [*base, f"{flag}={text}"])  # = form: -inf is no option
        assert f"{flag}={_shown(text)} must be {number.describe()}" in err, err
    parsed = vars(root.parse_args([*base, flag, number.sample()]))
    value = parsed[action.dest]
    value = value[0] if isinstance(value, list) else value
    assert isinstance(value, number.kind) and number.contains(value)


AUTO_OR = {LOOKAHEAD: ("an integer >= 1", ("0", "-3", "fast", "2.5"), ("1", 1)),
           MERGES: ("an integer >= 0", ("-1", "x", "1.5", ""), ("0", 0))}


@pytest.mark.parametrize("command, kind", [(p, a.type) for p, _, a in FLAGS if a.type in AUTO_OR],
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_auto_or_number_flags_take_auto_or_their_number(capsys, command, kind):
    """``--lookahead`` (k or DSI's event-driven windows) and ``--merges`` (a count, or chosen by the drafter's
    hardware): ``auto`` in any case, or their number, anything else refused naming the value."""
    root = build_parser()
    parser, action = next((parser, a) for p, parser, a in FLAGS if p == command and a.type is kind)
    base, flag = _base(parser, command, action), _flag(action)
    number, bad, (text, value) = AUTO_OR[kind]
    for given in bad:
        err = _refused(capsys, root, [*base, f"{flag}={given}"])
        assert f"{flag}={_shown(given)} must be {number} or 'auto'" in err, err
    for given, want in (("AUTO", "auto"), (f" {text}", value)):
        parsed = vars(root.parse_args([*base, flag, given]))[action.dest]
        assert parsed in (want, [want])


@pytest.mark.parametrize("command", [p for p, _, a in FLAGS if a.type is DRAFT_TREE], ids=" ".join)
def test_draft_tree_flags_take_off_auto_or_widths(capsys, command):
    root = build_parser()
    parser, action = next((parser, a) for p, parser, a in FLAGS if p == command and a.type is DRAFT_TREE)
    base = _base(parser, command, action)
    for text in ("0", "2,0", "wide", "2,,1", "1.5", "auto:0", "auto:1.5", "auto:x", "branches:0", "branch"):
        err = _refused(capsys, root, [*base, f"--draft-tree={text}"])
        assert f"--draft-tree={_shown(text)} must be off, auto, branches, best-first, or widths per depth" in err, err
    for text, canonical in (("AUTO", "auto"), (" 3, 2,1", "3,2,1"), ("chain", "off"), ("Best-First", "best-first"),
                            ("auto:0.30", "auto:0.3"), ("Auto:1", "auto:1"), ("Branches", "branches"),
                            ("branches:0.050", "branches:0.05")):
        assert vars(root.parse_args([*base, "--draft-tree", text]))["draft_tree"] == canonical


@pytest.mark.parametrize("command", sorted({p for p, _, a in FLAGS if a.type is ENGINE_URL}), ids=" ".join)
def test_engine_url_flags_are_checked_while_parsing(capsys, command):
    root = build_parser()
    parser, action = next((parser, a) for p, parser, a in FLAGS if p == command and a.type is ENGINE_URL)
    base, flag = _base(parser, command, action), _flag(action)
    for text, says in (("ftp://h:8000/v1", "must start with http:// or https://"), ("http://h:99999/v1", "invalid port"),
                       ("http://h:8000", "must end in /v1"), ("", "must be a non-empty string")):
        err = _refused(capsys, root, [*base, f"{flag}={text}"])
        assert f"{flag}={text!r}" in err and says in err, err
    assert vars(root.parse_args([*base, flag, "http://10.0.0.4:8002/v1/"]))[action.dest] == "http://10.0.0.4:8002/v1"


def test_the_scoring_port_is_a_port_auto_or_off(capsys):
    root = build_parser()
    for text in ("0", "65536", "-1", "8001.5", "on"):
        err = _refused(capsys, root, ["serve", f"--scoring-port={text}"])
        assert f"--scoring-port={_shown(text)} must be a port in [1, 65535], 'auto' or 'off'" in err, err
    for text, port in (("auto", 0), ("OFF", None), ("8001", 8001)):
        assert root.parse_args(["serve", "--scoring-port", text]).scoring_port == port
    assert root.parse_args(["serve"]).scoring_port == 0


PATHS = [(p, parser, a) for p, parser, a in FLAGS if a.type in PATH_TYPES]


@pytest.mark.parametrize("path, parser, action", PATHS, ids=[f"{' '.join(p)} {_flag(a)}" for p, _, a in PATHS])
def test_every_path_flag_is_checked_while_parsing(capsys, tmp_path, path, parser, action):
    flag, root = _flag(action), build_parser()
    base = _base(parser, path, action)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x\n")
    if action.type is input_file:
        cases = {str(tmp_path / "missing"): "does not exist", str(tmp_path): "is not a file"}
        good = str(a_file)
    elif action.type is output_file:
        cases = {str(tmp_path): "is a directory", str(tmp_path / "no" / "x.json"): "does not exist"}
        good = str(tmp_path / "out.json")
    else:
        cases = {str(a_file): "is a file; give a directory", str(a_file / "sub"): "cannot be made"}
        good = str(tmp_path / "new" / "dir")
    for text, why in cases.items():
        err = _refused(capsys, root, [*base, flag, text])
        assert f"{flag}={text!r}" in err and why in err, err
    root.parse_args([*base, flag, good])
    assert not (tmp_path / "new").exists()  # checking makes nothing


def test_flag_message_keeps_what_is_not_one_of_these_types():
    assert flag_message("argument --backend: invalid choice: 'x'") == "argument --backend: invalid choice: 'x'"
    assert flag_message("argument --sp/-s: '0' must be an integer >= 1") == "--sp=0 must be an integer >= 1"
    assert flag_message("argument --out: 'a b' is a directory") == "--out='a b' is a directory"


def test_number_ranges_read_as_they_check():
    assert Number(int, 1).describe() == "an integer >= 1"
    assert Number(float, 0, 1, low_open=True).describe() == "a number in (0, 1]"
    unit = Number(float, 0, 1, low_open=True, high_open=True)
    assert [unit.contains(v) for v in (0.0, 1e-9, 0.5, 1.0)] == [False, True, True, False]
    assert Number(int, -1).contains(-1) and not Number(int, -1).contains(-2)


BOUND_WORDS = (">=", "<=", " > ", " < ", "in [", "in (", "an integer", "a number")


def test_no_library_message_states_a_numeric_bound_without_the_value():
    """A raised message (ConfigError, require, ...) saying a value must be within a bound is an
    f-string with the value in it."""
    root = pathlib.Path(__file__).parents[3] / "src" / "dsi"
    bare = []
    for file in root.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name not in ("ConfigError", "ModelError", "require", "ArgumentTypeError", "ValueError"):
                continue
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "must" in arg.value and any(
                        w in arg.value for w in BOUND_WORDS):
                    bare.append(f"{file.relative_to(root)}:{node.lineno}: {arg.value[:80]}")
    assert not bare, "messages naming a bound but not the value:\n" + "\n".join(bare)
