"""Tree windows against chains in wall time, on emulated latencies driven by recordings of a real pair
(issue 24's second benchmark), greedy.

**Recordings.** For each prompt of a set (code, prose), the embedded pair on llama.cpp: the target's
greedy output, and the drafter's 8 likeliest tokens with their probabilities (softmax of its logits)
at every position of it, from one batched forward over prompt + output.

**The models** replay them (:class:`Recorded`, a ``CallableLM`` over the tokens the recording uses):
the target's row after ``prompt + output[:i]`` has its maximum at ``output[i]``; the drafter's row
there gives the recorded tokens their recorded probabilities. Greedy verification only walks along the
target's output, and every side child that wins is the target's token, so every decision the engine
takes is the real pair's; what a model says off the recording (after a rejected draft) is discarded by
the algorithm whatever it is; except the shape of SI's dynamic (``auto``) tree, which follows the
drafter's rows off the target's path, where the replayed drafter's law is flat: its best-first growth
then never spends budget below a wrong draft, which makes those runs optimistic (``--budgets`` and
``--exact-si`` measure them with the real drafter). Both are wrapped in ``WithLatency``:

- GPU-like: every forward costs the same (target 20 ms, drafter 2 ms), a tree of n nodes what a
  chain of n tokens costs (the memory-bound regime the paper simulates);
- CPU-like: a target forward costs 8 ms + 3 ms per token it computes (a tree's side children cost
  what they compute); the drafter 2 ms.

**Runs**: non-SI; SI k = 5, chain and trees ``2,2,1``, ``auto`` and ``best-first`` (also with a drafter that
computes a round of the tree path by path instead of in one forward: its "vs its chain" is against the
batched one); DSI with event-driven windows on SP = 2
and 4 target servers, chain and trees ``2`` and ``auto`` (and ``4`` on 4 servers); and what ``method="auto"`` picks (up to SP = 4,
calibrated on the set's first prompt, chains and trees weighed), against the fastest chain of the table.
Median wall time over repeats, one run per prompt and configuration in turn; every output is checked
against the recording.

    python benchmarks/tree_walltime.py --out docs/data/tree_walltime-2026-12-01.json

With ``--budgets B [B ...]`` it measures instead, at each draft budget B, the tokens SI commits per target
verification with the chain (k = B), with the ``best-first`` tree of B nodes and with the ``auto`` tree (the
chain's B drafts and their side children: the same drafting budget; its nodes per verification are
reported), and with the ``branches`` tree (B rounds of drafting, its side children continued as the
drafter's chains) (issue 24's first benchmark, for dynamic trees), with no emulated latency: the real drafter drafts (llama.cpp), since a dynamic tree's
shape follows its rows off the target's path, which the recordings do not hold (the replayed drafter
above gives every such row a flat law, so its dynamic trees never spend budget below a wrong draft);
the target is the recording (its greedy decisions are all a greedy walk reads). ``--trees`` names other
trees for it (any ``--draft-tree`` value, such as ``branches:0.05``), ``--sets`` fewer prompt sets.

With ``--exact-si`` it times SI k = 5 with its chain against its ``auto``, ``branches`` and ``best-first`` trees on both cost models with
the real drafter's rows (:class:`MemoDrafter`: computed once per context, then served from memory at the
emulated cost), the correction of the replayed runs above for SI's dynamic trees.

Prints one table per cost model and prompt set, then one JSON line. ``--dry-run`` (in any mode): a tiny random
GGUF pair (tests/tiny_gguf.py), the code set's first prompt, 8 tokens, one repeat (``--budgets``: B = 4).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np
from _common import add_options, emit, parse, shrink, tiny_pair

TOP = 8  # drafter tokens kept per position
COST_MODELS = {
    "gpu-like": dict(target=dict(ttft=0.020, tpot=0.020), drafter=dict(ttft=0.002, tpot=0.002)),
    "cpu-like": dict(target=dict(ttft=0.008, tpot=0.008, token_s=0.003), drafter=dict(ttft=0.002, tpot=0.002)),
}
CONFIGS = [  # (label, method, lookahead, servers, draft tree)
    ("non-SI", "ar", 1, 1, None),
    ("SI k=5", "si", 5, 1, None),
    ("SI k=5 tree=2,2,1", "si", 5, 1, "2,2,1"),
    ("SI k=5 tree=auto", "si", 5, 1, "auto"),
    ("SI k=5 tree=best-first", "si", 5, 1, "best-first"),
    ("SI k=5 tree=best-first, path by path", "si", 5, 1, "best-first"),  # a drafter without one-forward trees
    ("DSI auto SP=2", "dsi", "auto", 2, None),
    ("DSI auto SP=2 tree=2", "dsi", "auto", 2, "2"),
    ("DSI auto SP=2 tree=auto", "dsi", "auto", 2, "auto"),
    ("DSI auto SP=4", "dsi", "auto", 4, None),
    ("DSI auto SP=4 tree=2", "dsi", "auto", 4, "2"),
    ("DSI auto SP=4 tree=auto", "dsi", "auto", 4, "auto"),
    ("DSI auto SP=4 tree=4", "dsi", "auto", 4, "4"),
]


def record(target, drafter, prompts: list[str], tokens: int) -> list[dict]:
    """Per prompt: its ids, the target's greedy output, the drafter's ranked (ids, probabilities) per position."""
    import dsi
    from dsi.logprobs import log_softmax
    from dsi.models.base import forward_rows

    recordings = []
    for text in prompts:
        ids = target.encode(text)
        out = dsi.generate(target=target, prompt=ids, method="ar", max_new_tokens=tokens).tokens
        session = drafter.new_session()
        rows = np.asarray(forward_rows(session, ids + out[:-1], len(out)), dtype=np.float64)  # row i: before out[i]
        session.close()
        logp = log_softmax(rows)
        top = np.argsort(-rows, axis=-1, kind="stable")[:, :TOP]
        recordings.append({"prompt": list(ids), "output": list(out), "ranked": top.tolist(),
                           "probs": np.exp(np.take_along_axis(logp, top, axis=-1)).tolist()})
        print(f"recorded {len(out)} tokens of {text[:40]!r}", file=sys.stderr, flush=True)
    return recordings


class Recorded:
    """The target and drafter of one recording set, over a compact vocabulary (the ids it uses)."""

    def __init__(self, recordings: list[dict]) -> None:
        ids = sorted({t for r in recordings for t in (*r["prompt"], *r["output"], *np.ravel(r["ranked"]).tolist())})
        self.index = {t: i for i, t in enumerate(ids)}
        self.vocab = len(ids) + 1  # + one token no recording uses: what the models say off the record
        self.target_next: dict[tuple[int, ...], int] = {}
        self.drafter_row: dict[tuple[int, ...], np.ndarray] = {}
        self.prompts, self.outputs = [], []
        for r in recordings:
            prompt = [self.index[t] for t in r["prompt"]]
            out = [self.index[t] for t in r["output"]]
            self.prompts.append(prompt)
            self.outputs.append(out)
            for i, token in enumerate(out):
                context = tuple(prompt + out[:i])
                self.target_next[context] = token
                probs = np.asarray(r["probs"][i])
                row = np.full(self.vocab, np.log(max(1.0 - probs.sum(), 1e-12) / (self.vocab - TOP)))
                row[[self.index[t] for t in r["ranked"][i]]] = np.log(probs)
                self.drafter_row[context] = row

    def agreement(self) -> float:
        """How often the drafter's top token is the target's, over every recorded position."""
        return float(np.mean([token == self.drafter_row[tuple(p + o[:i])].argmax()
                              for p, o in zip(self.prompts, self.outputs, strict=True) for i, token in enumerate(o)]))

    def target_logits(self, context) -> np.ndarray:
        row = np.zeros(self.vocab)
        row[self.target_next.get(tuple(context), self.vocab - 1)] = 10.0
        return row

    def drafter_logits(self, context) -> np.ndarray:
        row = self.drafter_row.get(tuple(context))
        return row if row is not None else np.zeros(self.vocab)


AUTO = "method=auto"


def run_set(recorded: Recorded, cost: dict, repeats: int) -> dict:
    import tempfile

    import dsi
    from dsi.evaluate.autotune import choose_method
    from dsi.models import CallableLM, WithLatency

    target = WithLatency(CallableLM(recorded.target_logits, recorded.vocab, name="recorded target"), **cost["target"])
    drafter = WithLatency(CallableLM(recorded.drafter_logits, recorded.vocab, name="recorded drafter"),
                          **cost["drafter"])
    with tempfile.TemporaryDirectory() as cache:
        choice = choose_method(target, drafter, max_servers=4, prompt=recorded.prompts[0], cache_dir=cache)
    configs = CONFIGS + [(AUTO, choice.method, choice.lookahead, choice.num_target_servers, choice.draft_tree)]
    by_path = WithLatency(CallableLM(recorded.drafter_logits, recorded.vocab, name="recorded drafter"),
                          **cost["drafter"], one_forward_trees=False)
    walls: dict[str, list[float]] = {label: [] for label, *_ in configs}
    stats: dict[str, dict] = {label: {"accepted": 0, "side": 0, "forwards": 0, "tokens": 0} for label, *_ in configs}
    for _ in range(repeats):
        for label, method, k, servers, tree in configs:
            total = 0.0
            for prompt, want in zip(recorded.prompts, recorded.outputs, strict=True):
                model = by_path if label.endswith("path by path") else drafter
                out = dsi.generate(target=target, drafter=None if method == "ar" else model, prompt=prompt,
                                   method=method, lookahead=k, num_target_servers=servers, draft_tree=tree,
                                   max_new_tokens=len(want))
                if out.tokens != want:
                    raise SystemExit(f"{label}: output departs from the recording")
                total += out.stats.wall_time_s
                s = stats[label]
                s["accepted"] += out.stats.accepted_tokens
                s["side"] += out.stats.extra.get("tree_side_accepts", 0)
                s["forwards"] += out.stats.completed_target_forwards
                s["drafter_forwards"] = s.get("drafter_forwards", 0) + out.stats.drafter_forwards
                s["tokens"] += len(want)
            walls[label].append(total)
    med = {label: statistics.median(v) for label, v in walls.items()}
    return {"median_s": med, "walls": walls, "counts": stats,
            "auto": {"picked": choice.label, "reason": choice.reason, "calibration_s": choice.calibration_s}}


def recorded_target(recordings: list[dict], vocab: int):
    """The recorded target over the real vocabulary: its greedy token at every context on its path (exactly
    the decisions the real target takes, and the only rows a greedy walk reads)."""
    from dsi.models import CallableLM

    following = {tuple(r["prompt"] + r["output"][:i]): token for r in recordings for i, token in enumerate(r["output"])}

    def target_logits(context) -> np.ndarray:
        row = np.zeros(vocab, dtype=np.float32)
        row[following.get(tuple(context), 0)] = 10.0
        return row

    return CallableLM(target_logits, vocab, name="recorded target")


def si_over_recordings(target, drafter, recordings: list[dict], k: int, tree: str | None) -> dict[str, float]:
    """SI k = ``k`` (``tree``: its draft tree) over every recording's prompt, each output checked against the
    recording; the sums of wall time, verifications, tokens, side wins and drafter forwards."""
    import dsi

    sums = dict.fromkeys(("wall_s", "forwards", "tokens", "side_wins", "drafter_forwards", "drafted"), 0)
    for r in recordings:
        out = dsi.generate(target=target, drafter=drafter, prompt=r["prompt"], method="si", lookahead=k,
                           draft_tree=tree, max_new_tokens=len(r["output"]))
        if out.tokens != r["output"]:
            raise SystemExit(f"SI k={k} tree={tree}: output departs from the recording")
        sums["wall_s"] += out.stats.wall_time_s
        sums["forwards"] += out.stats.completed_target_forwards
        sums["tokens"] += len(r["output"])
        sums["side_wins"] += out.stats.extra.get("tree_side_accepts", 0)
        sums["drafter_forwards"] += out.stats.drafter_forwards
        sums["drafted"] += out.stats.drafted_tokens
    return sums


BUDGET_TREES = ("best-first", "auto", "branches")  # --budgets' trees unless --trees names others


def budgets_set(recordings: list[dict], vocab: int, drafter, budgets: list[int],
                trees: Sequence[str] = BUDGET_TREES) -> list[dict]:
    """Per budget: tokens per target verification of SI's chain and of each of ``trees`` at that budget (a
    ``best-first`` tree of that many nodes; ``auto`` that many drafts and their side children; ``branches``
    that many rounds), the real ``drafter`` drafting (a dynamic tree's shape follows the drafter's rows off
    the target's path too, which a recording does not hold) against :func:`recorded_target`."""
    target = recorded_target(recordings, vocab)
    rows = []
    for budget in budgets:
        row = {"budget": budget}
        for name in ("chain", *trees):
            sums = si_over_recordings(target, drafter, recordings, budget, None if name == "chain" else name)
            row[name] = sums["tokens"] / sums["forwards"]
            row[f"{name}_side_wins"] = sums["side_wins"]
            row[f"{name}_drafter_forwards"] = sums["drafter_forwards"]
            row[f"{name}_nodes_per_verification"] = sums["drafted"] / sums["forwards"]
        for name in trees:
            row[f"{name}_over_chain"] = row[name] / row["chain"]
        rows.append(row)
        print(f"B={budget}: chain {row['chain']:.2f}, " + ", ".join(f"{name} {row[name]:.2f}" for name in trees),
              file=sys.stderr, flush=True)
    return rows


class MemoDrafter:
    """The real drafter's row at any context, computed once (a llama.cpp session reused along shared
    prefixes) and then served from memory: SI's drafting visits the same contexts on every run (greedy),
    so after one pass that fills the memory, latency-emulated runs are the real drafter's decisions at
    the emulated cost. ``misses`` counts rows computed (none may happen in a timed run)."""

    def __init__(self, drafter) -> None:
        self.session = drafter.new_session()
        self.rows: dict[tuple[int, ...], np.ndarray] = {}
        self.misses = 0

    def logits(self, context) -> np.ndarray:
        from dsi.models.base import forward_rows

        key = tuple(int(t) for t in context)
        row = self.rows.get(key)
        if row is None:
            self.misses += 1
            row = self.rows[key] = np.asarray(forward_rows(self.session, key, 1)[0], dtype=np.float32)
        return row


def si_walltime_exact(recordings: list[dict], vocab: int, drafter, repeats: int, k: int = 5) -> dict:
    """SI's chain against its ``auto`` tree (k = ``k``) in wall time on both cost models, the drafter's rows
    the real drafter's (:class:`MemoDrafter`) and the target the recording (as in :func:`budgets_set`)."""
    from dsi.models import CallableLM, WithLatency

    memo = MemoDrafter(drafter)
    plain = CallableLM(memo.logits, vocab, name="real drafter, memoised")
    configs = {"SI chain": None, "SI tree=auto": "auto", "SI tree=branches": "branches",
               "SI tree=best-first": "best-first"}

    flat = recorded_target(recordings, vocab)
    for tree in configs.values():  # fill the memory: every context SI's drafting visits
        si_over_recordings(flat, plain, recordings, k, tree)
    result = {}
    for cost_name, cost in COST_MODELS.items():
        target = WithLatency(flat, **cost["target"])
        drafter_model = WithLatency(plain, **cost["drafter"])
        walls = {label: [] for label in configs}
        counts = {}
        for _ in range(repeats):
            for label, tree in configs.items():
                before = memo.misses
                sums = si_over_recordings(target, drafter_model, recordings, k, tree)
                if memo.misses != before:
                    raise SystemExit(f"{label}: the timed run visited contexts the first pass did not")
                walls[label].append(sums["wall_s"])
                counts[label] = sums["tokens"] / sums["forwards"]
        med = {label: statistics.median(v) for label, v in walls.items()}
        speedups = {label: med["SI chain"] / med[label] for label in configs if label != "SI chain"}
        result[cost_name] = {"median_s": med, "walls": walls, "tokens_per_verification": counts,
                             "tree_speedup": speedups}
        print(f"{cost_name}: SI k={k} chain {med['SI chain']:.3f} s ({counts['SI chain']:.2f} tokens / verification); "
              + "; ".join(f"{label[3:]} {med[label]:.3f} s ({counts[label]:.2f}): {speedups[label]:.3f}x"
                          for label in speedups), file=sys.stderr, flush=True)
    memo.session.close()
    result["drafter_rows"] = len(memo.rows)
    return result


def main() -> int:
    from dsi.cli.measure import PROMPT_SETS
    from dsi.models.vocab.bridge import bridge_drafter, shares_vocabulary
    from dsi.models.loading import load_pair

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per set")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="+", help="tokens per verification at these draft budgets "
                        "instead of wall time (SI, chain against the auto tree)")
    parser.add_argument("--trees", nargs="+", default=list(BUDGET_TREES), metavar="TREE",
                        help="with --budgets: the draft trees weighed against the chain (any --draft-tree value, "
                        "such as branches:0.05)")
    parser.add_argument("--sets", nargs="+", choices=("code", "prose"), default=["code", "prose"],
                        help="the prompt sets to record and run")
    parser.add_argument("--exact-si", action="store_true", help="SI's chain against its auto tree in wall time with "
                        "the real drafter's rows (memoised) instead of the replayed drafter")
    add_options(parser, "a tiny random GGUF pair, 1 prompt x 8 tokens of the code set, one repeat (--budgets: 4)")
    args = parse(parser)
    if shrink(args, tokens=8, prompts=1, repeats=1, sets=["code"], budgets=args.budgets and [4]):
        args.target, args.drafter = tiny_pair("llama.cpp")
    start = time.perf_counter()
    target, drafter = load_pair(args.target, args.drafter, backend="llama.cpp", progress=False)
    if not shares_vocabulary(target, drafter):  # another tokenizer: greedy string mode cannot branch, so the
        drafter = bridge_drafter(target, drafter, "intersection")  # token intersection (its law over target ids)
    recordings = {name: record(target, drafter, PROMPT_SETS[name][: args.prompts], args.tokens)
                  for name in args.sets}
    sets = {name: Recorded(recs) for name, recs in recordings.items()}
    if args.exact_si:
        results = []
        print("| cost model | prompts | SI k=5 chain: s (tokens / verification) | tree=auto | auto / chain "
              "| tree=branches | branches / chain | tree=best-first | best-first / chain |")
        print("|---|---|---|---|---|---|---|---|---|")
        for set_name, recs in recordings.items():
            got = si_walltime_exact(recs, target.vocab_size, drafter, args.repeats)
            for cost_name in COST_MODELS:
                g = got[cost_name]
                med, tpv = g["median_s"], g["tokens_per_verification"]
                results.append({"cost_model": cost_name, "prompts": set_name, **g})
                print(f"| {cost_name} | {set_name} | {med['SI chain']:.3f} ({tpv['SI chain']:.2f}) | "
                      + " | ".join(f"{med[label]:.3f} ({tpv[label]:.2f}) | {g['tree_speedup'][label]:.3f}"
                                   for label in ("SI tree=auto", "SI tree=branches", "SI tree=best-first")) + " |")
        emit({"benchmark": "tree_walltime_exact_si", "target": args.target, "drafter": args.drafter,
              "tokens": args.tokens, "prompts_per_set": args.prompts, "repeats": args.repeats,
              "results": results}, args.out)
        return 0
    if args.budgets:
        results = []
        print("| prompts | drafter top-1 agreement | B | chain: tokens / verification | "
              + " | ".join(f"{name} (nodes) | {name} / chain" for name in args.trees) + " |")
        print("|---|---|---|---|" + "---|---|" * len(args.trees))
        for set_name in args.sets:
            agreement = sets[set_name].agreement()
            for row in budgets_set(recordings[set_name], target.vocab_size, drafter, args.budgets, args.trees):
                results.append({"prompts": set_name, "drafter_agreement": float(agreement), **row})
                print(f"| {set_name} | {agreement:.2f} | {row['budget']} | {row['chain']:.2f} | "
                      + " | ".join(f"{row[name]:.2f} ({row[f'{name}_nodes_per_verification']:.1f}) | "
                                   f"{row[f'{name}_over_chain']:.3f}" for name in args.trees) + " |")
        emit({"benchmark": "tree_budgets", "target": args.target, "drafter": args.drafter,
              "tokens": args.tokens, "prompts_per_set": args.prompts, "trees": list(args.trees),
              "results": results}, args.out)
        return 0
    results = []
    for cost_name, cost in COST_MODELS.items():
        for set_name, recorded in sets.items():
            agreement = recorded.agreement()
            got = run_set(recorded, cost, args.repeats)
            results.append({"cost_model": cost_name, "cost": cost, "prompts": set_name,
                            "drafter_agreement": float(agreement), **got})
            med = got["median_s"]
            print(f"\n{cost_name}, {set_name} (drafter top-1 agreement {agreement:.2f}), median of {args.repeats}:")
            print("| configuration | wall s | vs non-SI | vs its chain | tokens / target forward | side wins "
                  "| drafter forwards |")
            print("|---|---|---|---|---|---|---|")
            chains = [label for label, method, *_, tree in CONFIGS if tree is None]
            fastest_chain = min(chains, key=med.get)
            for label, *_ in [*CONFIGS, (AUTO,)]:
                chain = label.split(" tree=")[0] if label != AUTO else fastest_chain
                if label.endswith("path by path"):
                    chain = label.split(",")[0]  # against the batched drafting of the same tree
                c = got["counts"][label]
                print(f"| {label} | {med[label]:.3f} | {med['non-SI'] / med[label]:.2f}x | "
                      f"{med[chain] / med[label]:.3f} | {c['tokens'] / max(c['forwards'], 1):.2f} | {c['side']} | "
                      f"{c.get('drafter_forwards', 0) // args.repeats} |")
            print(f"{AUTO} picked {got['auto']['picked']} (its 'vs its chain' is against the fastest chain, "
                  f"{fastest_chain}): {got['auto']['reason']}")
    print(f"\n{args.target} / {args.drafter} recordings (llama.cpp, greedy), {args.prompts} prompts x {args.tokens} "
          f"tokens per set; {time.perf_counter() - start:.0f} s in all", file=sys.stderr)
    emit({"benchmark": "tree_walltime", "target": args.target, "drafter": args.drafter, "tokens": args.tokens,
          "prompts_per_set": args.prompts, "repeats": args.repeats, "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
