"""A request's answer does not depend on what its decoder served before (issue 64, item 7).

A backend's row for a position depends on how the forwards that computed it were cut (bf16 products,
llama.cpp's quantized kernels: dsi.models.determinism). A DSI target server that kept an earlier request's
cache computed the shared prefix in that request's cuts, and the rest after it in a cut a fresh server would
not make: the same request then scored its first token 0.03-0.13 nats apart on the embedded pair, and a
near-tie fell the other way. So each request starts every target server, and the drafter, from an empty
cache unless the rows are canonical (the deterministic mode keeps the caches: a cached row is the one a fresh
forward gives). What is checked, on a random bf16 Llama whose rows depend on the cut on any machine: bf16
products round by blocking on some CPUs and not on others, so the target also raises one logit of each row by
an amount that grows with its forward's width (:class:`CutSensitive`), as a kernel that blocks would:

- the first token of a DSI request (decided by its zero-draft task, which no timing touches), with its
  logprobs, is the same bits after any history as on a fresh decoder, on 1 and 2 servers;
- so is ``DSIDecoder.score`` (``dsi serve``'s echo and prompt logprobs on a DSI slot);
- the history does change them where the caches are kept across requests (the test can fail);
- in the deterministic mode the caches are kept across requests (no prefill is repeated).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsi  # noqa: E402
from dsi.engine.api import build_decoder, make_request  # noqa: E402
from dsi.engine.dsi import DSIDecoder  # noqa: E402
from tests.tiny_hf import make_model_dir  # noqa: E402

PROMPT = [12, 60, 61, 62, 63, 1, 5, 9, 14, 30, 31, 2]
HISTORIES = [  # what the decoder served before (its servers keep a prefix of the prompt, cut elsewhere)
    [PROMPT[:7] + [88, 89]],
    [PROMPT[:3] + [70, 71], PROMPT[:9]],
    [PROMPT + [40, 41, 42]],  # a longer prompt that starts with this one
]


class CutSensitive:
    """``model`` whose rows depend on how its forwards are cut, whatever the CPU: each row of a forward over
    ``n`` tokens has token 0's logit raised by ``1e-3 * n``, so a position computed in another cut gets other
    log-probabilities (every one of them: the row's normaliser moves)."""

    def __init__(self, model) -> None:
        self.model = model
        self.name = f"cut-sensitive {model.name}"

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def new_session(self):
        return CutSensitiveSession(self.model.new_session())


class CutSensitiveSession:
    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def tokens(self):
        return self.inner.tokens

    def extend(self, tokens, cancel=None):
        rows = np.array(self.inner.extend(tokens, cancel), dtype=np.float32)
        rows[:, 0] += 1e-3 * len(tokens)
        return rows

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dsi.models.hf.model import HFModel

    root = tmp_path_factory.mktemp("history")
    target = CutSensitive(HFModel.load(str(make_model_dir(root / "target", seed=0, layers=2, hidden=64)),
                                       dtype="bf16", progress=False, threads=1))
    drafter = HFModel.load(str(make_model_dir(root / "drafter", seed=1, layers=1, hidden=64)), dtype="bf16",
                           progress=False, threads=1)
    return target, drafter


def _first_token(decoder, vocab: int) -> tuple[list[int], list]:
    """A greedy one-token request with 5 logprobs: its token and its logprob entries."""
    result = decoder.generate(make_request(PROMPT, 1, dsi.SamplingParams(), None, vocab, logprobs=5))
    return result.tokens, [(e.token, e.logprob, tuple(e.top)) for e in result.logprobs]


def _served(decoder, prompts: list[list[int]], vocab: int) -> None:
    for prompt in prompts:
        decoder.generate(make_request(prompt, 6, dsi.SamplingParams(), None, vocab))


def _decoder(pair, servers: int):
    target, drafter = pair
    return build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2, num_target_servers=servers)


@pytest.mark.parametrize("servers", [1, 2])
def test_a_dsi_request_s_first_token_and_logprobs_do_not_depend_on_the_history(pair, servers, no_thread_leak):
    vocab = pair[0].vocab_size
    with _decoder(pair, servers) as fresh:
        expected = _first_token(fresh, vocab)
    for history in HISTORIES:
        with _decoder(pair, servers) as decoder:
            _served(decoder, history, vocab)
            assert _first_token(decoder, vocab) == expected, history


def test_scoring_on_a_dsi_decoder_does_not_depend_on_the_history(pair, no_thread_leak):
    vocab = pair[0].vocab_size
    with _decoder(pair, 1) as fresh:
        expected = fresh.score(PROMPT, 3)
    with _decoder(pair, 1) as decoder:
        _served(decoder, HISTORIES[0], vocab)
        decoder.score(PROMPT[:9], 2)
        np.testing.assert_array_equal(decoder.score(PROMPT, 3), expected)


def test_the_history_would_change_them_if_caches_were_kept_across_requests(pair, monkeypatch, no_thread_leak):
    """The rows do depend on the cut here: keeping the servers' caches across requests (a request scope of
    None, as before) moves the first token's logprobs or the scores."""
    vocab = pair[0].vocab_size
    with _decoder(pair, 1) as fresh:
        expected, expected_scores = _first_token(fresh, vocab), fresh.score(PROMPT, 3)
    monkeypatch.setattr(DSIDecoder, "request_scope", lambda self: None)
    moved = 0
    for history in HISTORIES:
        with _decoder(pair, 1) as decoder:
            _served(decoder, history, vocab)
            moved += _first_token(decoder, vocab) != expected
            moved += not np.array_equal(decoder.score(PROMPT, 3), expected_scores)
    assert moved > 0


def test_the_deterministic_mode_keeps_the_caches_across_requests(pair):
    """In the mode a cached row is the canonical one: the requests' tasks carry no scope, so the servers reuse
    whatever they cached (tests/unit/transport/test_dispatch.py: what a scope does to a server's cache)."""
    target, drafter = pair[0].model, pair[1]  # the hf model itself: its mode makes its rows canonical
    try:
        with build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2, num_target_servers=1,
                           deterministic=True) as decoder:
            assert decoder.request_scope() is None
    finally:
        target.deterministic = drafter.deterministic = False
    with _decoder(pair, 1) as decoder:
        assert decoder.request_scope() != decoder.request_scope()  # a scope of its own for each request
