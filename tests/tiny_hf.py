"""Tiny Hugging Face model directories for tests: a byte-level BPE tokenizer trained in-test on
a small corpus (so multi-byte characters span several tokens) and random Llama / GPT-2 weights
built from config with a fixed seed. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
    "héllo wörld, naïve café — 日本語のテキスト 🙂 and some emoji 🚀🎉",
    "The quick brown fox jumps over the lazy dog.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 5, vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def perturb(model, noise: float, seed: int = 1):
    """``model`` with seeded noise added to every tensor (``noise`` x the tensor's std), in place; returns it.
    A copy of a tiny model perturbed by 0.3 drafts for it: the two agree on about half their greedy tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(noise * tensor.std() * torch.randn(tensor.shape, generator=generator))
    return model


def make_model_dir(path: Path, arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 32,
                   positions: int = 256, init_std: float = 0.02, vocab_size: int | None = None) -> Path:
    """Save a random ``arch`` model with the test tokenizer to ``path`` (``positions``: its longest
    context; ``init_std``: its weights' standard deviation, transformers' ``initializer_range``: larger
    weights make larger logits, whose bf16 rounding moves log-probabilities more; ``vocab_size``: rows of its
    embeddings and head, at least the tokenizer's, as a real model's padded vocabulary); return ``path``."""
    import torch
    import transformers

    tok = make_tokenizer()
    vocab = max(len(tok), vocab_size or 0)
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
            eos_token_id=eos, bos_token_id=0, pad_token_id=0, initializer_range=init_std,
        )
        model = transformers.LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=positions,
            bos_token_id=0, eos_token_id=eos, initializer_range=init_std,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    path.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path
