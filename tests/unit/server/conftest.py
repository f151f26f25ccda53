"""Fixtures of the server tests: tiny random HF models and a real uvicorn server on loopback."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tests.tiny_hf import make_model_dir  # noqa: E402


@pytest.fixture(scope="package")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    target = make_model_dir(root / "target", seed=0, layers=2)
    drafter = make_model_dir(root / "drafter", seed=1, layers=1)
    return str(target), str(drafter)


@pytest.fixture(scope="package")
def tiny_pair(tiny_dirs):
    from dsi.models.loading import load_pair

    return load_pair(*tiny_dirs, dtype="fp32", progress=False, threads=1)


class Running:
    """A uvicorn server running an app in a thread on 127.0.0.1 and a free port."""

    def __init__(self, app, graceful_s: float = 2.0) -> None:
        from dsi.server.runner import make_server

        # IPPROTO_TCP named: asyncio then sets TCP_NODELAY on accepted connections (as on dsi serve's own
        # socket); without it each answer on a kept-alive connection waits 40 ms for a delayed ACK
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = app
        self.server = make_server(app, graceful_s=graceful_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="test-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> Running:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """What SIGTERM does: stop accepting, let requests finish (graceful_s), cancel, close."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not stop"


@contextlib.contextmanager
def running_server(app, graceful_s: float = 2.0):
    running = Running(app, graceful_s).start()
    try:
        yield running
    finally:
        running.shutdown()


def wait_until(condition, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---- a scripted synthetic pair with the tiny tokenizer (exact, known outputs) ----------------

SENTINEL = 0  # "<|endoftext|>": every prompt of the scripted codec ends with it


def scripted_lm(script, vocab_size, eos, cycle=False, typo_every=0, fail_on=None):
    """A model whose greedy output spells ``script`` after the last SENTINEL of the context.

    ``cycle``: repeat the script forever; else the token after it is ``eos``. ``typo_every``: a
    drafter that gets every n-th token wrong (rejections, preemptions). ``fail_on``: a token
    whose presence in the context makes the forward raise (a broken worker).
    """
    import numpy as np

    from dsi.models import CallableLM

    script = list(script)

    def next_logits(context):
        if fail_on is not None and fail_on in context:
            raise RuntimeError(f"scripted model: token {fail_on} is poison")
        start = len(context) - 1 - context[::-1].index(SENTINEL) if SENTINEL in context else -1
        i = len(context) - 1 - start  # tokens generated after the prompt
        if cycle:
            i %= len(script)
        token = script[i] if i < len(script) else eos
        if typo_every and i % typo_every == typo_every - 1:
            token = (token + 1) % vocab_size
        logits = np.zeros(vocab_size)
        logits[token] = 10.0
        return logits

    return CallableLM(next_logits, vocab_size, name="scripted")


class TokenizerCodec:
    """A codec over the tiny tokenizer for synthetic models: prompts end with SENTINEL."""

    def __init__(self, tok, max_context=4096):
        import threading

        self.tok = tok
        self.vocab_size = len(tok)
        self.eos_token_ids = (tok.eos_token_id,)
        self.max_context = max_context
        self._lock = threading.Lock()

    def _encode(self, text, special=True):
        with self._lock:
            return list(self.tok.encode(text, add_special_tokens=special)) + [SENTINEL]

    def encode(self, text, limit=None, add_special_tokens=True):
        from dsi.server.codec import encode_within

        return encode_within(lambda part: self._encode(part, special=add_special_tokens), text, limit)

    def encode_chat(self, messages, limit=None, add_generation_prompt=True, add_special_tokens=False, tools=None):
        from dsi.server.codec import encode_within

        with self._lock:
            text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=False)
        return encode_within(lambda part: self._encode(part, special=add_special_tokens), text, limit)

    def decode(self, ids, skip_special_tokens=True):
        with self._lock:
            return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="package")
def tiny_tokenizer():
    from tests.tiny_hf import make_tokenizer

    return make_tokenizer()
