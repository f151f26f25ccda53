"""The batch-of-prefixes verification's own rules (dsi.models.engines.prefixes): the cost it is chosen by, the
request it sends, how its answer is read, and what an engine's /metrics says. Real vLLM engines run it in
tests/integration/test_engine_prefixes.py."""

from __future__ import annotations

import http.server
import threading

import pytest

from dsi.errors import ServerLost
from dsi.models.engines import prefixes


def test_the_cost_counts_each_prefix_past_its_last_cached_block_and_a_sequence_cost():
    seq = prefixes.SEQUENCE_COST_TOKENS
    # blocks of 16, 40 tokens cached: prefixes of 41..43 tokens each read 32 and compute the rest
    assert prefixes.prefix_cost(41, 3, 40, 16) == (9 + 10 + 11) + 3 * seq
    # a prefix never reads past its own last token (one row must be computed)
    assert prefixes.prefix_cost(32, 1, 40, 16) == (32 - 16) + seq
    # nothing cached: each prefix computes everything
    assert prefixes.prefix_cost(10, 2, 0, 16) == 10 + 11 + 2 * seq


def test_the_prompt_logprobs_way_wins_on_a_fresh_context_and_the_prefixes_on_a_long_cached_one():
    # a request's first window: the prompt, nothing cached
    assert not prefixes.prefixes_cheaper(2048, 2044, 5, 0, 16)
    # later windows of a long context, all but the new tokens cached
    assert prefixes.prefixes_cheaper(2053, 2049, 5, 2048, 16)
    # short contexts: the prefixes' tokens past the last whole block, and the sequences, cost more than the context
    assert not prefixes.prefixes_cheaper(40, 36, 5, 35, 16)
    # large blocks cache less of a context: the crossover moves out
    assert prefixes.prefixes_cheaper(300, 296, 5, 295, 16)
    assert not prefixes.prefixes_cheaper(300, 296, 5, 295, 512)  # nothing of it in a whole block


def test_the_request_is_one_prompt_per_row():
    body = prefixes.payload("m", [5, 6, 7, 8], 2, 3, 20)
    assert body["prompt"] == [[5, 6], [5, 6, 7], [5, 6, 7, 8]]
    assert body["max_tokens"] == 1 and body["temperature"] == 0.0 and body["logprobs"] == 20
    assert body["return_tokens_as_token_ids"] is True and "prompt_logprobs" not in body


def answer(rows, model="m", order=None):
    order = order if order is not None else range(len(rows))
    return {"model": model, "choices": [{"index": i, "logprobs": {"top_logprobs": [rows[i]]}} for i in order]}


def test_rows_come_back_in_prompt_order_whatever_the_order_of_the_choices():
    rows = [{"token_id:1": -0.1}, {"token_id:2": -0.2}, {"token_id:3": -0.3}]
    assert prefixes.row_entries(answer(rows, order=[2, 0, 1]), "u", "m", 3) == rows


@pytest.mark.parametrize("bad, what", [
    (answer([{"token_id:1": -0.1}]), "1 choices for 2 prompts"),
    (answer([{"token_id:1": -0.1}, {"token_id:2": -0.2}], model="other"), "served model 'other'"),
    ({"model": "m", "choices": [{"index": 0, "logprobs": {"top_logprobs": [{"1": -1.0}]}},
                                {"index": 0, "logprobs": {"top_logprobs": [{"1": -1.0}]}}]}, "index is 0"),
    ({"model": "m", "choices": [{"index": 0, "logprobs": None}, {"index": 1, "logprobs": None}]}, "no top_logprobs"),
    ({"model": "m", "choices": [{"index": True, "logprobs": {"top_logprobs": [{"1": -1.0}]}},
                                {"index": 1, "logprobs": {"top_logprobs": [{"1": -1.0}]}}]}, "index is True"),
    ([], "not a JSON object"),
])
def test_an_answer_of_another_shape_is_a_lost_server(bad, what):
    with pytest.raises(ServerLost, match="answered a batch of prefixes inconsistently") as info:
        prefixes.row_entries(bad, "http://e/v1", "m", 2)
    assert what in str(info.value)


class Metrics(http.server.BaseHTTPRequestHandler):
    text = ""

    def do_GET(self):  # noqa: N802
        body = self.text.encode() if self.path == "/metrics" else b"no"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_block_size_and_prefix_caching_come_from_the_engine_s_metrics(metrics_server):
    Metrics.text = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
                    'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",'
                    'engine="0"} 1.0\n')
    assert prefixes.cache_config(metrics_server, 5.0) == (128, True)
    Metrics.text = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="False"} 1.0\n'
    assert prefixes.cache_config(metrics_server, 5.0) == (16, False)
    Metrics.text = "dsi_requests_total 3.0\n"  # another server: nothing said
    assert prefixes.cache_config(metrics_server, 5.0) == (None, False)
    assert prefixes.cache_config("http://127.0.0.1:9/v1", 1.0) == (None, False)  # nothing listening
