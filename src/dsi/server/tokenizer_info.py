"""vLLM's ``GET /tokenizer_info``: the served tokenizer's configuration, for clients that tokenise remotely.

lm-eval's remote tokenizer (``tokenizer_backend=remote``, and ``auto`` where the server has this
route) reads ``eos_token``, ``bos_token``, ``pad_token`` and ``chat_template`` from it, then
tokenises through ``/tokenize`` and ``/detokenize``. vLLM answers the tokenizer's ``init_kwargs``
(what its ``tokenizer_config.json`` held) made JSON-serialisable (an added token becomes its
text), with ``tokenizer_class`` and the chat template. So does dsi serve, for a Hugging Face
tokenizer and a GGUF's vocabulary alike, less anything that could name a local file (``*_file``,
``name_or_path``: no answer carries a local path), and with the special tokens read from the
tokenizer itself, so that they are there even where the config did not list them.

Does not know: HTTP (the app serves :func:`codec_tokenizer_info`), how a codec tokenises.
"""

from __future__ import annotations

import math
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
_PATH_KEYS = ("name_or_path", "_name_or_path")  # a model's directory, often


def _json(value: Any) -> Any:
    """``value`` as plain JSON: an added token as its text (vLLM's rule), a non-finite float as null, an object
    JSON has no type for as its ``str``."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def tokenizer_config(tokenizer: Any, max_context: int | None = None) -> dict[str, Any]:
    """The ``/tokenizer_info`` answer of a Hugging Face tokenizer or a GGUF's vocabulary
    (:class:`dsi.models.llamacpp.GGUFTokenizer`, which has no ``init_kwargs``)."""
    config = {k: v for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if not k.endswith("_file") and k not in _PATH_KEYS}
    config = _json(config)
    for name in SPECIAL_TOKENS:  # the tokenizer's own (a GGUF's bos / eos), where it has one
        value = _special_token(tokenizer, name)
        if value is not None:
            config[name] = value
    if max_context is not None and not isinstance(config.get("model_max_length"), int):
        config["model_max_length"] = max_context
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (transformers): the default one, as chat requests use it
        template = template.get("default")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    else:
        config.pop("chat_template", None)
    return config


def _special_token(tokenizer: Any, name: str) -> str | None:
    tokens = getattr(tokenizer, "special_tokens_map", None)  # Hugging Face: only the set ones (no warning)
    value = tokens.get(name) if isinstance(tokens, dict) else getattr(tokenizer, name, None)
    value = _json(value)
    return value if isinstance(value, str) else None


def codec_tokenizer_info(codec: Any) -> dict[str, Any]:
    """The answer for the server's codec: its ``tokenizer_info()`` where it has one
    (:class:`~dsi.server.codec.HFCodec`), else what any codec tells (a model without a tokenizer: its EOS as the text ``/tokenize`` reads back to it)."""
    info = getattr(codec, "tokenizer_info", None)
    if callable(info):
        return info()
    config: dict[str, Any] = {"tokenizer_class": type(codec).__name__}
    if codec.eos_token_ids:
        config["eos_token"] = codec.decode([codec.eos_token_ids[0]], skip_special_tokens=False)
    if codec.max_context is not None:
        config["model_max_length"] = codec.max_context
    return config
