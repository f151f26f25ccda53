"""Where a backend's logits depend on how the forward was cut
(docs/results.md#where-the-logits-depend-on-the-cut).

For one model, the largest logit difference of the same position computed:

- inside batches of 1..16 tokens (after the same prefix);
- after a prefill of the prompt at once, in two chunks, and one token at a time;
- after a cache hit (a longer sequence truncated back) against a fresh session;
- one token at a time after other sequences against one token at a time in a fresh session (the
  deterministic mode's canonical cut);
- llama.cpp, past 256 tokens (``--long N``, default 300): a whole sequence's rows one token at a time on
  2 threads against one token at a time on 1 thread and against forwards of 2 and 3 tokens, with flash
  attention auto and off (the CPU flash attention splits a one-token forward's KV across the threads
  once the cache view reaches 512 cells).

llama.cpp (raw ``llama.h`` calls, so runtime settings can be varied): each combination of weight
repacking (``use_extra_bufts``), flash attention (auto/off/on) and threads (2/1), micro-batches of one
token (``n_ubatch=1``), and the forward
times by batch size with repacking on and off. hf: a random Llama built here (``--hidden``), bf16 and
fp32, through dsi's own sessions.

    python benchmarks/row_cuts.py llama.cpp ~/.cache/dsi/gguf/qwen2.5-coder-1.5b-instruct.gguf --out docs/data/row_cuts-llama-2026-12-01.json
    python benchmarks/row_cuts.py hf --hidden 256 --out docs/data/row_cuts-hf-2026-12-01.json

Prints a table, then one JSON line. ``--dry-run``: llama.cpp on a tiny random GGUF (tests/tiny_gguf.py; no
GGUF argument) with a 40-token long probe, or hf at width 32.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import time

import numpy as np
from _common import add_options, emit, parse, scratch, shrink, tiny_pair

P = 24  # the probed position follows a 24-token prefix


def cuts(feed, trunc, fresh, toks) -> dict[str, float]:
    """``feed(tokens) -> rows`` / ``trunc(n)`` on one session, ``fresh()`` a new (feed, trunc, close)."""
    out = {}
    feed(toks[:P])
    ref, worst = None, 0.0
    for n in range(1, 17):
        trunc(P)
        row = np.asarray(feed(toks[P:P + n])[0], np.float64)
        ref = row if ref is None else ref
        worst = max(worst, float(np.abs(row - ref).max()))
    out["batch 1..16"] = worst
    trunc(0)
    whole = np.asarray(feed(toks[:P])[-1], np.float64)
    trunc(0)
    feed(toks[:10])
    two = np.asarray(feed(toks[10:P])[-1], np.float64)
    trunc(0)
    for t in toks[:P]:
        serial = np.asarray(feed([t])[-1], np.float64)
    out["prefill at once vs 2 chunks"] = float(np.abs(whole - two).max())
    out["prefill at once vs token by token"] = float(np.abs(whole - serial).max())
    trunc(0)
    feed(toks[:32])
    trunc(P - 1)
    hit = np.asarray(feed([toks[P - 1]])[-1], np.float64)
    f_feed, _, f_close = fresh()
    f_feed(toks[:P - 1])
    new = np.asarray(f_feed([toks[P - 1]])[-1], np.float64)
    f_close()
    out["cache hit vs fresh session"] = float(np.abs(hit - new).max())
    trunc(0)
    for t in toks[:30]:
        feed([t])
    trunc(5)
    for t in toks[5:P]:
        after = np.asarray(feed([t])[-1], np.float64)
    f_feed, _, f_close = fresh()
    for t in toks[:P]:
        canon = np.asarray(f_feed([t])[-1], np.float64)
    f_close()
    out["token by token: after history vs fresh"] = float(np.abs(after - canon).max())
    return out


def llama(path: str, long: int = 300) -> dict:
    from llama_cpp import llama_cpp as ll

    ll.llama_backend_init()
    quiet = ll.llama_log_callback(lambda *a: None)
    ll.llama_log_set(quiet, ctypes.c_void_p())

    def load(repack: bool):
        p = ll.llama_model_default_params()
        p.n_gpu_layers, p.use_extra_bufts = 0, repack
        return ll.llama_model_load_from_file(path.encode(), p)

    def session(model, fa: int, threads: int, ubatch: int = 512, n_ctx: int = 512):
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, ubatch, 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type, cp.no_perf = fa, True
        ctx = ll.llama_init_from_model(model, cp)
        vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        batch = ll.llama_batch_init(512, 0, 1)
        state = {"n": 0}

        def feed(toks):
            batch.n_tokens = len(toks)
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, state["n"] + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            assert ll.llama_decode(ctx, batch) == 0
            state["n"] += len(toks)
            return [np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy()
                    for i in range(len(toks))]

        def trunc(n):
            ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), 0, n, -1)
            state["n"] = n

        def close():
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)

        return feed, trunc, close, vocab

    rows, speed, long_found = {}, {}, {}
    for repack in (True, False):
        model = load(repack)
        for fa, threads in itertools.product((-1, 0, 1), (2, 1)):
            feed, trunc, close, vocab = session(model, fa, threads)
            toks = [int(t) for t in np.random.default_rng(0).integers(min(100, vocab // 4), min(vocab, 20000), 40)]
            rows[f"repack={repack} flash_attn={fa} threads={threads}"] = cuts(
                feed, trunc, lambda m=model, f=fa, t=threads: session(m, f, t)[:3], toks)
            close()
        if repack:  # micro-batches of one token: does llama.cpp then compute a batch as one-token forwards?
            feed, trunc, close, vocab = session(model, -1, 2, ubatch=1)
            toks = [int(t) for t in np.random.default_rng(0).integers(min(100, vocab // 4), min(vocab, 20000), 40)]
            rows["repack=True flash_attn=-1 threads=2 n_ubatch=1"] = cuts(
                feed, trunc, lambda m=model: session(m, -1, 2, ubatch=1)[:3], toks)
            feed(toks[:24])
            runs = []
            for _ in range(5):
                trunc(24)
                began = time.perf_counter()
                feed(toks[24:30])
                runs.append(time.perf_counter() - began)
            speed["repack=True n_ubatch=1"] = {6: 1000 * sorted(runs)[2]}
            close()
            long_found = long_rows(lambda fa, threads, m=model: session(m, fa, threads, n_ctx=max(512, long + 8)), long)
        feed, trunc, close, vocab = session(model, -1, 2)
        toks = [int(t) for t in np.random.default_rng(1).integers(min(100, vocab // 4), min(vocab, 20000), 200)]
        feed(toks[:40])
        times = {}
        for n in (1, 2, 6, 9):
            runs = []
            for _ in range(5):
                trunc(40)
                began = time.perf_counter()
                feed(toks[40:40 + n])
                runs.append(time.perf_counter() - began)
            times[n] = 1000 * sorted(runs)[2]
        speed[f"repack={repack}"] = times
        close()
        ll.llama_model_free(model)
    return {"model": path, "rows": rows, "forward_ms_by_tokens": speed, "long": long_found}


def long_rows(open_session, n: int) -> dict:
    """Rows of an ``n``-token sequence computed in forwards of 1, 2 or 3 tokens, on 2 or 1 threads, with
    flash attention auto (-1) and off (0): the largest difference from one token a forward on 2 threads,
    and the first position that differs. ``open_session(fa, threads) -> (feed, trunc, close, vocab)``."""

    def rows(fa: int, threads: int, size: int) -> np.ndarray:
        feed, _, close, vocab = open_session(fa, threads)
        toks = [int(t) for t in np.random.default_rng(0).integers(min(100, vocab // 4), min(vocab, 20000), n)]
        out = [row for start in range(0, n, size) for row in feed(toks[start:start + size])]
        close()
        return np.array(out, np.float64)

    found = {}
    for fa in (-1, 0):
        ref = rows(fa, 2, 1)
        for threads, size in ((1, 1), (2, 2), (2, 3), (1, 3)):
            gap = np.abs(rows(fa, threads, size) - ref).max(axis=1)
            differing = np.nonzero(gap)[0]
            found[f"flash_attn={fa} threads={threads} tokens a forward={size}"] = {
                "max": float(gap.max()), "first_position": int(differing[0]) if len(differing) else None}
    return {"tokens": n, "against": "one token a forward, 2 threads, the same flash attention", "rows": found}


def hf(hidden: int) -> dict:
    import torch

    from dsi.models.hf.model import HFModel
    from tests.tiny_hf import make_model_dir

    torch.set_num_threads(2)
    folder = make_model_dir(scratch() / "m", seed=0, layers=4, hidden=hidden)
    rows = {}
    for dtype in ("bf16", "fp32"):
        model = HFModel.load(str(folder), dtype=dtype, progress=False)
        toks = [int(t) for t in np.random.default_rng(0).integers(5, model.vocab_size, 40)]

        def open_session(m=model):
            s = m.new_session()
            return (lambda t: s.extend(t)), s.truncate, s.close

        feed, trunc, close = open_session()
        rows[f"{dtype}"] = cuts(feed, trunc, open_session, toks)
        close()
    return {"model": f"random Llama, 4 layers, hidden {hidden}", "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backend", choices=["llama.cpp", "hf"])
    parser.add_argument("gguf", nargs="?", help="llama.cpp: the GGUF file")
    parser.add_argument("--hidden", type=int, default=256, help="hf: hidden size of the random model")
    parser.add_argument("--long", type=int, default=300, help="llama.cpp: tokens of the long-sequence probe")
    add_options(parser, "llama.cpp: a tiny random GGUF, a 40-token long probe; hf: width 32")
    args = parse(parser)
    if shrink(args, long=40, hidden=32) and args.backend == "llama.cpp":
        args.gguf = tiny_pair("llama.cpp")[0]
    if args.backend == "llama.cpp" and not args.gguf:
        parser.error("llama.cpp needs the GGUF file")
    doc = llama(args.gguf, args.long) if args.backend == "llama.cpp" else hf(args.hidden)
    names = list(next(iter(doc["rows"].values())))
    print("| setting | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for setting, values in doc["rows"].items():
        print(f"| {setting} | " + " | ".join(f"{values[n]:.3g}" for n in names) + " |")
    for setting, times in doc.get("forward_ms_by_tokens", {}).items():
        print(f"{setting}: forward ms by new tokens " + ", ".join(f"{n}: {t:.1f}" for n, t in times.items()))
    for setting, found in doc.get("long", {}).get("rows", {}).items():
        print(f"{doc['long']['tokens']} tokens, {setting}: max {found['max']:.3g} from one token a forward on 2 "
              f"threads, first at position {found['first_position']}")
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
