"""A drafter of another tokenizer: non-SI, SI and DSI next to transformers' universal assisted generation.

The Qwen2.5-Coder-1.5B-Instruct target with the SmolLM2-135M-Instruct drafter (another model family,
its own 49152-token vocabulary), bridged by dsi.models.vocab.bridge (Timor et al., ICML 2025: string
level exact match for greedy requests, the token intersection for sampling; ``--vocab-mode``). Code
and prose prompts, chat-formatted; greedy and T = 0.7 (seeded), same prompts and lengths for every
method. Every method runs in this one process, one after another; each time is the median over
--repeats runs of a prompt, a row's total the sum over prompts of those medians. Every timed run
starts cold, as transformers' ``generate`` does: a decoder of its own with no KV cache, so each run
pays its prompt's prefill (``--keep-cache``: one decoder per configuration, as dsi.evaluate.compare has it).

Rows per temperature, in this order: non-SI, SI for each --si-k, (hf backend) transformers' universal
assisted generation (UAG), DSI for each --dsi-k x --dsi-sp (target servers as threads of this process).
UAG is ``target.generate(..., assistant_model=drafter, tokenizer=..., assistant_tokenizer=...)``
with its own assistant defaults (``num_assistant_tokens`` 20, constant schedule, confidence threshold
0.4), ``max_new_tokens = min_new_tokens = --tokens`` (dsi runs without EOS), ``do_sample=False`` for greedy, ``do_sample=True, temperature=T, top_k=0, top_p=1`` for sampling (the
law dsi samples). transformers picks the candidate generator itself: greedy,
AssistedCandidateGeneratorDifferentTokenizers (re-tokenizes text each round); sampling,
UniversalSpeculativeDecodingGenerator (a token-intersection translator that prunes the assistant's
LM head in place, so it is given a copy of the drafter). The class it used is recorded.

Per row: total seconds, tokens/s, speedup over non-SI, acceptance (accepted / (accepted + rejected)
drafts over all prompts: dsi's stats; for UAG, counted from the n_matches transformers hands its
candidate generator every round), the vocabulary intersection and the drafter's re-encodes (dsi's
stats), and for greedy rows whether the output is non-SI's: identical, "≈ near-tie" (it departs
only where the target's two best tokens are within the dtype's NEAR_TIE_MARGIN, as ``dsi demo``
reports; bf16 and llama.cpp), or differs (with the margin). Greedy SI and DSI rows also get
engine/ideal: the measured time over the event simulator's (dsi.sim.events) prediction from each
worker's latencies measured alone (target: prefill and forwards over k+1 tokens; the bridged
drafter: prefill, and its mean cost per proposed target token while continuing its own drafts) and
the exact greedy accept pattern of each prompt (dsi.models.emulated.replay.accept_pattern through the bridged
drafter). Sampling rows have no ideal (their accept pattern is a random variable).

    python benchmarks/cross_vocab.py --out results/cross_vocab.json                      # hf, fp32
    python benchmarks/cross_vocab.py --dtype bf16 --out results/cross_vocab_bf16.json
    python benchmarks/cross_vocab.py --backend llama.cpp --out results/cross_vocab_llama.json

The JSON (--out) is rewritten after every configuration, so a run cut short keeps what it measured.
A --deadline cuts DSI rows first. Exit status 1 if a greedy SI or DSI row departs from non-SI other
than at a near-tie. ``--dry-run``: a tiny random Llama target (tests/tiny_hf.py) and a tiny drafter over
another trained vocabulary (tests/tiny_vocab.py, "multilingual"), hf fp32, 2 prompts x 6 tokens, one repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import metadata

from _common import add_options, git_commit, machine, parse, scratch, shrink, write_json
from real_pair import divergences, ideal_seconds, median_of, near_tie_margin, worker_latencies

from dsi.errors import DraftUnavailable
from dsi.evaluate.compare import CODE_PROMPTS, MethodConfig, MethodRun, iter_compare, set_threads
from dsi.models.base import extend_rows
from dsi.models.vocab.bridge import VOCAB_MODES, bridge_drafter
from dsi.models.loading import load_pair
from dsi.models.emulated.replay import accept_pattern
from dsi.sampling import SamplingParams

PROSE_PROMPTS = (
    "Explain in simple terms how a hash table works and why lookups are fast on average.",
    "Write the opening paragraph of a short story about a lighthouse keeper who finds a message in a bottle.",
    "Summarise the main causes of the French Revolution in a few sentences.",
)


def prompt_texts(count: int) -> list[tuple[str, str]]:
    """``count`` (kind, text) user messages, code and prose alternating (code first)."""
    code = [("code", f"Complete this Python function:\n\n{stub}") for stub in CODE_PROMPTS]
    prose = [("prose", text) for text in PROSE_PROMPTS]
    mixed = [p for pair in zip(code, prose) for p in pair] + code[len(prose):]
    if not 1 <= count <= len(mixed):
        raise SystemExit(f"--prompts {count}: between 1 and {len(mixed)}")
    return mixed[:count]


def drafter_latencies(drafter, prompt, threads: int | None, steps: int = 16) -> dict:
    """``{"prefill": s, 1: s}`` of ``drafter`` (bridged or not) alone on ``threads``: the median of three
    fresh prefills over ``prompt`` (with the first proposal), and the mean seconds per proposed
    token over ``steps`` proposals, each taken as the next context (the drafter continuing its own
    drafts, as while they are accepted). A bridged drafter proposes a target token with zero, one
    or several drafter forwards: the mean is its cost per target token."""
    saved = getattr(drafter, "threads", None)
    set_threads(drafter, threads, None)
    try:
        prefills = []
        for _ in range(3):
            session = drafter.new_session()
            try:
                start = time.perf_counter()
                extend_rows(session, prompt, None, 1, greedy=True)
                prefills.append(time.perf_counter() - start)
            finally:
                session.close()
        session = drafter.new_session()
        try:
            token = int(extend_rows(session, prompt, None, 1, greedy=True)[-1])
            before = dict(getattr(session, "counters", {}))
            done, start = 0, time.perf_counter()
            for _ in range(steps):
                try:
                    token = int(extend_rows(session, [token], None, 1, greedy=True)[-1])
                except DraftUnavailable:  # the drafter's text ended: what was measured stands
                    break
                done += 1
            step = (time.perf_counter() - start) / max(done, 1)
            after = getattr(session, "counters", {})
        finally:
            session.close()
        out = {"prefill": statistics.median(prefills), 1: step, "steps": done}
        if "drafter_model_forwards" in after and done:
            out["drafter_forwards_per_step"] = (after["drafter_model_forwards"]
                                                - before.get("drafter_model_forwards", 0)) / done
        return out
    finally:
        set_threads(drafter, saved, None)


class UAGCounter:
    """Wraps the target's ``_get_candidate_generator`` while active: records the generator class
    transformers chose, its assistant settings, and every round's (candidates, n_matches) as
    transformers passes them to ``update_candidate_strategy``."""

    def __init__(self, model) -> None:
        self.model = model
        self.rounds: list[tuple[int, int]] = []
        self.generators: set[str] = set()
        self.settings: dict = {}

    def __enter__(self) -> UAGCounter:
        original = self.model._get_candidate_generator

        def wrapped(*args, **kwargs):
            generator = original(*args, **kwargs)
            self.generators.add(type(generator).__name__)
            config = getattr(generator, "assistant_generation_config", None)
            if config is not None:
                self.settings = {k: getattr(config, k, None) for k in (
                    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                    "assistant_lookbehind", "target_lookbehind")}
            update = generator.update_candidate_strategy

            def counted(input_ids, scores, num_matches):
                self.rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
                return update(input_ids, scores, num_matches)

            generator.update_candidate_strategy = counted
            return generator

        self.model._get_candidate_generator = wrapped
        return self

    def __exit__(self, *exc) -> None:
        del self.model._get_candidate_generator


@dataclass(frozen=True)
class UAGConfig:
    """A transformers UAG row: its assistant defaults, or ``num_assistant_tokens`` set to this."""

    num_assistant_tokens: int | None = None

    @property
    def label(self) -> str:
        return "transformers UAG" + ("" if self.num_assistant_tokens is None else f" n={self.num_assistant_tokens}")


def uag_row(target, assistant, assistant_tokenizer, prompts, tokens: int, repeats: int, threads: int,
            temperature: float, seed: int, progress=None) -> dict:
    """transformers' universal assisted generation over ``prompts``: per prompt the median wall time,
    the last run's tokens, and the acceptance transformers' rounds imply."""
    import torch

    torch.set_num_threads(threads)  # CPU only
    sample = temperature > 0
    options = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if sample
               else {"do_sample": False})
    walls, outputs, accepted, proposed, rejected = [], [], 0, 0, 0
    with UAGCounter(target.model) as counter:
        def generate(ids, new_tokens):
            x = torch.tensor([ids], device=target.device)
            if sample:
                torch.manual_seed(seed)
            with torch.inference_mode():
                return target.model.generate(
                    x, attention_mask=torch.ones_like(x), assistant_model=assistant, tokenizer=target.tokenizer,
                    assistant_tokenizer=assistant_tokenizer, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    repetition_penalty=1.0, **options)

        generate(prompts[0], min(tokens, 4))  # warm-up as dsi's (sampling: builds and caches the translator)
        for ids in prompts:
            runs = []
            for _ in range(repeats):
                counter.rounds.clear()
                start = time.perf_counter()
                out = generate(ids, tokens)
                runs.append(time.perf_counter() - start)
                if progress:
                    progress()
            walls.append(statistics.median(runs))
            outputs.append(out[0, len(ids):].tolist())
            for candidates, matches in counter.rounds:  # the last run's rounds
                proposed += candidates
                accepted += matches
                rejected += matches < candidates
    return {"walls": walls, "outputs": outputs, "accepted": accepted, "rejected": rejected, "proposed": proposed,
            "generators": sorted(counter.generators), "assistant_settings": counter.settings}


def versions(backend: str) -> dict:
    out = {}
    for dist in ("dsi", "torch", "transformers", "numpy") + (("llama_cpp_python",) if backend == "llama.cpp" else ()):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["dsi_git"] = git_commit()
    return out


def fmt_output(row: dict) -> str:
    if row.get("output") is None:
        return "—"
    if row["output"] in ("identical", "reference"):
        return row["output"]
    parts = [f"p{d['prompt']} tok {d.get('index')} margin "
             + (f"{d['margin']:.3g}" if d.get("margin") is not None else "n/a (length)") for d in row["divergence"]]
    return ("≈ near-tie" if row["output"] == "near-tie" else "DIFFERS") + f" ({'; '.join(parts)})"


def table(rows: list[dict]) -> str:
    head = ("| method | total s | tok/s | vs non-SI | accept | ∩ vocab | re-encodes | drafter fwd | output "
            "| ideal s | engine/ideal |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    cell = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['total_s']:.2f} | {r['tokens_per_s']:.2f} | {r['speedup_vs_nonsi']:.2f}x "
            f"| {cell(r.get('acceptance'), '.3f')} | {cell(r.get('vocab_intersection'), 'd')} "
            f"| {cell(r.get('drafter_reencodes'), 'd')} | {cell(r.get('drafter_model_forwards'), 'd')} "
            f"| {fmt_output(r)} | {cell(r.get('ideal_s'), '.2f')} | {cell(r.get('engine_over_ideal'), '.2f')} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="smollm2-135m-instruct",
                   help="a drafter of another vocabulary: short name, .gguf file or checkpoint directory")
    p.add_argument("--backend", default="hf", choices=["hf", "llama.cpp"],
                   help="hf (transformers, --dtype; with the UAG row) or llama.cpp (the GGUFs' own weights, CPU)")
    p.add_argument("--dtype", default="fp32", help="hf backend: fp32 (greedy identical) or bf16 (near-ties reported)")
    p.add_argument("--device", default="cpu", help="hf backend: device of both models")
    p.add_argument("--vocab-mode", default="auto", choices=VOCAB_MODES,
                   help="auto: string-level for greedy, token intersection for sampling")
    p.add_argument("--prompts", type=int, default=4, help="code and prose alternating (code first)")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per prompt (no EOS stop, every method)")
    p.add_argument("--repeats", type=int, default=3, help="runs per prompt and method; times are medians")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--seed", type=int, default=0, help="sampling seed (dsi's SamplingParams; torch.manual_seed for UAG)")
    p.add_argument("--si-k", type=int, nargs="*", default=[3, 5])
    p.add_argument("--dsi-k", nargs="*", default=["3", "auto"])
    p.add_argument("--dsi-sp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=2, help="threads of non-SI, SI and UAG (each runs alone)")
    p.add_argument("--dsi-threads", type=int, default=1, help="threads of the DSI drafter and of each target server")
    p.add_argument("--no-assisted", action="store_true", help="skip transformers' universal assisted generation")
    p.add_argument("--uag-tokens", type=int, nargs="*", default=[], metavar="N",
                   help="also UAG rows with the assistant's num_assistant_tokens set to N (default row: its own 20)")
    p.add_argument("--no-ideal", action="store_true", help="skip the latencies alone, accept patterns and ideal")
    p.add_argument("--keep-cache", action="store_true",
                   help="one decoder per configuration: repeats reuse the prompt's KV cache (UAG cannot); "
                        "default: every timed run starts cold and pays its prefill")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="start no new configuration after S seconds (the rest is reported as skipped)")
    p.add_argument("--merges", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="intersection mode: shared tokens per position whose merged tokens the law reaches "
                   "(dsi.models.vocab.merges; 0: plain TLI; auto, the default: by the drafter's row price)")
    add_options(p, "a tiny target and a tiny drafter of another vocabulary, hf fp32, 2 prompts x 6 tokens")
    args = parse(p)
    if shrink(args, backend="hf", dtype="fp32", prompts=2, tokens=6, repeats=1, si_k=[2], dsi_k=["2", "auto"],
              dsi_sp=[1]):
        from tests.tiny_hf import make_model_dir
        from tests.tiny_vocab import save_model_dir

        folder = scratch()
        args.target = str(make_model_dir(folder / "target", seed=0))
        args.drafter = str(save_model_dir("multilingual", folder / "drafter", seed=1))
    began = time.perf_counter()
    dsi_ks = [k if k == "auto" else int(k) for k in args.dsi_k]
    llama = args.backend == "llama.cpp"
    if llama:
        args.dtype, args.no_assisted = None, True

    import torch

    target, drafter = load_pair(args.target, args.drafter, backend=args.backend, dtype=args.dtype,
                                device=None if llama else args.device, vocab_mode=args.vocab_mode, progress=True)
    load_s = time.perf_counter() - began
    texts = prompt_texts(args.prompts)
    prompts = [target.encode(text, chat=True) for _, text in texts]
    tie = near_tie_margin(args.backend, args.dtype)
    bridged = bridge_drafter(target, drafter, args.vocab_mode, merges=args.merges)  # what the decoders run
    # the decoders get this very drafter (build_decoder passes a bridged drafter through), so that a decoder
    # per run does not rebuild the vocabulary intersection (~1.5 s)
    intersection = getattr(getattr(bridged, "intersection", None), "size", None)
    print(f"{args.target} / {args.drafter} ({args.backend}{'' if llama else ', ' + args.dtype}): vocabularies "
          f"{target.vocab_size} / {drafter.vocab_size}, {bridged!r}; loaded in {load_s:.0f} s", file=sys.stderr)

    configs = [MethodConfig("ar", threads=args.threads)]
    configs += [MethodConfig("si", k, threads=args.threads) for k in args.si_k]
    configs += [MethodConfig("dsi", k, sp, threads=args.dsi_threads) for sp in args.dsi_sp for k in dsi_ks]

    report: dict = {
        "machine": {**machine(), "torch_threads_default": torch.get_num_threads(), "versions": versions(args.backend)},
        "config": {**vars(args), "dsi_k": dsi_ks, "load_s": load_s, "near_tie_margin": tie,
                   "threads_note": f"non-SI, SI, UAG: {args.threads} threads; DSI: drafter and each target server "
                                   f"{args.dsi_threads} thread(s)"},
        "pair": {"target": args.target, "drafter": args.drafter, "target_vocab": target.vocab_size,
                 "drafter_vocab": drafter.vocab_size, "bridged": repr(bridged), "vocab_intersection": intersection},
        "prompts": [{"kind": kind, "text": text, "prompt_tokens": len(ids)} for (kind, text), ids in zip(texts, prompts,
                                                                                                         strict=True)],
        "rows": [], "skipped": [], "notes": [],
    }

    def write() -> None:
        write_json(args.out, report)

    latencies: dict = {}
    if not args.no_ideal:
        sizes = sorted({k + 1 for k in args.si_k} | {k + 1 for k in dsi_ks if k != "auto"} | {1})
        for threads in sorted({args.threads, args.dsi_threads}):
            latencies[threads] = {"drafter": drafter_latencies(bridged, prompts[0], threads),
                                  "target": worker_latencies(target, prompts[0], threads, sizes, repeats=3)}
            lat = latencies[threads]
            cells = ", ".join(f"n={n} {v * 1e3:.1f} ms" for n, v in lat["target"].items() if n != "prefill")
            print(f"alone, {threads} thread(s): drafter {lat['drafter'][1] * 1e3:.1f} ms per proposed target token "
                  f"({lat['drafter'].get('drafter_forwards_per_step', 1):.2f} drafter forwards), prefill "
                  f"{lat['drafter']['prefill'] * 1e3:.0f} ms; target {cells}, prefill "
                  f"{lat['target']['prefill'] * 1e3:.0f} ms", file=sys.stderr)
        report["latencies_s"] = {str(t): {w: {str(n): v for n, v in d.items()} for w, d in lat.items()}
                                 for t, lat in latencies.items()}
        write()

    # per temperature: non-SI, SI, transformers' UAG, then DSI (a deadline cuts the DSI rows first)
    plan: list[tuple[float, list]] = []  # (temperature, [MethodConfig or "uag", ...])
    for t in args.temperatures:
        ok = [c for c in configs if not (t > 0 and args.vocab_mode == "string" and c.method != "ar")]
        if len(ok) < len(configs):
            report["notes"].append(f"T={t}: vocab_mode='string' is exact for greedy only; SI/DSI rows skipped")
        order = [c for c in ok if c.method != "dsi"]
        if not args.no_assisted:
            order += [UAGConfig()] + [UAGConfig(n) for n in args.uag_tokens]
        plan.append((t, order + [c for c in ok if c.method == "dsi"]))
    total_runs, done = args.repeats * len(prompts) * sum(len(group) for _, group in plan), 0

    def tick():
        nonlocal done
        done += 1
        print(f"\r{done}/{total_runs} runs, {time.perf_counter() - began:.0f} s", end="", file=sys.stderr, flush=True)

    reference: dict[float, list[list[int]]] = {}  # non-SI's tokens per temperature
    patterns = None
    assistant_copy = None

    def finish(row: dict, outputs: list[list[int]]) -> None:
        t = row["temperature"]
        n = sum(len(o) for o in outputs)
        row["new_tokens"] = n
        row["tokens_per_s"] = n / row["total_s"]
        base = next((r for r in report["rows"] if r["temperature"] == t and r["method"] == "ar"), row)
        row["speedup_vs_nonsi"] = base["total_s"] / row["total_s"]
        row["outputs"] = [list(map(int, o)) for o in outputs]  # per prompt, the last run's tokens
        if row["method"] == "ar" or t > 0:
            row["texts"] = [target.decode(o) for o in outputs]
        if row["method"] == "ar":
            row["output"] = "reference"
        elif t == 0:
            if all(list(o) == list(r) for o, r in zip(outputs, reference[t], strict=True)):
                row["output"] = "identical"
            else:  # where, and how close the target's two best tokens were there
                row.update(divergences(target, prompts, reference[t], outputs, tie))
                row["output"] = "near-tie" if row["near_tie"] else "differs"
        else:  # sampled: equal outputs are not expected (losslessness is the tests' job)
            row["output"] = None
            row["same_as_nonsi"] = sum(list(o) == list(r) for o, r in zip(outputs, reference[t], strict=True))
        report["rows"].append(row)
        write()

    def dsi_row(temperature: float, config: MethodConfig, runs: list[MethodRun]) -> dict:
        nonlocal patterns
        stats = [r.stats for r in runs]
        accepted = sum(s.get("accepted_tokens", 0) for s in stats)
        rejected = sum(s.get("rejections", 0) for s in stats)
        row = {
            "temperature": temperature, "label": config.label, "method": config.method,
            "lookahead": config.lookahead, "servers": config.servers, "threads": config.threads,
            "total_s": sum(r.median_s for r in runs), "per_prompt_s": [r.median_s for r in runs],
            "acceptance": accepted / (accepted + rejected) if accepted + rejected else None,
            "accepted": accepted, "rejected": rejected, "drafted": sum(s.get("drafted_tokens", 0) for s in stats),
            "vocab_mode": next((s["vocab_mode"] for s in stats if "vocab_mode" in s), None),
            "vocab_intersection": next((s["vocab_intersection"] for s in stats if "vocab_intersection" in s), None),
            "mean_window": median_of(runs, "mean_window"),
            "target_forward_in_run_s": median_of(runs, "mean_target_forward_s"),
            "drafter_forward_in_run_s": median_of(runs, "mean_drafter_forward_s"),
            "preempted_tasks": sum(s.get("preempted_tasks", 0) for s in stats),
        }
        for key in ("drafter_reencodes", "drafter_model_forwards", "drafter_rolled_back_tokens"):
            row[key] = sum(s.get(key, 0) for s in stats) if any(key in s for s in stats) else None
        if config.method == "ar":
            row["acceptance"] = None
            reference[temperature] = [r.tokens for r in runs]
            if temperature == 0 and not args.no_ideal:  # the greedy accept pattern of each prompt
                start = time.perf_counter()
                patterns = [accept_pattern(bridged, ids, r.tokens) for ids, r in zip(prompts, runs, strict=True)]
                report["accept_patterns"] = {
                    "acceptance": sum(map(sum, patterns)) / max(sum(map(len, patterns)), 1),
                    "per_prompt": ["".join("1" if m else "0" for m in pat) for pat in patterns],
                    "measured_s": time.perf_counter() - start}
        elif temperature == 0 and patterns is not None and latencies:
            lat = latencies[config.threads]
            row["ideal_s"] = ideal_seconds(config.method, config.lookahead, config.servers, lat["drafter"],
                                           lat["target"], patterns, row["mean_window"] or 1.0)
            row["engine_over_ideal"] = row["total_s"] / row["ideal_s"]
        return row

    def run_uag(temperature: float, uag: UAGConfig) -> None:
        nonlocal assistant_copy
        assistant = drafter.model
        if temperature > 0:  # USD prunes its assistant's LM head in place: a second copy keeps dsi's drafter whole
            if assistant_copy is None:
                from dsi.models.loading import load_model

                assistant_copy = load_model(args.drafter, backend="hf", dtype=args.dtype, device=args.device,
                                            progress=False).model
            assistant = assistant_copy
        saved = assistant.generation_config.num_assistant_tokens
        assistant.generation_config.num_assistant_tokens = uag.num_assistant_tokens  # None: transformers' default
        try:
            got = uag_row(target, assistant, drafter.tokenizer, prompts, args.tokens, args.repeats, args.threads,
                          temperature, args.seed, progress=tick)
        finally:
            assistant.generation_config.num_assistant_tokens = saved
        decided = got["accepted"] + got["rejected"]
        finish({"temperature": temperature, "label": uag.label, "method": "uag", "threads": args.threads,
                "total_s": sum(got["walls"]), "per_prompt_s": got["walls"],
                "acceptance": got["accepted"] / decided if decided else None,
                "accepted": got["accepted"], "rejected": got["rejected"], "proposed": got["proposed"],
                "candidate_generator": ", ".join(got["generators"]), "assistant_settings": got["assistant_settings"],
                "vocab_intersection": None, "drafter_reencodes": None, "drafter_model_forwards": None},
               got["outputs"])

    def past_deadline() -> bool:
        return args.deadline is not None and time.perf_counter() - began > args.deadline

    try:
        for plan_index, (t, group) in enumerate(plan):
            sampling = SamplingParams(temperature=t, seed=args.seed)
            i = 0
            while i < len(group):
                if i and past_deadline():
                    break
                if isinstance(group[i], UAGConfig):
                    run_uag(t, group[i])
                    i += 1
                    continue
                batch = []  # consecutive dsi configs: one runner, decoders shared across lookaheads
                while i + len(batch) < len(group) and isinstance(group[i + len(batch)], MethodConfig):
                    batch.append(group[i + len(batch)])
                runner = iter_compare(target, bridged, prompts, batch, max_new_tokens=args.tokens,
                                      repeats=args.repeats, sampling=sampling, cold=not args.keep_cache,
                                      progress=tick)
                try:
                    for config, runs in runner:
                        finish(dsi_row(t, config, runs), [r.tokens for r in runs])
                        i += 1
                        if i < len(group) and past_deadline():
                            break
                finally:
                    runner.close()
            if i < len(group) or (plan_index + 1 < len(plan) and past_deadline()):
                report["skipped"] += [f"T={t} {c.label}" for c in group[i:]]
                report["skipped"] += [f"T={tt} {c.label}" for tt, g in plan[plan_index + 1:]
                                      for c in g]
                print(f"\ndeadline of {args.deadline:.0f} s reached", file=sys.stderr)
                break
    finally:
        print(file=sys.stderr)
        report["wall_s"] = time.perf_counter() - began
        write()

    # the report
    print(f"## {args.target} + {args.drafter} (drafter of another vocabulary), backend {args.backend}"
          + ("" if llama else f", {args.dtype}, {args.device}"))
    print(f"{len(prompts)} chat prompts ({', '.join(k for k, _ in texts)}) x {args.tokens} new tokens, median of "
          f"{args.repeats}; {report['config']['threads_note']}; vocabularies {target.vocab_size} / "
          f"{drafter.vocab_size}, {intersection} shared tokens; machine: {report['machine']['cpu']}, "
          f"{report['machine']['cpus']} CPUs; torch {report['machine']['versions']['torch']}, transformers "
          f"{report['machine']['versions']['transformers']}, dsi {report['machine']['versions']['dsi']} "
          f"({report['machine']['versions']['dsi_git']})")
    print("accept: accepted / (accepted + rejected) drafts over all prompts (UAG: from the n_matches transformers "
          "reports each round); ∩ vocab: tokens both vocabularies spell alike; re-encodes, drafter fwd: the "
          "drafter's text re-tokenized after a departure, its model forwards (sums over prompts, last run); output: "
          "greedy rows vs non-SI; ideal: event simulator from latencies alone + greedy accept pattern (greedy SI/DSI)")
    if "accept_patterns" in report:
        print(f"greedy accept pattern (bridged drafter along non-SI's output): acceptance "
              f"{report['accept_patterns']['acceptance']:.3f}")
    summary = {}
    for t in args.temperatures:
        rows = [r for r in report["rows"] if r["temperature"] == t]
        if not rows:
            continue
        print(f"\n### {'greedy' if t == 0 else f'T = {t} (seed {args.seed})'}\n")
        print(table(rows))
        best = {m: min((r for r in rows if r["method"] == m), key=lambda r: r["total_s"], default=None)
                for m in ("si", "dsi", "uag")}
        uag = best["uag"]  # the fastest UAG row
        for r in rows:
            if r["method"] == "uag":
                print(f"\n{r['label']}: transformers {report['machine']['versions']['transformers']} "
                      f"{r['candidate_generator']}, assistant settings {r['assistant_settings']}", end="")
        print()
        summary[str(t)] = {
            "uag": uag and uag["label"],
            "best_si": best["si"] and best["si"]["label"], "best_dsi": best["dsi"] and best["dsi"]["label"],
            "best_si_vs_uag": uag["total_s"] / best["si"]["total_s"] if uag and best["si"] else None,
            "best_dsi_vs_uag": uag["total_s"] / best["dsi"]["total_s"] if uag and best["dsi"] else None,
            "best_dsi_vs_best_si": best["si"]["total_s"] / best["dsi"]["total_s"] if best["si"] and best["dsi"]
            else None,
        }
        if uag and best["si"]:
            print(f"best SI ({best['si']['label']}): {summary[str(t)]['best_si_vs_uag']:.2f}x the speed of "
                  f"{uag['label']}" + (f" (output {best['si']['output']})" if t == 0 else ""))
        if uag and best["dsi"]:
            print(f"best DSI ({best['dsi']['label']}): {summary[str(t)]['best_dsi_vs_uag']:.2f}x the speed of "
                  f"{uag['label']}, "
                  f"{summary[str(t)]['best_dsi_vs_best_si']:.2f}x best SI's")
    if report["skipped"]:
        print(f"\nskipped (deadline): {', '.join(report['skipped'])}")
    for note in report["notes"]:
        print(f"note: {note}")
    if any(r.get("output") == "near-tie" for r in report["rows"]):
        print(f"≈: greedy output departs from non-SI only where the target's two best tokens are within {tie} "
              "logits: a batched verification forward rounds differently from a one-token forward "
              + ("(use --dtype fp32 for exact equality)." if not llama else "(quantized llama.cpp kernels)."))
    report["summary"] = summary
    write()
    print(json.dumps({"summary": summary, "rows": [{k: r.get(k) for k in ("temperature", "label", "total_s", "output")}
                                                   for r in report["rows"]]}))
    bad = [f"T={r['temperature']} {r['label']}" for r in report["rows"]
           if r["method"] in ("si", "dsi") and r.get("output") == "differs"]
    if bad:
        print(f"greedy output differs from non-SI beyond a near-tie: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
