"""The decoder's contract around its requests (:mod:`dsi.engine.lifecycle`), for non-SI, SI and DSI:

- one request at a time: calls from several threads are serialised and each gets its own right output
  (a DSI decoder shared by two threads used to deadlock on its event queue); a waiting call honours its
  abort flag; a call from inside the running request's callback is refused at once;
- a closed decoder refuses every call (a closed SI / non-SI decoder used to keep generating); closing twice
  is harmless; a decoder is a context manager;
- refusals decidable from the request come before any forward (a prompt past the target's context used to
  be refused only after the work), for requests built by hand too;
- a model's own exception reaches the caller as a WorkerError with the cause chained (non-SI and SI used to
  raise it bare), and is not also logged as a traceback;
- an aborted request reports finish_reason "abort" (it used to say "length"); a stop names its token.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import dsi
from dsi.engine.api import make_request
from dsi.engine.request import GenerationAborted, Request
from dsi.errors import ConfigError, ContextLengthError, DecoderClosed, DSIError, WorkerError
from dsi.models import CallableLM
from dsi.models.emulated.synthetic import SyntheticDrafter, SyntheticTarget, synthetic_pair
from dsi.sampling import SamplingParams

METHODS = ["ar", "si", "dsi"]
VOCAB = 32
BOUND_S = 60.0  # a call that has not returned by then hung


def build(method: str, target=None, drafter=None, **options):
    if target is None:
        target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, target_tpot=0.003, drafter_tpot=0.001)
    return dsi.build_decoder(target=target, drafter=None if method == "ar" else drafter, method=method,
                             lookahead=3, num_target_servers=2 if method == "dsi" else None, **options)


def reference(prompt, tokens: int) -> list[int]:
    target, _ = synthetic_pair(0.8, vocab_size=VOCAB)
    return dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=tokens).tokens


def run_in_threads(calls) -> list:
    """Run each call on a thread of its own, all at once; their results (or exceptions), failing on a hang."""
    out: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i, call):
        start.wait()
        try:
            out[i] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
        if t.is_alive():
            pytest.fail(f"a call did not return within {BOUND_S:.0f} s: the decoder deadlocked")
    return out


@pytest.mark.parametrize("method", METHODS)
def test_one_decoder_shared_by_threads_serves_each_request_right(method):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    with build(method) as decoder:
        results = run_in_threads([lambda p=p: decoder.generate(make_request(p, 24, SamplingParams(), None, VOCAB))
                                  for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        assert not isinstance(result, BaseException), repr(result)
        assert result.tokens == reference(prompt, 24)
        assert result.finish_reason == "length"


def test_a_dsi_decoder_on_server_processes_shared_by_threads_serves_each_request_right():
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    with build("dsi", transport="processes") as decoder:
        results = run_in_threads([lambda p=p: decoder.generate(make_request(p, 16, SamplingParams(), None, VOCAB))
                                  for p in prompts])
    assert [r.tokens for r in results] == [reference(p, 16) for p in prompts]


def test_seeded_sampling_on_a_shared_dsi_decoder_gives_each_request_its_own_tokens():
    params = SamplingParams(temperature=0.8, seed=11)
    prompts = [[1, 2, 3], [3, 2, 1]]
    with build("dsi") as decoder:
        alone = [decoder.generate(make_request(p, 20, params, None, VOCAB)).tokens for p in prompts]
        shared = run_in_threads([lambda p=p: decoder.generate(make_request(p, 20, params, None, VOCAB))
                                 for p in prompts])
    assert [r.tokens for r in shared] == alone


@pytest.mark.parametrize("method", METHODS)
def test_a_call_waiting_for_the_decoder_honours_its_abort_flag(method):
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, target_tpot=0.01, drafter_tpot=0.002)
    with build(method, target, drafter) as decoder:
        long = threading.Thread(target=decoder.generate,
                                args=(make_request([1, 2], 200, SamplingParams(), None, VOCAB),), daemon=True)
        long.start()
        time.sleep(0.2)  # the long request holds the decoder
        abort = threading.Event()
        abort.set()
        started = time.monotonic()
        with pytest.raises(GenerationAborted, match="waited for the decoder"):
            decoder.generate(make_request([3, 4], 8, SamplingParams(), None, VOCAB), abort=abort)
        assert long.is_alive(), "the test needs the first request still running"
        waited = time.monotonic() - started
        long.join(BOUND_S)
    assert waited < BOUND_S


@pytest.mark.parametrize("method", METHODS)
def test_a_call_from_inside_the_running_requests_callback_is_refused_at_once(method):
    caught: list[BaseException] = []
    with build(method) as decoder:
        def callback(tokens, *rest):
            if not caught:
                try:
                    decoder.generate(make_request([5], 4, SamplingParams(), None, VOCAB))
                except BaseException as exc:  # noqa: BLE001
                    caught.append(exc)
        result = run_in_threads([lambda: decoder.generate(make_request([1, 2], 8, SamplingParams(), None, VOCAB),
                                                          callback)])[0]
        assert result.tokens == reference([1, 2], 8)
        with pytest.raises(ConfigError, match="from inside its own running request"):
            def closer(tokens, *rest):
                decoder.close()
            decoder.generate(make_request([1, 2], 4, SamplingParams(), None, VOCAB), closer)
    assert len(caught) == 1 and isinstance(caught[0], ConfigError), caught
    assert "would wait for itself" in str(caught[0])


@pytest.mark.parametrize("method", METHODS)
def test_a_closed_decoder_refuses_every_call(method):
    decoder = build(method)
    request = make_request([1, 2, 3], 6, SamplingParams(), None, VOCAB)
    assert decoder.generate(request).tokens == reference([1, 2, 3], 6)
    decoder.close()
    decoder.close()  # twice: harmless
    assert decoder.closed
    with pytest.raises(DecoderClosed, match="closed"):
        decoder.generate(request)
    with pytest.raises(DecoderClosed):
        decoder.score([1, 2, 3], 1)


@pytest.mark.parametrize("method", METHODS)
def test_a_decoder_is_a_context_manager_that_closes_on_exit_even_after_an_error(method):
    with pytest.raises(ConfigError):
        with build(method) as decoder:
            decoder.generate(Request((VOCAB + 3,), 4))
    assert decoder.closed
    with pytest.raises(DecoderClosed):
        decoder.generate(make_request([1], 2, SamplingParams(), None, VOCAB))


def test_close_waits_for_the_running_request_to_end():
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, target_tpot=0.005, drafter_tpot=0.001)
    decoder = build("dsi", target, drafter)
    box: dict = {}
    running = threading.Event()

    def run():
        box["result"] = decoder.generate(make_request([1, 2], 40, SamplingParams(), None, VOCAB),
                                         lambda tokens, *rest: running.set())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert running.wait(BOUND_S)
    decoder.close()  # returns only once the request has ended, whole
    assert not thread.is_alive() or thread.join(1.0) is None
    assert box["result"].tokens == reference([1, 2], 40)


class CountingFn:
    """A next-token function that counts its calls (forwards) and can fail."""

    def __init__(self, seed: int = 0, fail: bool = False) -> None:
        self.inner, self.calls, self.fail = SyntheticTarget(VOCAB, seed), 0, fail

    def __call__(self, context):
        self.calls += 1
        if self.fail:
            raise RuntimeError("boom: the model's own error")
        return self.inner(context)


@pytest.mark.parametrize("method", METHODS)
def test_a_prompt_past_the_targets_context_is_refused_before_any_forward(method):
    fn, dfn = CountingFn(), CountingFn(seed=1)
    target = CallableLM(fn, VOCAB, max_context=64)
    drafter = CallableLM(dfn, VOCAB)
    with pytest.raises(ContextLengthError, match=r"prompt of 60 tokens \+ max_new_tokens=10 exceeds .*max_context=64"):
        dsi.generate(target=target, drafter=None if method == "ar" else drafter, prompt=[3] * 60, method=method,
                     max_new_tokens=10, lookahead=2)
    assert fn.calls == 0 and dfn.calls == 0, "the refusal came after forwards"
    # exactly at the limit: served
    result = dsi.generate(target=target, drafter=None if method == "ar" else drafter, prompt=[3] * 54,
                          method=method, max_new_tokens=10, lookahead=2)
    assert len(result.tokens) == 10


@pytest.mark.parametrize("method", METHODS)
def test_a_hand_built_request_outside_the_vocabulary_is_refused_before_any_forward(method):
    fn = CountingFn()
    target = CallableLM(fn, VOCAB)
    drafter = CallableLM(SyntheticDrafter(SyntheticTarget(VOCAB, 0), 0.8, 1), VOCAB)
    with build(method, target, drafter) as decoder:
        for prompt, message in [((1, VOCAB), rf"prompt\[1\]={VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
                                ((-1, 2), rf"prompt\[0\]=-1 is outside the vocabulary \[0, {VOCAB}\)")]:
            with pytest.raises(ConfigError, match=message):
                decoder.generate(Request(prompt, 4))
    assert fn.calls == 0


@pytest.mark.parametrize("method, role", [(m, r) for m in METHODS for r in ("target", "drafter")
                                          if (m, r) != ("ar", "drafter")])  # non-SI runs no drafter
def test_a_models_own_exception_is_a_worker_error_with_its_cause_and_no_logged_traceback(method, role, caplog):
    target = CallableLM(CountingFn(fail=role == "target"), VOCAB)
    drafter = CallableLM(CountingFn(seed=1, fail=role == "drafter"), VOCAB)
    with caplog.at_level(logging.DEBUG, logger="dsi"), build(method, target, drafter) as decoder:
        with pytest.raises(WorkerError, match=f"{role}.*RuntimeError: boom") as info:
            decoder.generate(make_request([1, 2, 3], 8, SamplingParams(), None, VOCAB))
    assert isinstance(info.value.__cause__, RuntimeError)
    shown = [r for r in caplog.records if r.levelno >= logging.INFO and r.exc_info]
    assert shown == [], f"a traceback was logged for an error the caller gets: {[r.getMessage() for r in shown]}"


@pytest.mark.parametrize("method", METHODS)
def test_an_aborted_request_reports_abort_not_length(method):
    abort = threading.Event()

    def callback(tokens, *rest):
        abort.set()

    with build(method) as decoder:
        with pytest.raises(GenerationAborted) as info:
            decoder.generate(make_request([1, 2], 30, SamplingParams(), None, VOCAB), callback, abort)
    assert info.value.stats.finish_reason == "abort"
    assert 1 <= len(info.value.tokens) < 30


@pytest.mark.parametrize("method", METHODS)
def test_a_stop_names_the_token_that_ended_the_output(method):
    tokens = reference([1, 2, 3], 12)
    eos = tokens[5]
    first = tokens.index(eos)
    with build(method) as decoder:
        result = decoder.generate(make_request([1, 2, 3], 12, SamplingParams(), eos, VOCAB))
    assert result.tokens == tokens[: first + 1]
    assert result.finish_reason == "stop" and result.stats.stop_token == eos
    assert result.stats.to_dict()["stop_token"] == eos


def test_non_si_has_no_lookahead_in_its_stats():
    with build("ar") as decoder:
        stats = decoder.generate(make_request([1], 3, SamplingParams(), None, VOCAB)).stats
    assert stats.lookahead is None and stats.to_dict()["lookahead"] is None


def test_every_error_of_the_public_api_is_a_dsi_error():
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB)
    bad_calls = [
        dict(prompt=[1], max_new_tokens=0),
        dict(prompt=[1.5], max_new_tokens=2),
        dict(prompt="text", max_new_tokens=2),
        dict(prompt=[1], max_new_tokens=2, lookahead=0),
        dict(prompt=[1], max_new_tokens=2, method="nope"),
        dict(prompt=[1], max_new_tokens=2, num_target_servers=0),
        dict(prompt=[1], max_new_tokens=2, transport="pigeons"),
        dict(prompt=[1], max_new_tokens=2, eos_token_id=VOCAB),
        dict(prompt=[1], max_new_tokens=2, sampling="greedy"),
        dict(prompt=[1], max_new_tokens=2, draft_tree=3.5),
        dict(prompt=[1], max_new_tokens=2, logprobs=-1),
        dict(prompt=np.array([1.0, 2.0]), max_new_tokens=2),
    ]
    for call in bad_calls:
        with pytest.raises(DSIError):
            dsi.generate(target=target, drafter=drafter, method=call.pop("method", "dsi"), **call)
