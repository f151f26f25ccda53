"""vLLM's ``GET /tokenizer_info`` on ``dsi serve``: the fields lm-eval's remote tokenizer reads (``eos_token``,
``bos_token``, ``pad_token``, ``chat_template``), from a Hugging Face tokenizer and a GGUF's vocabulary, no
local path, behind the API key; and lm-eval's own ``RemoteTokenizer`` client against it where lm-eval is
installed (it is not a dependency: its own dependencies are heavy)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

from tests.unit.server.conftest import running_server  # noqa: E402

pytestmark = pytest.mark.hf

KEY = "info-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_pair):
    from dsi.server import ServeConfig, create_app

    target, _ = tiny_pair
    config = ServeConfig(method="ar", model_name="tiny", api_key=KEY, max_tokens=4)
    with running_server(create_app(target, None, config)) as running:
        yield running.url


def test_tokenizer_info_gives_the_special_tokens_and_chat_template_and_no_path(server, tiny_pair, tiny_dirs):
    tok = tiny_pair[0].tokenizer
    assert httpx.get(server + "/tokenizer_info").status_code == 401  # as /tokenize: behind the key
    r = httpx.get(server + "/tokenizer_info", headers=AUTH)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["pad_token"] == tok.pad_token and info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] == type(tok).__name__
    assert all(not key.endswith("_file") and "name_or_path" not in key for key in info)
    assert tiny_dirs[0] not in r.text and "serve-models" not in r.text


def test_lm_eval_s_remote_tokenizer_works_against_the_server(server, tiny_pair):
    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    tok = tiny_pair[0].tokenizer
    url = server + "/v1/completions"  # what lm-eval's local-completions is given; it strips the route
    assert lm_eval_utils.check_remote_tokenizer_support(url, auth_token=KEY)
    assert not lm_eval_utils.check_remote_tokenizer_support(url, auth_token="wrong", max_retries=1)
    remote = lm_eval_utils.RemoteTokenizer(url, auth_token=KEY)
    text = "The quick brown fox"
    assert remote.encode(text) == tok.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    assert remote.eos_token_id == tok.eos_token_id and remote.bos_token_id == tok.bos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert remote.apply_chat_template(messages) == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                           tokenize=False)


def test_the_config_is_plain_json_without_paths():
    from transformers import AddedToken

    from dsi.server.tokenizer_info import tokenizer_config

    class Tokenizer:
        init_kwargs = {"name_or_path": "/home/me/model", "vocab_file": "/home/me/model/vocab.json",
                       "tokenizer_file": "/home/me/model/tokenizer.json", "eos_token": AddedToken("</s>"),
                       "added_tokens_decoder": {0: AddedToken("<unk>")}, "model_max_length": float("inf"),
                       "clean_up_tokenization_spaces": False, "extra": {1, 2} and frozenset([3])}
        special_tokens_map = {"eos_token": "</s>", "unk_token": "<unk>", "additional_special_tokens": ["<x>"]}
        chat_template = {"default": "{{ messages }}", "tool_use": "{{ tools }}"}

    info = tokenizer_config(Tokenizer(), max_context=128)
    assert info == {"eos_token": "</s>", "unk_token": "<unk>", "added_tokens_decoder": {"0": "<unk>"},
                    "model_max_length": 128, "clean_up_tokenization_spaces": False, "extra": "frozenset({3})",
                    "tokenizer_class": "Tokenizer", "chat_template": "{{ messages }}"}


def test_a_gguf_vocabulary_gives_its_tokens_and_template(tmp_path):
    pytest.importorskip("llama_cpp")
    from dsi.models.llamacpp import LlamaCppModel
    from dsi.server.codec import HFCodec
    from dsi.server.tokenizer_info import codec_tokenizer_info
    from tests.tiny_gguf import write_tiny_gguf

    path, _, tok = write_tiny_gguf(tmp_path / "target.gguf", seed=0)
    model = LlamaCppModel(path, threads=1)
    try:
        info = codec_tokenizer_info(HFCodec(model))
    finally:
        model.close()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] == "GGUFTokenizer" and info["model_max_length"] == model.max_context
    assert str(tmp_path) not in str(info)


def test_a_model_without_a_tokenizer_names_its_eos_as_tokenize_reads_it():
    from dsi.server.codec import IdsCodec
    from dsi.server.tokenizer_info import codec_tokenizer_info

    codec = IdsCodec(50, eos_token_ids=(7,), max_context=64)
    info = codec_tokenizer_info(codec)
    assert info == {"tokenizer_class": "IdsCodec", "eos_token": "7", "model_max_length": 64}
    assert codec.encode(info["eos_token"]) == [7]
