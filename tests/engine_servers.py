"""Real inference engines on 127.0.0.1 for tests: ``dsi serve`` processes and vLLM servers.

Each server runs in a process group of its own and is stopped by signalling the group, so nothing it
started outlives the test. vLLM runs from the venv that ``packaging/vllm-venv.sh`` builds
(``DSI_VLLM_VENV``, default ``.venv-vllm`` at the repository root); :func:`vllm_python` is None
without it, and the vLLM tests skip with that reason.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """One server process; ``url`` is its OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""

    def __init__(self, argv: list[str], port: int, env: dict | None = None, timeout: float = 120.0) -> None:
        from dsi.models.engines.target import wait_until_serving

        self.url = f"http://127.0.0.1:{port}/v1"
        self.port = port
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)
        try:
            wait_until_serving(self.url, timeout, self.proc)
        except BaseException:
            output = self.output()
            self.stop()
            raise AssertionError(f"{argv[:6]}... did not serve:\n{output[-4000:]}") from None

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(10)
        self.signal(signal.SIGKILL)  # anything the server left in its group
        self.log.close()


class LocalHTTP:
    """A test's own HTTP server on 127.0.0.1 (a proxy in front of an engine, say): :meth:`serve` starts it on a
    handler class, ``url`` is its OpenAI base URL, :meth:`close` stops it."""

    def serve(self, handler: type) -> None:
        import http.server

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RelayProxy(LocalHTTP):
    """A real engine behind an HTTP proxy that relays its JSON answers, each through :meth:`alter` first (a
    subclass's faults). The proxy relays HTTP only, so the model cards it relays do not advertise the engine's
    scoring channel (a dsi would verify there, past the proxy): every verification goes through it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _relay(self, method, body=None):
                request = urllib.request.Request(proxy.upstream + self.path.removeprefix("/v1"), body,
                                                 {"Content-Type": "application/json"}, method=method)
                with urllib.request.urlopen(request, timeout=60) as response:
                    return json.load(response)

            def _send(self, answer):
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                answer = self._relay("GET")
                for card in answer.get("data", []):
                    (card.get("dsi") or {}).pop("scoring_port", None)
                self._send(answer)

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = json.loads(body)
                if request.get("stream"):  # server-sent events: relayed whole, or what stream() makes of them
                    upstream = urllib.request.Request(proxy.upstream + self.path.removeprefix("/v1"), body,
                                                      {"Content-Type": "application/json"}, method="POST")
                    with urllib.request.urlopen(upstream, timeout=60) as response:
                        data = proxy.stream(request, response.read())
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self._send(proxy.alter(request, self._relay("POST", body)))

        self.serve(Handler)

    def alter(self, request: dict, answer: dict) -> dict:
        """The answer the proxy sends for a POST of ``request`` that the engine answered with ``answer``."""
        return answer

    def stream(self, request: dict, events: bytes) -> bytes:
        """The server-sent events the proxy sends for a streamed POST of ``request`` that the engine answered with
        ``events`` (the whole stream, relayed once it ended)."""
        return events


FAST_LIVENESS = {"floor_s": 2.0, "factor": 5.0, "unmeasured_s": 10.0}  # a frozen engine is caught in seconds


class Strike:
    """A token callback (``on_tokens``) that sends ``sig`` to ``engine``'s process group once, when the
    first tokens are committed: a fault mid-request. ``done`` says whether it struck."""

    def __init__(self, engine: EngineProcess, sig: int) -> None:
        self.engine, self.sig = engine, sig
        self.done = threading.Event()

    def __call__(self, tokens, *rest) -> None:
        if not self.done.is_set():
            self.done.set()
            self.engine.signal(self.sig)


def answered_requests(engine: EngineProcess) -> int:
    """How many scoring requests ``engine`` has answered, from its Prometheus metrics (``dsi serve``: its
    completions and scoring-channel requests; vLLM: its finished requests)."""
    import urllib.request

    text = urllib.request.urlopen(engine.url.removesuffix("/v1") + "/metrics", timeout=5).read().decode()
    count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total") or (
                line.startswith("dsi_requests_total") and ('endpoint="scoring"' in line
                                                           or 'endpoint="/v1/completions"' in line)):
            count += float(line.split()[-1])
    return int(count)


class StrikeAfter:
    """Sends ``sig`` to ``engine``'s process group once it has answered ``more`` scoring requests beyond
    those it had answered when armed (:meth:`arm`), from a thread of its own: a fault mid-request for runs
    that take no callback (the CLI, a server). ``struck_at`` is the ``time.monotonic()`` of the signal."""

    def __init__(self, engine: EngineProcess, sig: int, more: int = 2) -> None:
        self.engine, self.sig, self.more = engine, sig, more
        self.struck_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self) -> StrikeAfter:
        start = answered_requests(self.engine)

        def watch() -> None:
            import time

            while not self._stop.wait(0.005):
                try:
                    if answered_requests(self.engine) >= start + self.more:
                        self.engine.signal(self.sig)
                        self.struck_at = time.monotonic()
                        return
                except OSError:
                    pass

        self._thread = threading.Thread(target=watch, name="test-strike", daemon=True)
        self._thread.start()
        return self

    def disarm(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def start_dsi_serve(model_dir: str, *extra: str, name: str = "tiny", port: int | None = None) -> EngineProcess:
    """``dsi serve --method ar`` on a tiny hf model (fp32, one thread), as a target server (``port``: a given
    one, to restart an engine where it was)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "dsi.cli.main", "serve", "--target", model_dir, "--method", "ar",
            "--dtype", "fp32", "--threads", "1", "--port", str(port), "--served-model-name", name,
            "--max-logprobs", "-1", *extra]
    return EngineProcess(argv, port)


def vllm_python() -> str | None:
    venv = Path(os.environ.get("DSI_VLLM_VENV", ROOT / ".venv-vllm"))
    python = venv / "bin" / "python"
    return str(python) if python.exists() else None


_cpu_lock = threading.Lock()
_next_cpu = [0]


DRAWS_PROCESSOR = "dsi_vllm.processor:CoupledDraws"  # the logits processor that makes coupled draws in vLLM


def start_vllm(model_dir: str, name: str = "tiny", max_model_len: int = 256, port: int | None = None,
               extra: tuple[str, ...] = (), draws: bool = False) -> EngineProcess:
    """vLLM's OpenAI server on a tiny fp32 model, as the engines issue measured it on this machine (``port``:
    a given one, to restart an engine where it was; ``extra``: more flags; ``draws``: with dsi_vllm's processor,
    imported from this checkout's src, and its prefix cache, as docs/engines.md starts it)."""
    python = vllm_python()
    assert python is not None, "no vllm venv (bash packaging/vllm-venv.sh)"
    with _cpu_lock:
        cpu = _next_cpu[0] % (os.cpu_count() or 1)
        _next_cpu[0] += 1
    port = port or free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--max-logprobs", "-1",
            "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len), *extra]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu), "VLLM_LOGGING_LEVEL": "WARNING"}
    if draws:
        argv += ["--enable-prefix-caching", "--block-size", "32", "--logits-processors", DRAWS_PROCESSOR]
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    return EngineProcess(argv, port, env, timeout=300.0)


def start_all(starters):
    """Start servers at once (each start mostly waits); return them in order."""
    out, errors = [None] * len(starters), []

    def run(i, start):
        try:
            out[i] = start()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(starters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for server in out:
            if server is not None:
                server.stop()
        raise errors[0]
    return out
