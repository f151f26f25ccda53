"""``dsi generate`` and ``dsi demo`` through ``main(argv)`` on tiny random HF models."""

from __future__ import annotations

import argparse
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dsi.cli.main import main  # noqa: E402
from dsi.errors import ConfigError  # noqa: E402
from tests.tiny_hf import make_model_dir  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(make_model_dir(root / "target", seed=0, layers=2)), str(make_model_dir(root / "drafter", seed=0, layers=1))


def run_json(capsys, argv):
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


@pytest.mark.parametrize("method, lookahead", [("ar", "3"), ("si", "3"), ("dsi", "3"), ("dsi", "auto")])
def test_generate_json_matches_transformers_greedy(pair_dirs, capsys, method, lookahead):
    import transformers

    target, drafter = pair_dirs
    doc = run_json(capsys, ["generate", "--target", target, "--drafter", drafter, "--prompt", "def add(a, b):",
                            "--method", method, "--max-new-tokens", "12", "--dtype", "fp32",
                            *(["--sp", "2"] if method == "dsi" else []), "--lookahead", lookahead, "--json"])
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(target)
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=model.config.eos_token_id,
                         pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert doc["token_ids"] == ref
    assert doc["text"] == tok.decode(ref, skip_special_tokens=True)
    assert doc["stats"]["method"] == method and doc["stats"]["new_tokens"] == len(ref)
    for key in ("acceptance_rate", "mean_accepted_length", "preempted_tasks", "wall_time_s", "verify_tasks"):
        assert key in doc["stats"]
    if method == "dsi":
        assert doc["stats"]["lookahead"] == (lookahead if lookahead == "auto" else int(lookahead))
        # drafts per window: at most k (0 when every epoch ended before a window was due)
        assert 0 <= doc["stats"]["mean_window"] <= (12 if lookahead == "auto" else int(lookahead))


def test_generate_streams_text_and_accepts_prompt_ids(pair_dirs, capsys):
    target, drafter = pair_dirs
    doc = run_json(capsys, ["generate", "--target", target, "--drafter", drafter, "--prompt-ids", "5,6,7",
                            "--max-new-tokens", "8", "--dtype", "fp32", "--json"])
    code = main(["generate", "--target", target, "--drafter", drafter, "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "8", "--dtype", "fp32"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.rstrip("\n") == doc["text"]  # streamed text equals the final decode
    assert f"[{doc['stats']['method']}] 8 tokens in" in captured.err


def test_generate_sampling_is_seeded(pair_dirs, capsys):
    target, drafter = pair_dirs
    # DSI named: a seed gives the same tokens for any SP within one method (auto could pick another
    # method for another SP, and methods draw their uniforms differently, by design)
    argv = ["generate", "--target", target, "--drafter", drafter, "--prompt", "hello", "--max-new-tokens", "10",
            "--dtype", "fp32", "--temperature", "1.0", "--method", "dsi", "--json"]
    a = run_json(capsys, argv + ["--seed", "1"])
    b = run_json(capsys, argv + ["--seed", "1", "--sp", "3"])
    c = run_json(capsys, argv + ["--seed", "2"])
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_generate_chat_template(pair_dirs, capsys):
    target, drafter = pair_dirs
    doc = run_json(capsys, ["generate", "--target", target, "--drafter", drafter, "--prompt", "hi", "--chat",
                            "--max-new-tokens", "4", "--dtype", "fp32", "--json"])
    assert doc["prompt_tokens"] > 5  # the template wrapped the two-character prompt


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,x"], "--prompt-ids='1,x' must be comma-separated integers"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens=0"),
    (["--prompt", "hi", "--max-new-tokens", "1000"], "exceeds the context"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature=-1"),
    (["--prompt", "hi", "--lookahead", "0"], "--lookahead=0 must be an integer >= 1 or 'auto'"),
    (["--prompt", "hi", "--lookahead", "soon"], "--lookahead='soon' must be an integer >= 1 or 'auto'"),
    (["--prompt", "hi", "--lookahead", "3", "--max-window", "2"], "max_window=2 applies to lookahead='auto' only"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt", "hi", "--logprobs", "2"], "--logprobs reports the log-probabilities in the JSON output: add --json"),
    (["--prompt", "hi", "--logit-bias", "5:1"], "--logit-bias='5:1' must be ID=BIAS pairs"),
    (["--prompt", "hi", "--stop-token-ids", "1,,2"], "--stop-token-ids='1,,2' must be comma-separated"),
    (["--prompt", "hi", "--presence-penalty", "3"], "--presence-penalty=3 must be a number in [-2, 2]"),
    (["--prompt", "hi", "--logit-bias", "99999=1"], "logit_bias names token id(s) [99999] outside the vocabulary"),
    # ASCII digits only: int() reads "٥" as 5 (issue 64)
    (["--prompt", "hi", "--logit-bias", "٥=1"], "--logit-bias='٥=1' must be ID=BIAS pairs"),
    (["--prompt-ids", "1,٥"], "--prompt-ids='1,٥' must be comma-separated integers"),
])
def test_generate_errors(pair_dirs, capsys, argv, message):
    target, drafter = pair_dirs
    try:
        code = main(["generate", "--target", target, "--drafter", drafter, "--dtype", "fp32", *argv])
    except SystemExit as exc:  # argparse's own errors (a malformed --lookahead)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err


def test_generate_missing_model_path(capsys, tmp_path):
    code = main(["generate", "--target", str(tmp_path / "nope"), "--drafter", str(tmp_path / "nope"), "--prompt", "x"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_json_reports_identical_outputs(pair_dirs, capsys):
    target, drafter = pair_dirs
    code = main(["demo", "--target", target, "--drafter", drafter, "--dtype", "fp32", "--prompts", "2",
                 "--max-new-tokens", "10", "--sp", "1", "2", "--full", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["all_identical"] is True
    methods = {r["method"] for r in doc["rows"]}
    compared = {"non-SI", "SI k=5", "DSI k=5 SP=1", "DSI k=auto SP=1", "DSI k=5 SP=2", "DSI k=auto SP=2"}
    picked = doc["auto"]["label"]  # the automatic choice, shown next to the fixed methods it compared
    assert methods == compared | {picked}
    assert len(doc["rows"]) == 2 * len(methods)
    assert doc["auto"]["num_target_servers"] <= 2 and doc["auto"]["reason"].startswith(picked)
    for row in doc["rows"]:
        assert row["identical"] and row["latency_s"] > 0 and row["new_tokens"] == 10


def test_the_quick_demo_runs_every_method_on_the_same_prompts_with_event_driven_dsi(pair_dirs, capsys):
    target, drafter = pair_dirs
    code = main(["demo", "--target", target, "--drafter", drafter, "--dtype", "fp32", "--max-new-tokens", "6",
                 "--no-auto", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["plan"] == "quick" and doc["prompts"] == 2 and doc["all_identical"] is True
    assert {r["method"] for r in doc["rows"]} == {"non-SI", "SI k=5", "DSI k=auto SP=1"}
    assert sorted(r["prompt"] for r in doc["rows"]) == [0, 0, 0, 1, 1, 1]  # each method on each prompt


def test_demo_plans(tmp_path):
    from dsi.cli.generate import FULL_DEMO, QUICK_DEMO, DemoPlan, demo_plan

    def plan(*flags):
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        from dsi.cli.generate import register

        register(sub)
        return demo_plan(parser.parse_args(["demo", *flags]))

    assert plan() == QUICK_DEMO == DemoPlan(2, 48, None)
    assert plan("--full") == FULL_DEMO == DemoPlan(3, 64, 5)
    assert plan("-k", "3") == DemoPlan(2, 48, 3)  # a lookahead asked for adds DSI with that fixed k
    assert plan("--full", "--prompts", "1", "--max-new-tokens", "8", "-k", "2") == DemoPlan(1, 8, 2)
    prompts = tmp_path / "prompts.txt"  # --prompts takes a file too, as selftest's and measure's do
    prompts.write_text('def f(x):\n"class A:\\n    def __init__"\nimport os\n', encoding="utf-8")
    assert plan("--prompts", str(prompts)) == DemoPlan(3, 48, None)
    with pytest.raises(ConfigError, match=r"--prompts=5 must be in \[1, 4\] \(built-in prompts\), or a file"):
        plan("--prompts", "5")
    for text in ("²", "5" * 5000):  # digits to str.isdigit that int() refuses: named, not a bare ValueError
        with pytest.raises(ConfigError, match=r"--prompts='.*' must be a count of built-in prompts in \[1, 4\]"):
            plan("--prompts", text)


def test_generate_target_devices_and_transport_errors(pair_dirs, capsys):
    target, drafter = pair_dirs
    base = ["generate", "--target", target, "--drafter", drafter, "--prompt", "def", "--max-new-tokens", "6",
            "--dtype", "fp32", "--json"]
    plain = run_json(capsys, base)
    placed = run_json(capsys, base + ["--sp", "2", "--target-devices", "cpu,cpu"])
    assert placed["token_ids"] == plain["token_ids"]
    assert main(base + ["--ray-address", "auto"]) == 2
    assert "--ray-address needs --transport ray" in capsys.readouterr().err
    assert main(base + ["--target-devices", " , "]) == 2
    assert "names no device" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_on_process_servers_matches_threads(pair_dirs, capsys):
    target, drafter = pair_dirs
    base = ["generate", "--target", target, "--drafter", drafter, "--prompt", "for i in", "--max-new-tokens", "8",
            "--dtype", "fp32", "--sp", "2", "--json"]
    threads = run_json(capsys, base)
    processes = run_json(capsys, base + ["--transport", "processes"])
    assert processes["token_ids"] == threads["token_ids"]


def test_demo_explains_dsi_trailing_si_on_a_shared_cpu():
    from dsi.cli.generate import shared_hardware_note

    slower = {"non-SI": 40.0, "SI k=5": 25.0, "DSI k=5 SP=1": 33.0, "DSI k=5 SP=2": 31.0}
    note = shared_hardware_note("cpu", None, slower, 2, [1, 2])
    assert note is not None and "2 target servers share 2 CPU cores" in note and "--target-devices" in note
    faster = dict(slower, **{"DSI k=5 SP=2": 20.0})
    assert shared_hardware_note("cpu", None, faster, 2, [1, 2]) is None  # DSI won: nothing to explain
    assert shared_hardware_note("cuda:0", None, slower, 2, [1]) is None  # not a CPU
    assert shared_hardware_note("cpu", "cuda:1", slower, 2, [1]) is None  # servers have devices of their own


def test_demo_places_dsi_servers_on_target_devices(pair_dirs, capsys):
    target, drafter = pair_dirs
    code = main(["demo", "--target", target, "--drafter", drafter, "--dtype", "fp32", "--prompts", "1",
                 "--max-new-tokens", "6", "--sp", "2", "--target-devices", "cpu,cpu", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["all_identical"] is True
    assert doc["note"] is None  # servers with devices of their own: no shared-CPU note
    assert main(["demo", "--target", target, "--drafter", drafter, "--target-devices", " , ", "--json"]) == 2
    assert "names no device" in capsys.readouterr().err


def test_generate_with_auto_picking_non_si_frees_the_drafter_before_decoding(pair_dirs, capsys, monkeypatch):
    import dsi.evaluate.autotune as autotune
    import dsi.models.loading as loading

    target, drafter = pair_dirs
    choice = autotune.AutoChoice("ar", 1, 1, "non-SI by test", (), {}, 0.5, 32, "k", "now")
    monkeypatch.setattr(autotune, "choose_method", lambda *a, **k: choice)
    released = []
    monkeypatch.setattr(loading, "release", lambda model: released.append(model.name))
    base = ["generate", "--target", target, "--drafter", drafter, "--prompt", "def", "--max-new-tokens", "6",
            "--dtype", "fp32", "--json"]
    assert main(base) == 0
    captured = capsys.readouterr()
    auto = json.loads(captured.out)
    # with --json the measuring is quiet, and the pick is still said, on stderr
    assert captured.err.count("[auto] picked non-SI: non-SI by test") == 1
    plain = run_json(capsys, base + ["--method", "ar"])
    assert auto["token_ids"] == plain["token_ids"] and auto["stats"]["method"] == "ar"
    assert auto["stats"]["auto"]["picked"] == "non-SI"
    assert released == [drafter]  # the drafter went before decoding; --method ar never loaded it


def test_generate_deterministic_makes_every_method_equal_non_si_in_bf16(pair_dirs, capsys):
    target, drafter = pair_dirs
    base = ["generate", "--target", target, "--drafter", drafter, "--prompt", "def fibonacci(n):",
            "--max-new-tokens", "12", "--dtype", "bf16", "--json"]
    default = run_json(capsys, base + ["--method", "ar"])
    assert default["deterministic"] is False
    runs = [run_json(capsys, base + ["--deterministic", *flags]) for flags in
            (["--method", "ar"], ["--method", "si", "-k", "3"], ["--method", "dsi", "-k", "auto", "--sp", "2"])]
    assert all(r["deterministic"] is True for r in runs)
    assert runs[1]["token_ids"] == runs[0]["token_ids"] == runs[2]["token_ids"]
    assert run_json(capsys, base + ["--no-deterministic", "--method", "ar"])["deterministic"] is False


def refusal(capsys, argv, message):
    """``argv`` with models that do not exist: exit 2 naming ``message``, before any model was looked at."""
    code = main([*argv, "--target", "/nonexistent/never-loaded", "--drafter", "/nonexistent/never-loaded"])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "never-loaded" not in err
    return err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--sp", "1", "0"], "--sp=0 must be an integer in [1, 256]"),
    (["demo", "--repeats", "0"], "--repeats=0 must be an integer >= 1"),
    (["serve", "--max-queue", "-1"], "--max-queue=-1 must be an integer in [0, 4096]"),
    (["serve", "--max-concurrent", "0"], "--max-concurrent=0 must be an integer in [1, 256]"),
])
def test_a_bad_number_is_named_alone_before_anything_loads(capsys, argv, message):
    err = refusal(capsys, argv, message)
    if "--max-queue" in argv:
        assert "--max-concurrent" not in err  # a valid value is not blamed


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt-ids", "1,2", "--chat"], "--chat applies a chat template to --prompt text"),
    (["generate", "--prompt-ids", "1,,2"], "--prompt-ids='1,,2' must be comma-separated integers, with none empty"),
    (["generate", "--prompt-ids", ","], "with none empty"),
    (["generate", "--prompt", "x", "--method", "si", "--sp", "4"], "--sp=4 sets DSI's target servers; --method si"),
    (["serve", "--method", "ar", "--sp", "2"], "--sp=2 sets DSI's target servers; --method ar"),
    (["serve", "--served-model-name", " "], "--served-model-name=' ' must name the model"),
])
def test_flags_that_would_be_ignored_or_misread_are_refused(capsys, argv, message):
    refusal(capsys, argv, message)


def test_prompt_ids_with_a_trailing_comma_are_read(pair_dirs, capsys):
    target, drafter = pair_dirs
    code = main(["generate", "--target", target, "--drafter", drafter, "--dtype", "fp32", "--method", "ar",
                 "--prompt-ids", "5,6,7,", "--max-new-tokens", "2", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    import json

    assert json.loads(out.out)["prompt_tokens"] == 3


def test_the_summary_line_reports_only_what_the_method_has(pair_dirs, capsys):
    target, drafter = pair_dirs
    for method, has_acceptance, has_preemption in (("ar", False, False), ("si", True, False), ("dsi", True, True)):
        code = main(["generate", "--target", target, "--drafter", drafter, "--dtype", "fp32", "--method", method,
                     "--prompt", "def add(a, b):", "--max-new-tokens", "3"])
        err = capsys.readouterr().err
        assert code == 0
        line = next(x for x in err.splitlines() if x.startswith(f"[{method}]"))
        assert ("acceptance" in line) == has_acceptance and ("preempted" in line) == has_preemption, line


@pytest.mark.parametrize("make_argv, message", [
    (lambda d: ["selftest", "--prompts", str(d / "missing.txt")], "--prompts='{d}/missing.txt' does not exist"),
    (lambda d: ["selftest", "--prompts", str(d)], "--prompts='{d}' is not a file"),
    (lambda d: ["demo", "--prompts", str(d / "missing.txt")], "--prompts='{d}/missing.txt' does not exist"),
    (lambda d: ["measure", "latency", "--model", "/nonexistent/m", "--out", str(d / "no" / "x.json")],
     "the folder '{d}/no' does not exist"),
    (lambda d: ["measure", "acceptance", "--target", "/nonexistent/t", "--drafter", "/nonexistent/d",
                "--out", str(d)], "--out='{d}' is a directory"),
    (lambda d: ["measure", "latency", "--model", "/nonexistent/m", "--prompts", str(d / "p.txt")],
     "neither a built-in set"),
    (lambda d: ["bench", "--scenario", "default", "--tokens", "5", "--repeats", "1", "--out", str(d / "no" / "x.json")],
     "the folder '{d}/no' does not exist"),
])
def test_bad_paths_exit_2_with_one_line_before_any_work(capsys, tmp_path, make_argv, message):
    argv = make_argv(tmp_path)
    if argv[0] in ("selftest", "demo"):
        argv += ["--target", "/nonexistent/never-loaded", "--drafter", "/nonexistent/never-loaded"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(d=tmp_path) in err and "Traceback" not in err, err
    assert "never-loaded" not in err and "/nonexistent/m" not in err  # before any model was looked at


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--method", "dsi", "--target-devices", "cuda:7"], "--target-devices='cuda:7': device"),
    (["generate", "--prompt", "hi", "--method", "dsi", "--target-devices", "bogus"], "is not a valid device"),
    (["generate", "--prompt", "hi", "--method", "si", "--target-devices", "bogus"],
     "--target-devices places DSI's target servers; --method si runs one target"),
    (["serve", "--method", "dsi", "--target-devices", "cuda:3"], "--target-devices='cuda:3'"),
    (["demo", "--target-devices", "nope"], "is not a valid device"),
])
def test_target_devices_are_checked_once_before_anything_loads(capsys, argv, message):
    err = refusal(capsys, argv, message)
    assert len(err.strip().splitlines()) == 1 and "died" not in err  # one line, no server restarted in a loop


def test_n_choices_are_the_runs_of_their_derived_seeds(pair_dirs, capsys):
    """``--n 3``: choice i is the run with seed choice_seed(seed, i) (as dsi serve's choice i), for DSI too;
    greedy choices are one run, copied."""
    from dsi.sampling import choice_seed

    target, drafter = pair_dirs
    base = ["generate", "--target", target, "--drafter", drafter, "--prompt", "def add(a, b):", "--dtype", "fp32",
            "--max-new-tokens", "6", "--method", "dsi", "--sp", "2", "-k", "2", "--temperature", "1.5", "--json"]
    doc = run_json(capsys, [*base, "--seed", "5", "--n", "3", "--logprobs", "1"])
    choices = doc["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and doc["prompt_tokens"] > 0
    for i, choice in enumerate(choices):
        alone = run_json(capsys, [*base, "--seed", str(choice_seed(5, i)), "--logprobs", "1"])
        assert choice["token_ids"] == alone["token_ids"] and choice["text"] == alone["text"]
        assert [e["token"] for e in choice["logprobs"]] == choice["token_ids"]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # independent samples, not copies
    greedy = run_json(capsys, [*base[:-3], "--n", "2", "--json"])["choices"]
    assert greedy[0]["token_ids"] == greedy[1]["token_ids"]
    code = main([*base[:-1], "--n", "2", "--seed", "5"])  # text: both choices, each after a separator
    out = capsys.readouterr()
    assert code == 0 and out.out.count("--- choice 1 ---") == 1 and "(choice 1)" in out.err
