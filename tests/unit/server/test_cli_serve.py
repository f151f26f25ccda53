"""``dsi serve`` as a process: binds loopback, serves the OpenAI client, exits 0 on SIGTERM and
SIGINT after closing every decoder (in flight requests finish or are cancelled)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

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
    (["--lookahead", "auto", "--method", "si"], "SI needs an integer lookahead"),
    (["--lookahead", "5", "--max-window", "3"], "max_window=3 applies to lookahead='auto' only"),
    (["--method", "dsi", "--sp", "0"], "--sp=0 must be >= 1"),
])
def test_serve_rejects_bad_options_before_loading(argv, message, capsys):
    from dsi.cli.main import main

    code = main(["serve", "--target", "/nonexistent", *argv])
    assert code == 2 and message in capsys.readouterr().err
