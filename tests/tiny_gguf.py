"""Tiny GGUF files for the llama.cpp backend's tests, written in-test with the ``gguf`` package.

:func:`write_tiny_gguf` builds the same random Llama model and byte-level BPE tokenizer as
:mod:`tests.tiny_hf` (seeded), and writes them as a GGUF file the way llama.cpp's converter does:
float32 tensors under llama.cpp's names, the query and key projections permuted for llama.cpp's
rotary layout, the tokenizer as a ``gpt2`` vocabulary with its merges and the chat template. The
Hugging Face model comes back too, so tests can hold llama.cpp's logits against transformers'.
Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.tiny_hf import SPECIALS, make_tokenizer, perturb

TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama_token_type


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary halves -> llama.cpp's interleaved pairs (as convert_hf_to_gguf.py does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 32, max_positions: int = 256):
    """(HF LlamaForCausalLM in float32, its tokenizer): the same as ``tests.tiny_hf.make_model_dir``."""
    import torch
    import transformers

    tok = make_tokenizer()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval(), tok


QUANTS = ("Q8_0", "Q4_0")  # what ``quant=`` may ask for (rows of a multiple of 32; gguf has no Q4_K quantizer)


def add_llama(writer, model, quant: str | None = None) -> None:
    """The hyperparameters and tensors of the HF ``LlamaForCausalLM`` ``model`` under llama.cpp's
    names, as its converter writes them (query and key permuted): float32, or with ``quant`` every
    matrix (the embedding, projections and output layer) quantized to that type by the ``gguf``
    package, the norms kept in float32, as llama.cpp's quantizer does."""
    import gguf

    if quant is not None and quant not in QUANTS:
        raise ValueError(f"quant={quant!r} must be one of {QUANTS}")
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None

    def add(name: str, array: np.ndarray) -> None:
        if qtype is None or array.ndim != 2:
            writer.add_tensor(name, array)
            return
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if array.shape[1] % block:
            raise ValueError(f"{name}: rows of {array.shape[1]} do not split into {quant} blocks of {block}")
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype),
                          raw_dtype=qtype)

    config = model.config
    heads, kv_heads, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // heads)
    file_type = {None: "ALL_F32", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0"}[quant]
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    weights = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    add("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", weights[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", _permute(weights[p + "self_attn.q_proj.weight"], heads))
        add(f"blk.{i}.attn_k.weight", _permute(weights[p + "self_attn.k_proj.weight"], kv_heads))
        add(f"blk.{i}.attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    add("output.weight", weights["lm_head.weight"])


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf(path: Path, seed: int = 0, layers: int = 2, hidden: int = 32, max_positions: int = 256,
                    quant: str | None = None, noise: float = 0.0):
    """Write the tiny Llama as ``path`` (a .gguf file); return ``(path, hf_model, tokenizer)``.
    ``quant``: quantize its matrices (:data:`QUANTS`); ``noise``: perturb its weights first
    (:func:`tests.tiny_hf.perturb`: a drafter for the unperturbed model)."""
    import gguf

    model, tok = tiny_llama(seed, layers, hidden, max_positions)
    if noise:
        perturb(model, noise)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-llama-{seed}")
    writer.add_vocab_size(len(tok))
    vocab = tok.get_vocab()
    tokens = [""] * len(vocab)
    for text, index in vocab.items():
        tokens[index] = text
    state = json.loads(tok.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([TOKEN_CONTROL if t in SPECIALS else TOKEN_NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)
    add_llama(writer, model, quant)
    finish(writer)
    return Path(path), model, tok
