"""Sampled draft trees against chains in wall time, on emulated latencies with a real pair's rows (issue 24's
second benchmark, at T = 0.7; ``tree_walltime.py`` times greedy requests on recordings).

A sampled request is not decided by a recording (each seed writes its own text), so here the rows are the real
pair's: :class:`Memoised` serves each model's row at a context from memory (float32, as llama.cpp gives it; the
memory is emptied between prompt sets; a draft tree's rows in one copy, as a backend's tree kernel returns them,
since docs/results.md#dsi-trees-wall-time-on-the-gpu-like-model), computing it once with the real model
(llama.cpp; ``--drafter smollm2-135m-instruct`` drafts through the token intersection). Both models are wrapped
in ``WithLatency`` on the two cost models of ``tree_walltime.py``:

- GPU-like: every forward costs the same (target 20 ms, drafter 2 ms), a tree of n nodes what a chain of n
  tokens costs;
- CPU-like: a target forward costs 8 ms + 3 ms per token it computes; the drafter 2 ms.

A drafter of another vocabulary may run more than one real forward for a row (its merges look ahead from the
likely shared tokens, dsi.models.vocab.merges, in a forward of their own whose rows the next drafts mostly read): an
emulated drafter row then costs the real drafter's forwards per row in that set's fills, times the model's
forward (``--drafter-cost per-row``: one forward a row, as before).

A seeded request decides the same tokens whatever the timing (docs/architecture.md), so SI visits the same
contexts on every run, and after untimed passes per configuration that fill the memory, the timed runs are
the real pair's decisions at the emulated cost. DSI's drafter may run further ahead in one run than in
another, and its servers may verify a window past a rejection, so a timed run can ask for a row no fill
computed. Such a row is never on the text's path (every context a text passes through was filled by the first
pass, the text being the same every run), so by default (``--misses stand-in``) it is served as a stand-in, the
row of its longest filled prefix, at the emulated cost, instead of a real forward that would stall the run for
~0.1 s; it can only move the work DSI discards, never a committed token, and every timed text is checked equal
to its fill's. The stand-ins are counted per configuration. ``--misses compute`` computes them (and runs such a
run again, up to 3 times), as docs/results-log.md#2026-12-04 did.

**Runs**, per prompt set and cost model: SI with k = ``--k``, its chain against the trees ``auto`` (priced from
the emulated costs), ``auto:0.1`` and ``branches:0.05``; DSI with event-driven windows on SP = 2 and 4 target
servers, chain against ``auto`` and ``auto:0.1`` (DSI's windows take leaf side children). Seeds
0..S-1 per prompt (``--trees`` compares other trees with each chain, ``--servers`` picks DSI's server counts).
Each shape writes its own text after its first side win (docs/results-log.md#2026-12-03), so the
ratio of time per token is reported with a bootstrap interval over the (prompt, seed) texts, paired: a resample
draws texts, and each configuration's time per token over them is compared with its chain's over the same texts.

    python benchmarks/tree_sampled_walltime.py --drafter smollm2-135m-instruct \\
        --out docs/data/tree_sampled_walltime_smollm2-2026-12-03.json

Prints one table per set and cost model, then one JSON line. ``--dry-run``: a tiny random GGUF pair
(tests/tiny_gguf.py), the code set's first prompt, one seed of 6 tokens, the GPU-like costs, one fill and one
repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np
from _common import add_options, emit, parse, shrink, tiny_pair
from tree_walltime import COST_MODELS

CONFIGS = [  # (label, method, lookahead, servers, draft tree); each tree is compared with the chain before it
    ("SI chain", "si", None, 1, None),
    ("SI auto", "si", None, 1, "auto"),
    ("SI auto:0.1", "si", None, 1, "auto:0.1"),
    ("SI branches:0.05", "si", None, 1, "branches:0.05"),
    ("DSI SP=2 chain", "dsi", "auto", 2, None),
    ("DSI SP=2 auto", "dsi", "auto", 2, "auto"),
    ("DSI SP=2 auto:0.1", "dsi", "auto", 2, "auto:0.1"),
    ("DSI SP=4 chain", "dsi", "auto", 4, None),
    ("DSI SP=4 auto", "dsi", "auto", 4, "auto"),
    ("DSI SP=4 auto:0.1", "dsi", "auto", 4, "auto:0.1"),
]


class Memoised:
    """A real model's next-token row at any context, computed once (one real session, reused along shared
    prefixes; a forward computes every row an extension misses) and then served from memory. ``misses``
    counts rows computed, ``miss_s`` the seconds they took."""

    def __init__(self, model, name: str) -> None:
        self.model = model
        self.name = name
        self.session = model.new_session()
        self.rows: dict[tuple[int, ...], np.ndarray] = {}
        self.misses = 0
        self.miss_s = 0.0
        self.stand_ins = 0  # rows served from their longest filled prefix while ``frozen``
        self.frozen = False  # True: a missing row is a stand-in, not a real forward (the module docstring)
        self.lock = threading.Lock()  # DSI's target servers share the real session

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def missed(self) -> int:
        """Rows asked for that no earlier pass held: computed (``misses``) or served as stand-ins."""
        return self.misses + self.stand_ins

    def new_session(self) -> MemoisedSession:
        return MemoisedSession(self)

    def rows_after(self, context: tuple[int, ...], count: int) -> np.ndarray:
        """The rows following the last ``count`` positions of ``context`` ``[count, V]``."""
        from dsi.models.base import forward_rows

        keys = [context[: len(context) - count + 1 + i] for i in range(count)]
        with self.lock:
            missing = [i for i, key in enumerate(keys) if key not in self.rows]
            if missing and self.frozen:
                self.stand_ins += len(missing)
                return np.stack([self.rows[key] if key in self.rows else self._nearest(key) for key in keys])
            if missing:
                start = time.perf_counter()
                first = missing[0]
                got = np.asarray(forward_rows(self.session, context, count - first), dtype=np.float32)
                for i, row in zip(range(first, count), got, strict=True):
                    self.rows.setdefault(keys[i], row)
                self.misses += len(missing)
                self.miss_s += time.perf_counter() - start
            return np.stack([self.rows[key] for key in keys])

    def tree_rows_after(self, prefix: tuple[int, ...], tree) -> np.ndarray | None:
        """A draft tree's rows after ``prefix`` (:func:`dsi.models.base.tree_rows`) gathered in one copy, as a
        backend's tree kernel returns them, or None where a node's row is not held and not ``frozen`` (the caller
        computes them path by path)."""
        keys = [prefix] + [prefix + tuple(tree.path_tokens(node)) for node in range(len(tree))]
        with self.lock:
            if not self.frozen and any(key not in self.rows for key in keys):
                return None
            held = [self.rows.get(key) for key in keys]
            self.stand_ins += sum(row is None for row in held)
            return np.stack([self._nearest(key) if row is None else row for key, row in zip(keys, held, strict=True)])

    def _nearest(self, key: tuple[int, ...]) -> np.ndarray:
        """The row of ``key``'s longest prefix held (the prompt's rows always are, once filled)."""
        for end in range(len(key) - 1, 0, -1):
            if key[:end] in self.rows:
                return self.rows[key[:end]]
        raise KeyError(f"{self.name}: no row held for any prefix of a {len(key)}-token context")

    def forget(self) -> None:
        """Drop every row held (the next prompt set visits other contexts)."""
        with self.lock:
            self.rows.clear()

    def __repr__(self) -> str:
        return f"Memoised({self.name})"


class MemoisedSession:
    def __init__(self, model: Memoised) -> None:
        self._model = model
        self._tokens: list[int] = []

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def extend(self, tokens, cancel=None) -> np.ndarray:
        from dsi.errors import TaskCancelled

        if cancel is not None and cancel.is_set():
            raise TaskCancelled("forward cancelled")
        context = tuple(self._tokens) + tuple(int(t) for t in tokens)
        rows = self._model.rows_after(context, len(tokens))
        self._tokens = list(context)
        return rows

    def tree_rows(self, prefix, tree, cancel=None, *, greedy: bool = False, top: int | None = None) -> np.ndarray:
        """A draft tree's rows in one copy where every node's row is held (a real backend's tree kernel copies
        its rows out once; path by path, each path's rows would be copied twice), else path by path."""
        from dsi.errors import TaskCancelled
        from dsi.models.base import path_tree_rows

        if cancel is not None and cancel.is_set():
            raise TaskCancelled("forward cancelled")
        prefix = tuple(int(t) for t in prefix)
        rows = None if greedy else self._model.tree_rows_after(prefix, tree)
        if rows is None:
            return path_tree_rows(self, prefix, tree, cancel, greedy=greedy, top=top)
        main = tree.main_path()  # the session keeps the prefix and the tree's main path, as tree_rows leaves it
        self._tokens = list(prefix) + (tree.path_tokens(main[-1]) if main else [])
        return rows

    def truncate(self, length: int) -> None:
        del self._tokens[length:]

    def close(self) -> None:
        self._tokens = []


def run_texts(target, drafter, prompts, seeds: int, tokens: int, temperature: float, label: str, method: str,
              k, servers: int, tree) -> dict:
    """One configuration over every (prompt, seed): per text its wall time, tokens, verifications, side wins and
    rejections (a side win is a rejection its tree rescued)."""
    import dsi
    import dsi.trees

    # "branches@1": DSI's side chains that deep (dsi.trees.DSI_CHAIN_DEPTH, restored after the runs)
    tree, _, depth = (tree or "").partition("@")
    tree = tree or None
    shipped = dsi.trees.DSI_CHAIN_DEPTH
    if depth:
        dsi.trees.DSI_CHAIN_DEPTH = int(depth)
    try:
        return _run_texts(target, drafter, prompts, seeds, tokens, temperature, label, method, k, servers, tree)
    finally:
        dsi.trees.DSI_CHAIN_DEPTH = shipped


def _run_texts(target, drafter, prompts, seeds: int, tokens: int, temperature: float, label: str, method: str,
               k, servers: int, tree) -> dict:
    import dsi

    texts = []
    for prompt in prompts:
        for seed in range(seeds):
            out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=k,
                               num_target_servers=servers, draft_tree=tree, max_new_tokens=tokens,
                               sampling=dsi.SamplingParams(temperature=temperature, seed=seed))
            texts.append({"wall_s": out.stats.wall_time_s, "tokens": len(out.tokens),
                          "verifications": out.stats.verify_tasks,
                          "side_wins": out.stats.extra.get("tree_side_accepts", 0),
                          "rejections": out.stats.rejections,
                          "continued_side_wins": out.stats.extra.get("tree_continued_sides", 0),
                          "side_chain_rows": out.stats.extra.get("tree_side_chain_rows", 0),
                          "side_guesses_right": out.stats.extra.get("tree_side_guesses_right", 0),
                          "floor": out.stats.extra.get("tree_floor"), "ids": list(out.tokens)})
    return {"label": label, "texts": texts}


def paired_interval(chain: list[dict], tree: list[dict], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of the chain's time per token over the tree's, texts resampled in pairs."""
    rng = np.random.default_rng(seed)
    cw = np.array([t["wall_s"] for t in chain])
    ct = np.array([t["tokens"] for t in chain])
    tw = np.array([t["wall_s"] for t in tree])
    tt = np.array([t["tokens"] for t in tree])
    ratios = []
    for _ in range(draws):
        pick = rng.integers(0, len(cw), len(cw))
        ratios.append((cw[pick].sum() / ct[pick].sum()) / (tw[pick].sum() / tt[pick].sum()))
    low, high = np.percentile(ratios, [5, 95])
    return float(low), float(high)


def main() -> int:
    from dsi.cli.measure import PROMPT_SETS
    from dsi.models import WithLatency
    from dsi.models.vocab.bridge import bridge_drafter, shares_vocabulary
    from dsi.models.vocab.merges import MERGE_LOOKAHEAD
    from dsi.models.loading import load_pair

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per set")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--k", type=int, default=4, help="SI's lookahead (its draft budget B)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fills", type=int, default=2, help="untimed passes per configuration and cost model "
                        "(DSI's drafter runs further ahead in some runs than in others)")
    parser.add_argument("--sets", nargs="+", choices=("code", "prose"), default=["code", "prose"])
    parser.add_argument("--costs", nargs="+", choices=tuple(COST_MODELS), default=list(COST_MODELS))
    parser.add_argument("--trees", nargs="+", metavar="SHAPE",
                        help="the trees compared with each chain instead of the default ones (DSI skips widths per "
                        "depth and best-first; 'branches@D': DSI's side chains D tokens deep, "
                        "dsi.trees.DSI_CHAIN_DEPTH)")
    parser.add_argument("--dsi-only", action="store_true", help="with --trees: DSI's runs only, no SI")
    parser.add_argument("--servers", nargs="+", type=int, default=[2, 4], help="DSI's target servers (with --trees)")
    parser.add_argument("--misses", choices=("stand-in", "compute"), default="stand-in",
                        help="a row a timed run needs that no fill computed (off the text's path): served from its "
                        "longest filled prefix at the emulated cost, or computed by the real model")
    parser.add_argument("--merges", type=int, default=MERGE_LOOKAHEAD, help="a drafter of another vocabulary: "
                        "shared tokens per position whose merged tokens its law reaches (dsi.models.vocab.merges; 0: "
                        "plain TLI)")
    parser.add_argument("--drafter-cost", choices=("per-forward", "per-row"), default="per-forward",
                        help="an emulated drafter row costs the real drafter's forwards per row in the fills (a "
                        "bridged drafter's merges look ahead in forwards of their own), or one forward")
    add_options(parser, "a tiny random GGUF pair, 1 prompt x 1 seed x 6 tokens of the code set, GPU-like costs, "
                "one fill, one repeat")
    args = parse(parser)
    if shrink(args, tokens=6, prompts=1, seeds=1, repeats=1, fills=1, sets=["code"], costs=["gpu-like"]):
        args.target, args.drafter = tiny_pair("llama.cpp")
    start = time.perf_counter()
    real_target, real_drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    if not shares_vocabulary(real_target, real_drafter):
        real_drafter = bridge_drafter(real_target, real_drafter, "intersection", merges=args.merges)
    memo_target, memo_drafter = Memoised(real_target, args.target), Memoised(real_drafter, args.drafter)
    configs = [(label, method, args.k if k is None else k, servers, tree)
               for label, method, k, servers, tree in (CONFIGS if not args.trees else chosen(args.trees, args.servers, args.dsi_only))]
    results = []
    for set_name in args.sets:
        prompts = [real_target.encode(text) for text in PROMPT_SETS[set_name][: args.prompts]]
        memo_target.forget(), memo_drafter.forget()
        filled: dict[str, list[list[int]]] = {}  # each configuration's texts, as the fills wrote them
        forwards_before, rows_before = drafter_forwards(memo_drafter), memo_drafter.misses
        for cost_name in args.costs:  # fill the memory: untimed passes per configuration and cost model
            cost = COST_MODELS[cost_name]
            target = WithLatency(memo_target, **cost["target"])
            drafter = WithLatency(memo_drafter, **cost["drafter"])
            for _ in range(args.fills):
                for config in configs:
                    run = run_texts(target, drafter, prompts, args.seeds, args.tokens, args.temperature, *config)
                    filled[config[0]] = [t["ids"] for t in run["texts"]]
            print(f"{set_name}: filled for {cost_name}: {len(memo_target.rows)} target rows "
                  f"({memo_target.miss_s:.0f} s), {len(memo_drafter.rows)} drafter rows ({memo_drafter.miss_s:.0f} s); "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        # the real drafter's forwards per row in these fills (a bridged drafter's merges look ahead in forwards
        # of their own): each emulated drafter row costs that many forwards (``--drafter-cost per-row``: one)
        rows_filled = memo_drafter.misses - rows_before
        per_row = ((drafter_forwards(memo_drafter) - forwards_before) / rows_filled
                   if args.drafter_cost == "per-forward" and rows_filled and drafter_forwards(memo_drafter) else 1.0)
        print(f"{set_name}: the real drafter ran {per_row:.2f} forwards per row; each emulated drafter row costs as "
              "many", file=sys.stderr, flush=True)
        for cost_name in args.costs:
            cost = COST_MODELS[cost_name]
            target = WithLatency(memo_target, **cost["target"])
            drafter = WithLatency(memo_drafter, **{name: value * per_row for name, value in cost["drafter"].items()})
            runs: dict[str, list[dict]] = {label: [] for label, *_ in configs}
            timed_misses = 0
            misses_of: dict[str, int] = {}
            memo_target.frozen = memo_drafter.frozen = args.misses == "stand-in"
            for _ in range(args.repeats):
                for config in configs:
                    for _attempt in range(3):  # a run that computed a row is run again (its time is not the model's)
                        before = memo_target.missed + memo_drafter.missed
                        run = run_texts(target, drafter, prompts, args.seeds, args.tokens, args.temperature, *config)
                        missed = memo_target.missed + memo_drafter.missed - before
                        timed_misses += missed
                        if not missed or args.misses == "stand-in":
                            break
                    if [t["ids"] for t in run["texts"]] != filled[config[0]]:
                        raise SystemExit(f"{config[0]}: a timed text differs from its fill's (a missing row was on "
                                         "the text's path)")
                    runs[config[0]].append(run | {"misses": missed})
                    misses_of[config[0]] = misses_of.get(config[0], 0) + missed
            memo_target.frozen = memo_drafter.frozen = False
            row = summarise(set_name, cost_name, configs, runs, timed_misses, misses_of, args.misses)
            row["drafter_forwards_per_row"] = per_row
            results.append(row)
            print_table(row)
    print(f"{args.target} / {args.drafter}, rows memoised from llama.cpp, T = {args.temperature}, SI k = {args.k}, "
          f"{args.prompts} prompts x {args.seeds} seeds x {args.tokens} tokens per set, median of {args.repeats} "
          f"({time.perf_counter() - start:.0f} s)")
    # what the real drafter ran for the rows it served (a bridged drafter: its own forwards, merges' lookaheads
    # included), against the one forward per row the cost model charges
    counters = dict(getattr(memo_drafter.session, "counters", {}))
    drafter_work = {"rows": memo_drafter.misses, **counters}
    if counters.get("drafter_model_forwards") and memo_drafter.misses:
        print(f"the real drafter: {counters['drafter_model_forwards'] / memo_drafter.misses:.2f} forwards per row "
              f"({counters.get('drafter_merge_forwards', 0)} of them merges' lookaheads, {memo_drafter.misses} rows)")
    emit({"benchmark": "tree_sampled_walltime", "target": args.target, "drafter": args.drafter,
          "merges": args.merges,
          "temperature": args.temperature, "tokens": args.tokens, "prompts_per_set": args.prompts,
          "seeds": args.seeds, "k": args.k, "repeats": args.repeats, "cost_models": COST_MODELS,
          "drafter_work": drafter_work, "results": results}, args.out)
    return 0


def drafter_forwards(memo: Memoised) -> int:
    """The forwards the real drafter under ``memo`` has run (a bridged drafter counts them; 0 otherwise)."""
    return int(getattr(memo.session, "counters", {}).get("drafter_model_forwards", 0))


def chosen(trees: list[str], servers: list[int], dsi_only: bool = False) -> list[tuple]:
    """SI's chain and ``trees`` (unless ``dsi_only``), then per DSI server count its chain and the trees DSI's
    windows take (widths per depth and ``best-first`` are SI's)."""
    configs: list[tuple] = [] if dsi_only else ([("SI chain", "si", None, 1, None)]
                                                + [(f"SI {t}", "si", None, 1, t) for t in trees])
    for sp in servers:
        configs.append((f"DSI SP={sp} chain", "dsi", "auto", sp, None))
        configs += [(f"DSI SP={sp} {t}", "dsi", "auto", sp, t) for t in trees
                    if "," not in t and not t.startswith("best")]
    return configs


def summarise(set_name: str, cost_name: str, configs, runs: dict[str, list[dict]], timed_misses: int,
              misses_of: dict[str, int], misses: str) -> dict:
    """Per configuration: the median over repeats of each text's wall time, the tokens, verifications and side
    wins (the same every repeat: seeded), and against its chain the time-per-token ratio with its interval.
    ``misses``: how a timed run's missing rows were served (``--misses``)."""
    row = {"prompts": set_name, "cost": cost_name, "misses": misses, "timed_misses": timed_misses, "configs": {}}
    chain_label = None
    for label, *_ in configs:
        repeats = runs[label]
        texts = []
        for i, first in enumerate(repeats[0]["texts"]):
            for other in repeats[1:]:
                if other["texts"][i]["ids"] != first["ids"]:
                    raise SystemExit(f"{label}: a seeded text changed between repeats")
            texts.append({**{k: v for k, v in first.items() if k != "ids"},
                          "wall_s": statistics.median(r["texts"][i]["wall_s"] for r in repeats)})
        tokens = sum(t["tokens"] for t in texts)
        entry = {"wall_s": sum(t["wall_s"] for t in texts), "tokens": tokens,
                 "tokens_per_s": tokens / sum(t["wall_s"] for t in texts),
                 "tokens_per_verification": tokens / max(sum(t["verifications"] for t in texts), 1),
                 "side_wins": sum(t["side_wins"] for t in texts),
                 "continued_side_wins": sum(t["continued_side_wins"] for t in texts),
                 "side_guesses_right": sum(t["side_guesses_right"] for t in texts),
                 "side_chain_rows": sum(t.get("side_chain_rows", 0) for t in texts),
                 "rejections": sum(t["rejections"] for t in texts),
                 "floor": texts[-1]["floor"],
                 "rows_missed_in_timed_runs": misses_of.get(label, 0), "texts": texts}
        if label.endswith("chain"):
            chain_label = label
        else:
            chain = row["configs"][chain_label]
            entry["speedup_over_chain"] = entry["tokens_per_s"] / chain["tokens_per_s"]
            entry["interval_90"] = paired_interval(chain["texts"], texts)
            # "branches" in DSI commits the chain's tokens, seed for seed; other trees write their own after a side win
            entry["texts_equal_to_chain"] = sum(a["ids"] == b["ids"] for a, b in
                                                zip(repeats[0]["texts"], runs[chain_label][0]["texts"], strict=True))
        row["configs"][label] = entry
    return row


def print_table(row: dict) -> None:
    served = "served as stand-ins" if row["misses"] == "stand-in" else "computed"
    print(f"\n{row['prompts']}, {row['cost']} ({row['timed_misses']} rows missed in timed runs, {served})")
    print("| configuration | tokens / s | tokens / verification (SI) | side wins (share of rejections rescued) | "
          "floor | rows missed | / chain (90% interval) |")
    print("|---|---|---|---|---|---|---|")
    for label, e in row["configs"].items():
        ratio = ("" if "speedup_over_chain" not in e else
                 f"{e['speedup_over_chain']:.3f} ({e['interval_90'][0]:.3f}-{e['interval_90'][1]:.3f}; "
                 f"{e['texts_equal_to_chain']}/{len(e['texts'])} texts the chain's)")
        per_verification = f"{e['tokens_per_verification']:.2f}" if label.startswith("SI") else "-"
        rescued = e["side_wins"] / max(e["side_wins"] + e["rejections"], 1)
        print(f"| {label} | {e['tokens_per_s']:.1f} | {per_verification} | {e['side_wins']} ({rescued:.2f}) | "
              f"{e['floor']} | {e['rows_missed_in_timed_runs']} | {ratio} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
