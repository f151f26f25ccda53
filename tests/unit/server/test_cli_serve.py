"""``dsi serve`` as a process: binds loopback, serves the OpenAI client, exits 0 on SIGTERM and
SIGINT after closing every decoder (in flight requests finish or are cancelled)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dsi.cli.main import build_parser  # noqa: E402

pytestmark = pytest.mark.hf


def start_serve(tiny_dirs, *extra):
    target, drafter = tiny_dirs
    argv = [sys.executable, "-m", "dsi.cli.main", "serve", "--target", target, "--drafter", drafter,
            "--dtype", "fp32", "--port", "0", "--sp", "2", "-k", "3", "--max-concurrent", "2", "--threads", "1",
            "--served-model-name", "tiny", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()

    def pump():  # read stderr continuously so the process never blocks on a full pipe
        for line in proc.stderr:
            lines.append(line)
            if "/v1" in line and "on http://" in line:
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(90):
        proc.kill()
        raise AssertionError("dsi serve did not start:\n" + "".join(lines))
    url = re.search(r"on (http://[^ ]+)/v1", "".join(lines)).group(1)
    return proc, url, lines


def test_serve_process_binds_loopback_serves_and_exits_cleanly_on_sigterm(tiny_dirs):
    """(SIGINT takes the same path: both signals set uvicorn's should_exit through one handler.)"""
    proc, url, lines = start_serve(tiny_dirs)
    try:
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        # the default method is auto: the dsi object says which method it measured fastest and why
        picked = r.dsi["auto"]["picked"]
        assert r.dsi["method"] == {"non-SI": "ar", "SI": "si", "DSI": "dsi"}[picked.split()[0]]
        assert r.dsi["auto"]["reason"].startswith(picked)
        # and so do /v1/models, /health and the start-up output: what runs, not "auto"
        card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["dsi"]
        assert card["method"] == r.dsi["method"] and card["auto"]["picked"] == picked
        # the scoring channel (--scoring-port auto): on a free port of the same host, printed and in the card
        assert any(f"scoring channel on port {card['scoring_port']}" in line for line in lines), "".join(lines)
        socket.create_connection(("127.0.0.1", card["scoring_port"]), timeout=10).close()
        assert httpx.get(url + "/health", timeout=10).json()["method"] == r.dsi["method"]
        assert any(f"method auto picked {picked}" in line for line in lines), "".join(lines)
        stream = client.completions.create(model="tiny", prompt="x", max_tokens=200, temperature=0, stream=True)
        next(iter(stream))  # a request in flight at shutdown
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.1)
    assert "shut down cleanly" in "".join(lines)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_serve_parser_takes_every_generate_model_and_engine_option():
    parser = build_parser()
    args = parser.parse_args(["serve", "--target", "t", "--drafter", "d", "--dtype", "fp32", "--device", "cpu",
                              "--threads", "2", "--method", "si", "--lookahead", "4", "--sp", "3",
                              "--transport", "threads", "--max-concurrent", "2", "--max-queue", "5",
                              "--api-key", "k", "--temperature", "0", "--max-new-tokens", "32"])
    assert (args.method, args.lookahead, args.sp, args.max_concurrent, args.max_queue) == ("si", 4, 3, 2, 5)
    assert args.host == "127.0.0.1" and args.port == 8000 and args.seed is None
    generate = parser.parse_args(["generate", "--prompt", "x"])
    assert generate.temperature == 0.0 and generate.max_new_tokens == 128 and generate.seed == 0  # unchanged


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port=70000"),
    (["--max-concurrent", "0"], "--max-concurrent=0"),
    (["--max-concurrent", "257"], "--max-concurrent=257 must be an integer in [1, 256]"),  # MAX_SLOTS
    (["--max-queue", "4097"], "--max-queue=4097 must be an integer in [0, 4096]"),  # MAX_QUEUE
    (["--lookahead", "auto", "--method", "si"], "SI needs an integer lookahead"),
    (["--lookahead", "5", "--max-window", "3"], "max_window=3 applies to lookahead='auto' only"),
    (["--method", "dsi", "--sp", "0"], "--sp=0 must be an integer in [1, 256]"),
    (["--max-body-bytes", "0"], "--max-body-bytes=0 must be an integer >= 1"),
    (["--api-key", "s3cret "], "api_key (--api-key) has leading or trailing whitespace"),
    (["--api-key", "clé"], "api_key (--api-key) has a character at position 2 that is not printable ASCII"),
])
def test_serve_rejects_bad_options_before_loading(argv, message, capsys):
    from dsi.cli.main import main

    code = main(["serve", "--target", "/nonexistent", *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_serve_shows_a_name_not_the_model_path_and_answers_without_paths(tiny_dirs, tiny_pair, monkeypatch):
    """Without --served-model-name the model id is the directory's name: /health (open to anyone),
    /v1/models, responses and error bodies never show where the model lives."""
    from starlette.testclient import TestClient

    target_dir, drafter_dir = tiny_dirs
    app = captured_serve(monkeypatch, tiny_pair, "--target", target_dir, "--drafter", drafter_dir, "--method", "si",
                         "-k", "2", "--max-body-bytes", "4096")
    assert app.state.dsi.config.model_name == "target" and app.state.dsi.config.max_body_bytes == 4096
    assert app.state.dsi.scoring is None  # --scoring-port off: no channel (nor a port in the card below)
    with TestClient(app) as client:
        answers = [client.get("/health"), client.get("/v1/models"),
                   client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0}),
                   client.post("/v1/completions", json={"prompt": "hi", "model": "other"}),
                   client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "max_tokens": 999}),
                   client.post("/v1/completions", json={"prompt": "x" * 5000})]
    assert [a.status_code for a in answers] == [200, 200, 200, 404, 400, 413]
    assert answers[0].json()["model"] == "target" and answers[1].json()["data"][0]["id"] == "target"
    assert answers[2].json()["model"] == "target"
    parent = str(Path(target_dir).parent)
    for answer in answers:
        assert parent not in answer.text and target_dir not in answer.text, answer.text


def captured_serve(monkeypatch, tiny_pair, *argv):
    """Run ``dsi serve`` up to the point where uvicorn would start; return the app it would serve."""
    import dsi.cli.serve as serve
    import dsi.server.runner as runner
    from dsi.cli.main import main

    apps = []

    class Captured:
        started = True

        def __init__(self, app, **kwargs):
            apps.append(app)

        def run(self, sockets):
            pass

    monkeypatch.setattr(serve, "_load", lambda args, need_drafter: tiny_pair)
    monkeypatch.setattr(runner, "make_server", Captured)
    assert main(["serve", *(() if "--target" in argv else ("--target", "tiny")), "--port", "0", "--scoring-port", "off",
                 *argv]) == 0
    [app] = apps
    return app


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, None),
    ([], {"DSI_API_KEY": "from-dsi"}, "from-dsi"),
    ([], {"VLLM_API_KEY": "from-vllm"}, "from-vllm"),  # vLLM's variable: a drop-in replacement keeps its key
    ([], {"DSI_API_KEY": "from-dsi", "VLLM_API_KEY": "from-vllm"}, "from-dsi"),
    (["--api-key", "from-flag"], {"DSI_API_KEY": "from-dsi", "VLLM_API_KEY": "from-vllm"}, "from-flag"),
])
def test_serve_takes_the_api_key_from_the_environment_and_the_flag_wins(tiny_pair, monkeypatch, argv, env, expected):
    for name in ("DSI_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = captured_serve(monkeypatch, tiny_pair, "--method", "ar", *argv)
    assert app.state.dsi.config.api_key == expected


@pytest.mark.parametrize("env, message", [
    ({"DSI_API_KEY": ""}, "DSI_API_KEY is set but empty"),
    ({"VLLM_API_KEY": ""}, "VLLM_API_KEY is set but empty"),
    ({"DSI_API_KEY": "s3cret "}, "api_key (DSI_API_KEY) has leading or trailing whitespace"),
    ({"VLLM_API_KEY": "clé"}, "api_key (VLLM_API_KEY) has a character at position 2 that is not printable ASCII"),
])
def test_serve_refuses_a_bad_api_key_from_the_environment_naming_the_variable(monkeypatch, capsys, env, message):
    from dsi.cli.main import main

    for name in ("DSI_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(["serve", "--target", "/nonexistent"])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert all(value not in err for value in env.values() if value)  # the key itself is never shown


def test_serve_help_names_the_api_key_variables(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "DSI_API_KEY" in text and "VLLM_API_KEY" in text


@pytest.mark.parametrize("argv, engine", [
    (["--method", "ar"], "(ar, 1 slot(s))"),  # non-SI has no lookahead (it said k=5)
    (["--method", "si", "-k", "2"], "(si, k=2, 1 slot(s))"),
    (["--method", "dsi", "-k", "3", "--sp", "2"], "(dsi, k=3, SP=2, 1 slot(s))"),
])
def test_serve_announces_the_engine_it_runs(tiny_pair, monkeypatch, capsys, argv, engine):
    captured_serve(monkeypatch, tiny_pair, *argv)
    banner = next(line for line in capsys.readouterr().err.splitlines() if "on http://" in line)
    assert engine in banner, banner
