"""``method="auto"``: the fastest lossless method for this pair, on this hardware, with this placement.

The candidates are non-SI, SI with k = 1..10, and DSI with SP = 1..``max_servers`` target servers
and k = 1..10 or event-driven windows; each SI and DSI candidate also with its windows spent as draft
trees (:mod:`dsi.trees`: SI and DSI ``"2"`` and ``"auto"``) where the drafter can branch.
Which wins depends on the pair, the engine and above all on where the workers run: on a shared CPU
DSI's drafter and servers slow each other down, on separate devices they do not. So the choice is
made from measurements taken where the workers will run, *while they run as each method would run
them*:

1. **Calibration runs** on one prompt (``tokens`` new tokens, greedy, after a short warm-up):
   non-SI; SI with k = 4; and DSI with event-driven windows for each SP considered, on the real
   transport and placement. The engine's telemetry gives, per run, the mean target forward and
   drafter step *as they ran*: for DSI, next to each other (contention for cores, memory
   bandwidth, a GIL or a GPU shows up as slower forwards).
2. **The accept pattern** of the pair on that prompt: the drafter's greedy guess at every prefix of
   non-SI's output (one drafter forward), i.e. exactly which drafts the target accepts (none past
   the drafter's declared context: :func:`dsi.models.emulated.replay.accept_pattern`). If it accepts
   nothing, non-SI is the choice without further runs: speculation then waits a whole target
   forward per token as non-SI does, and could only add work. From the same forward's rankings,
   the **rescue pattern** of each tree shape (:func:`dsi.engine.trees.tree_patterns`): where a
   rejected draft's correction is one of that position's side children, and how many side children
   each position gets.
3. **Prediction**: the event simulator (:mod:`dsi.sim.events`) replays that pattern for every
   candidate with the latencies of the calibration run of its own placement; a verification over
   n tokens costs the one-token forward plus n - 1 times a per-token slope measured from SI's
   verifications (flat on a GPU, steep on a CPU), a tree window's n counting its side children.
   Each method's prediction is then scaled by its calibration run's measured / simulated time,
   which carries the engine's own overheads (a tree candidate takes its chain's scale).
4. **Check**: if the best candidate is not one that was run, it is run once (twice at most, if the
   next best is not run either) and kept only if it beats the calibration runs. A faster run must
   win by ``margin`` (3%) to displace a simpler one (non-SI before SI before DSI, a chain before a
   tree): of the runs within the margin of the fastest, the simplest is picked (the faster of equally
   simple ones), as the measurements are noisy.

Trees are weighed on greedy calibration, as everything here is: a sampled request's side children
win less often than greedy ones (docs/results.md#why-a-sampled-side-child-rescues-less-than-a-greedy-one), so a
tree picked for greedy decoding may gain less when sampling; it never changes the output (:mod:`dsi.trees`).

The choice, with its evidence (latencies, acceptance, measured and predicted seconds of every
candidate), is cached as JSON under ``<cache dir>/autotune/`` per (pair, dtypes, devices, threads,
transport, SP bound, machine) and reused until ``refresh=True`` (``--retune``). The calibration
costs a few short generations: about 20 s for the embedded pair on a 2-core CPU, paid once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dsi.engine.api import build_decoder, make_request
from dsi.errors import ConfigError
from dsi.models.emulated.replay import accept_pattern
from dsi.sampling import SamplingParams
from dsi.sim.events import SI_TREES  # the shapes the event simulator times for SI (weighed below)

log = logging.getLogger(__name__)

CACHE_VERSION = 4  # 2: trees are candidates; 3: SI's "auto" tree is one; 4: "auto" trees priced by the row cost
LOOKAHEADS = tuple(range(1, 11))
SI_CALIBRATION_K = 4
DSI_TREES = ("2", "auto")  # DSI branches position by position (dsi.trees: Widths.sides, Dynamic.sides)
MAX_CHECKS = 2  # predicted-only candidates run to check them, at most
_SIMPLER = {"ar": 0, "si": 1, "dsi": 2}


@dataclass(frozen=True)
class Candidate:
    method: str  # "ar" | "si" | "dsi"
    lookahead: int | str | None  # k, "auto", or None for non-SI
    servers: int
    predicted_s: float  # for the calibration tokens
    measured_s: float | None = None  # when this exact configuration was run
    draft_tree: str | None = None  # the windows as draft trees of this shape (dsi.trees); None: chains

    @property
    def label(self) -> str:
        from dsi.evaluate.compare import method_label

        tree = f" tree={self.draft_tree}" if self.draft_tree is not None else ""
        return method_label(self.method, self.lookahead, self.servers) + tree

    @property
    def seconds(self) -> float:
        return self.measured_s if self.measured_s is not None else self.predicted_s

    @property
    def family(self) -> tuple:
        """Candidates of one family differ only in their lookahead: the ranking keeps each family's best."""
        return self.method, self.servers, self.draft_tree

    @property
    def kind(self) -> tuple:
        """Candidates whose predictions share one model of cost: the method on that many servers, with
        chains or with trees (a check run of one rescales the predictions of its kind)."""
        return self.method, self.servers, self.draft_tree is not None

    @property
    def simplicity(self) -> tuple[int, int]:
        """Lower is simpler: non-SI, SI, DSI; a chain before a tree. (Not fewer target servers: DSI with more
        is never slower in theory, and the calibration shows where they contend.)"""
        return _SIMPLER[self.method], int(self.draft_tree is not None)


@dataclass(frozen=True)
class AutoChoice:
    """What ``method="auto"`` picked and why."""

    method: str
    lookahead: int | str
    num_target_servers: int
    reason: str
    candidates: tuple[Candidate, ...]  # the pick, then the best of each (method, SP, tree), fastest first
    measured: dict  # per calibration run: wall seconds and forward latencies as they ran
    acceptance: float  # of the calibration pattern
    tokens: int
    key: str
    created: str
    cached: bool = False
    cache_file: str | None = None
    calibration_s: float = 0.0  # what measuring cost (0 when read from the cache)
    extra: dict = field(default_factory=dict)
    draft_tree: str | None = None  # the picked windows' tree shape (dsi.trees); None: chains

    @property
    def label(self) -> str:
        return Candidate(self.method, None if self.method == "ar" else self.lookahead, self.num_target_servers,
                         0.0, draft_tree=self.draft_tree).label

    def to_dict(self) -> dict:
        data = asdict(self)
        data["label"] = self.label
        data["candidates"] = [{**asdict(c), "label": c.label} for c in self.candidates]
        return data

    def reason_lines(self) -> list[str]:
        """The reason as short lines, one clause each (``reason`` joins them with "; ")."""
        return self.reason.split("; ")

    def summary(self) -> dict:
        """The short form shown in stats: the pick, the reason and each family's best."""
        return {"picked": self.label, "reason": self.reason, "cached": self.cached,
                "draft_tree": self.draft_tree or "off",
                "candidates": {c.label: round(c.seconds, 4) for c in self.candidates[:6]}}

    @classmethod
    def from_dict(cls, data: dict) -> AutoChoice:
        data = dict(data)
        data.pop("label", None)
        data["candidates"] = tuple(Candidate(**{k: v for k, v in c.items() if k != "label"})
                                   for c in data["candidates"])
        return cls(**data)


# ---- identity and cache ----------------------------------------------------------------------------
def model_identity(model: object) -> str:
    """What distinguishes a model for the cache: its repr plus where and how it runs."""
    parts = [repr(model)]
    for attr in ("source_dir", "source_path", "threads", "dtype", "device", "deterministic"):
        value = getattr(model, attr, None)
        if value is not None:
            parts.append(f"{attr}={value}")
    return " ".join(parts)


def tuning_key(target, drafter, transport: str, transport_options: dict | None, max_servers: int,
               prompt: Sequence[int] | None = None, tokens: int = 32, trees: bool = True) -> str:
    options = {k: v for k, v in (transport_options or {}).items() if k not in ("recipe",)}
    identity = {
        "target": model_identity(target), "drafter": model_identity(drafter), "transport": transport,
        "options": repr(sorted(options.items())), "max_servers": max_servers,
        "calibration": [list(prompt) if prompt is not None else None, tokens], "trees": trees,
        "machine": [platform.node(), platform.machine(), os.cpu_count()], "version": CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    """``$DSI_AUTOTUNE_DIR``, else ``autotune/`` in the dsi cache (:func:`dsi.models.cache.cache_dir`)."""
    if os.environ.get("DSI_AUTOTUNE_DIR"):
        return Path(os.environ["DSI_AUTOTUNE_DIR"]).expanduser()
    from dsi.models.cache import cache_dir

    return cache_dir() / "autotune"


# ---- measurement -------------------------------------------------------------------------------------
def _run(decoder, prompt: Sequence[int], tokens: int, vocab: int) -> tuple[float, dict, list[int]]:
    greedy = SamplingParams()
    decoder.generate(make_request(prompt, min(4, tokens), greedy, None, vocab))  # warm-up
    out = decoder.generate(make_request(prompt, tokens, greedy, None, vocab))
    return out.stats.wall_time_s, out.stats.to_dict(), list(out.tokens)


def _latencies(stats: dict) -> dict:
    return {"target_forward_s": stats.get("mean_target_forward_s") or 0.0,
            "drafter_step_s": stats.get("mean_drafter_forward_s") or 0.0,
            "mean_window": stats.get("mean_window") or 0.0}


def _server_counts(max_servers: int) -> list[int]:
    counts, n = [], 1
    while n < max_servers:
        counts.append(n)
        n *= 2
    return counts + [max_servers]


def choose_method(
    target,
    drafter,
    *,
    transport: str = "threads",
    transport_options: dict | None = None,
    max_servers: int = 1,
    prompt: Sequence[int] | None = None,
    tokens: int = 32,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
    margin: float = 0.03,
    progress: Callable[[str], None] | None = None,
    trees: bool = True,
) -> AutoChoice:
    """Measure, predict and pick (see the module docstring); cached unless ``refresh``. ``trees=False``
    weighs chains only."""
    if drafter is None:
        raise ConfigError("method='auto' needs a drafter (it compares non-SI with SI and DSI)")
    if not isinstance(max_servers, int) or isinstance(max_servers, bool) or max_servers < 1:
        raise ConfigError(f"max_servers={max_servers!r} must be an integer >= 1")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 8:
        raise ConfigError(f"tokens={tokens!r} must be an integer >= 8 (calibration tokens)")
    if not isinstance(trees, bool):
        raise ConfigError(f"trees={trees!r} must be True (weigh draft trees too) or False (chains only)")
    key = tuning_key(target, drafter, transport, transport_options, max_servers, prompt, tokens, trees)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"{key}.json"
    say = progress or (lambda message: None)
    if not refresh and path.is_file():
        try:
            choice = replace(AutoChoice.from_dict(json.loads(path.read_text(encoding="utf-8"))),
                             cached=True, cache_file=str(path), calibration_s=0.0)
            say(f"picked {choice.reason} (measured {choice.created}, cached in {path}; --retune measures again)")
            return choice
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring unreadable autotune cache %s: %s", path, exc)
    choice = _measure_and_choose(target, drafter, transport, dict(transport_options or {}), max_servers,
                                 list(prompt) if prompt is not None else _default_prompt(target), tokens,
                                 margin, progress, key, trees)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(choice.to_dict(), indent=2), encoding="utf-8")
        tmp.replace(path)
        choice = replace(choice, cache_file=str(path))
    except OSError as exc:
        log.warning("could not cache the autotune choice in %s: %s", path, exc)
    say(f"picked {choice.reason} (measured in {choice.calibration_s:.1f} s)")
    return choice


def _default_prompt(target) -> list[int]:
    if getattr(target, "tokenizer", None) is not None:
        from dsi.evaluate.compare import CODE_PROMPTS

        return list(target.encode(CODE_PROMPTS[0]))
    return [1, 2, 3, 4]


def _measure_and_choose(target, drafter, transport, options, max_servers, prompt, tokens, margin, progress,
                        key, weigh_trees=True) -> AutoChoice:
    from dsi.sim.events import simulate

    began = time.perf_counter()
    vocab = target.vocab_size
    say = progress or (lambda message: None)
    measured: dict[str, dict] = {}

    def calibrate(label: str, **config) -> list[int]:
        say(f"measuring {label}")
        threads = worker_threads(target, drafter, config["method"], config.get("num_target_servers", 1),
                                 transport)
        with threads_set(threads, target, drafter):
            decoder = build_decoder(target=target, drafter=drafter, transport=transport,
                                    transport_options=options if config["method"] == "dsi" else None, **config)
            try:
                wall, stats, out = _run(decoder, prompt, tokens, vocab)
            finally:
                decoder.close()
        measured[label] = {"wall_s": wall, **_latencies(stats), "config": config, "threads": threads}
        return out

    reference = calibrate("non-SI", method="ar")
    pattern, trees = _patterns(drafter, prompt, reference, weigh_trees, target, transport, options)  # False past the drafter's context
    acceptance = sum(pattern) / len(pattern)
    non_si = measured["non-SI"]["wall_s"]
    if not any(pattern):  # no draft accepted: SI and DSI wait a whole target forward per token too
        return AutoChoice(
            method="ar", lookahead=1, num_target_servers=1,
            reason=(f"non-SI: {non_si:.3f} s for {tokens} tokens; the drafter's guess was never the target's "
                    f"token on the calibration prompt (0 of {len(pattern)}), so SI and DSI could only add work"),
            candidates=(Candidate("ar", None, 1, non_si, non_si),), measured=measured, acceptance=0.0,
            tokens=tokens, key=key, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
            calibration_s=time.perf_counter() - began,
        )
    calibrate(f"SI k={SI_CALIBRATION_K}", method="si", lookahead=SI_CALIBRATION_K)
    server_counts = _server_counts(max_servers)
    for sp in server_counts:
        calibrate(f"DSI auto SP={sp}", method="dsi", lookahead="auto", num_target_servers=sp)

    # a verification over n tokens: the one-token forward plus (n - 1) x a slope from SI's verifications
    t1 = measured["non-SI"]["target_forward_s"] or measured["non-SI"]["wall_s"] / tokens
    si = measured[f"SI k={SI_CALIBRATION_K}"]
    slope = max(0.0, (si["target_forward_s"] - t1) / SI_CALIBRATION_K) if si["target_forward_s"] else 0.0

    def simulated(method: str, lookahead, servers: int, one_token_s: float, drafter_s: float, rows: float,
                  tree: str | None = None) -> float:
        """The event simulator's time on the calibration pattern (with ``tree``: that shape's rescues); a
        forward costs what one over ``rows`` tokens costs on this placement (its one-token time plus the
        slope per extra row)."""
        tpot = one_token_s + (rows - 1) * slope
        result = simulate(method, target_tpot=tpot, drafter_tpot=max(drafter_s, 1e-9), lookahead=lookahead,
                          num_servers=servers, matches=pattern,
                          rescues=None if tree is None else list(trees[method][tree].rescues),
                          si_tree=tree if method == "si" and tree is not None else "2")
        return float(result.mean)

    candidates: list[Candidate] = [Candidate("ar", None, 1, non_si, non_si)]
    # SI: each prediction scaled by the calibration run's measured / simulated time; a tree "2" of k nodes
    # verifies k rows as the chain does, the tree "auto" its k drafts and their side children
    si_d = si["drafter_step_s"] or t1
    si_fit = si["wall_s"] / simulated("si", SI_CALIBRATION_K, 1, t1, si_d, SI_CALIBRATION_K + 1)
    for k in LOOKAHEADS:
        candidates.append(Candidate("si", k, 1, si_fit * simulated("si", k, 1, t1, si_d, k + 1),
                                    si["wall_s"] if k == SI_CALIBRATION_K else None))
        for tree in (t for t in SI_TREES if t in trees.get("si", {}) and (k >= 2 or t == "auto")):
            rows = k * (1.0 + trees["si"][tree].mean_sides) + 1 if tree == "auto" else k + 1
            candidates.append(Candidate("si", k, 1, si_fit * simulated("si", k, 1, t1, si_d, rows, tree),
                                        draft_tree=tree))
    # DSI: this placement's forwards as they ran next to each other; a tree window's rows: its drafts and
    # their side children
    for sp in server_counts:
        run = measured[f"DSI auto SP={sp}"]
        window = max(1.0, run["mean_window"] or 1.0)
        one_token = max(run["target_forward_s"] - (window - 1) * slope, 0.5 * t1) if run["target_forward_s"] else t1
        d_sp = run["drafter_step_s"] or si_d
        fit = run["wall_s"] / simulated("dsi", "auto", sp, one_token, d_sp, window + 1)
        candidates.append(Candidate("dsi", "auto", sp, run["wall_s"], run["wall_s"]))
        for k in LOOKAHEADS:
            candidates.append(Candidate("dsi", k, sp, fit * simulated("dsi", k, sp, one_token, d_sp, k + 1)))
        for tree in (t for t in DSI_TREES if t in trees.get("dsi", {})):
            grow = 1.0 + trees["dsi"][tree].mean_sides
            candidates.append(Candidate("dsi", "auto", sp, fit * simulated("dsi", "auto", sp, one_token, d_sp,
                                                                           window * grow + 1, tree), draft_tree=tree))
            for k in LOOKAHEADS:
                candidates.append(Candidate("dsi", k, sp, fit * simulated("dsi", k, sp, one_token, d_sp,
                                                                          k * grow + 1, tree), draft_tree=tree))

    def ranking() -> list[Candidate]:
        best_of: dict[tuple, Candidate] = {}
        for c in candidates:
            if c.family not in best_of or c.seconds < best_of[c.family].seconds:
                best_of[c.family] = c
        return sorted(best_of.values(), key=lambda c: c.seconds)

    ranked = ranking()
    for _ in range(MAX_CHECKS):  # predicted only: run it, keep it only if it really wins
        top = ranked[0]
        if top.measured_s is not None:
            break
        label = top.label
        calibrate(label, method=top.method, lookahead=top.lookahead, num_target_servers=top.servers,
                  **({"draft_tree": top.draft_tree} if top.draft_tree is not None else {}))
        wall = measured[label]["wall_s"]
        # the check calibrates its kind (the method on that many servers, with chains or with trees): its
        # other predictions are off by as much
        scale = wall / top.predicted_s if top.predicted_s > 0 else 1.0
        candidates = [replace(c, measured_s=wall) if c is top else
                      replace(c, predicted_s=c.predicted_s * scale) if c.kind == top.kind and c.measured_s is None
                      else c for c in candidates]
        ranked = ranking()
    pick = pick_run(candidates, margin)
    ranked = [c for c in ranked if c.family != pick.family]
    # the runner-up: a run, or a prediction no faster than the pick (one the checks did not get to is no rival)
    rivals = [c for c in ranked if c.measured_s is not None or c.seconds >= pick.seconds]
    runner_up = rivals[0] if rivals else None
    reason = f"{pick.label}: {pick.seconds:.3f} s for {tokens} tokens"
    if runner_up is not None and runner_up.seconds < pick.seconds:
        reason += (f"; {runner_up.label} took {runner_up.seconds:.3f} s, within the {margin:.0%} margin, so the "
                   "simpler configuration stays")
    elif runner_up is not None:
        reason += f", {runner_up.seconds / pick.seconds:.2f}x faster than {runner_up.label}"
    if pick.method != "dsi":
        best_dsi = min((c for c in ranked if c.method == "dsi"), key=lambda c: c.seconds, default=None)
        if best_dsi is not None and best_dsi.seconds > pick.seconds:
            reason += (f"; DSI's best here ({best_dsi.label}) is {best_dsi.seconds / pick.seconds:.2f}x slower: "
                       + _why_dsi_loses(measured, best_dsi.servers, acceptance, t1, slope))
    if trees:
        reason += "; " + _tree_verdict(rivals, pick, trees)
    return AutoChoice(
        method=pick.method, lookahead=pick.lookahead if pick.lookahead is not None else 1,
        num_target_servers=pick.servers, reason=reason, candidates=(pick, *ranked), measured=measured,
        acceptance=acceptance, tokens=tokens, key=key, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        calibration_s=time.perf_counter() - began, draft_tree=pick.draft_tree,
    )


def pick_run(candidates: Sequence[Candidate], margin: float) -> Candidate:
    """Never a prediction that was not run: of the runs within ``margin`` of the fastest run, the simplest
    (:attr:`Candidate.simplicity`), the faster of equally simple ones."""
    runs = [c for c in candidates if c.measured_s is not None]
    fastest = min(c.seconds for c in runs)
    return min((c for c in runs if c.seconds <= fastest * (1 + margin)), key=lambda c: (c.simplicity, c.seconds))


def _patterns(drafter, prompt: list[int], reference: list[int], weigh_trees: bool, target=None,
              transport: str = "threads", options: dict | None = None) -> tuple[list[bool], dict]:
    """The accept pattern on the calibration output, and per method (``"si"``, ``"dsi"``) each tree shape's
    :class:`~dsi.engine.trees.TreePattern` for the shapes whose side children rescue at least one rejection
    there ({} without trees, or where the drafter cannot branch): one drafter forward for all of them. The
    ``"auto"`` tree branches as each method's decoders will, with the floor the ``target``'s cost per verified
    row sets (:func:`~dsi.engine.trees.priced_shape`), at least SI's least floor or DSI's
    (:data:`~dsi.trees.DSI_FLOOR`)."""
    from dsi.engine.trees import can_branch, priced_shape, tree_patterns
    from dsi.trees import least_floor, parse_shape

    if not weigh_trees or not can_branch(drafter, True):
        return accept_pattern(drafter, prompt, reference), {}
    wanted = [("si", name) for name in SI_TREES] + [("dsi", name) for name in DSI_TREES]
    shapes = [parse_shape(name) if target is None else
              priced_shape(parse_shape(name), target, drafter, transport, options, least_floor(method))
              for method, name in wanted]
    distinct = list(dict.fromkeys(shapes))  # one pattern per distinct shape (a width is the same for both methods)
    patterns = dict(zip(distinct, tree_patterns(drafter, prompt, reference, distinct), strict=True))
    trees: dict[str, dict] = {}
    for (method, name), shape in zip(wanted, shapes, strict=True):
        if any(patterns[shape].rescues):
            trees.setdefault(method, {})[name] = patterns[shape]
    return list(patterns[distinct[0]].matches), trees


def _tree_verdict(ranked: list[Candidate], pick: Candidate, trees: dict) -> str:
    """Trees against chains in words: the rescues seen, and the best tree against the best chain."""
    rescued = ", ".join(f"{sum(p.rescues)} with {method.upper()}'s tree={name}"
                        for method, patterns in trees.items() for name, p in patterns.items())
    rivals = [c for c in ranked if c is not pick and c.method != "ar"
              and (c.draft_tree is None) == (pick.draft_tree is not None)]
    if not rivals:
        return f"side children would rescue rejections ({rescued})"
    rival = rivals[0]
    seconds = f"{rival.seconds:.3f} s" + (" predicted" if rival.measured_s is None else "")
    if pick.draft_tree is not None:
        return f"side children rescue rejections ({rescued}), and the best chain, {rival.label}, takes {seconds}"
    return f"side children would rescue rejections ({rescued}), but the best tree, {rival.label}, takes {seconds}"


def _why_dsi_loses(measured: dict, servers: int, acceptance: float, target_alone_s: float,
                   slope: float = 0.0) -> str:
    """The likeliest reason, from the calibration runs: contention, a poor drafter, a slow drafter; a reason of
    its own clauses (joined by "; ", a line each where :meth:`AutoChoice.reason_lines` splits them), each number
    named by what it times. A DSI verification is compared with what one over its mean window costs alone (the
    one-token forward plus ``slope`` per extra row, as the predictions take it), so long windows are not
    mistaken for contention."""
    run = measured.get(f"DSI auto SP={servers}", {})
    together = run.get("target_forward_s") or 0.0
    drafter_step = run.get("drafter_step_s") or 0.0
    si_step = measured.get(f"SI k={SI_CALIBRATION_K}", {}).get("drafter_step_s") or 0.0
    window = max(run.get("mean_window") or 0.0, 0.0)
    alone = target_alone_s + window * slope
    if target_alone_s > 0 and (together > 1.2 * alone or (si_step and drafter_step > 1.2 * si_step)):
        return (f"its workers slow each other down on this placement; a verification of {window + 1:.1f} tokens "
                f"(DSI's mean window + 1): {together * 1e3:.1f} ms next to the drafter, {alone * 1e3:.1f} ms alone "
                f"(estimated); "
                f"a drafter step (one draft token): {drafter_step * 1e3:.1f} ms in DSI, {si_step * 1e3:.1f} ms in SI; "
                f"a one-token target forward alone (non-SI): {target_alone_s * 1e3:.1f} ms")
    if acceptance < 0.5:
        return f"the drafter is right only {acceptance:.0%} of the time"
    return (f"a drafter step (one draft token) costs {drafter_step / target_alone_s:.2f} of a one-token target forward"
            if target_alone_s > 0 and drafter_step else "no placement of its workers pays off here")


def worker_threads(target, drafter, method: str, servers: int, transport: str) -> int | None:
    """Torch threads per worker that ``method`` should run with here, or None to leave them alone.

    Only for models on a CPU whose ``threads`` the user left unset (None): non-SI and SI run one
    worker at a time, which may use every core (torch's default); DSI's drafter and thread-placed
    servers run at once, so each gets an equal share of the cores (at least one).
    """
    models = [m for m in (target, drafter) if m is not None]
    if method != "dsi" or not models or any(getattr(m, "threads", 0) is not None for m in models):
        return None
    if any(getattr(getattr(m, "device", None), "type", "cpu") != "cpu" for m in models):
        return None
    workers = 1 + (servers if transport == "threads" else 0)
    return max(1, (os.cpu_count() or 1) // workers)


class threads_set:
    """Set ``threads`` on the models for a while (None: change nothing)."""

    def __init__(self, threads: int | None, *models) -> None:
        self.threads, self.models = threads, [m for m in models if m is not None]

    def __enter__(self) -> None:
        if self.threads is not None:
            self.saved = [m.threads for m in self.models]
            for m in self.models:
                m.threads = self.threads

    def __exit__(self, *exc: object) -> None:
        if self.threads is not None:
            for m, value in zip(self.models, self.saved, strict=True):
                m.threads = value


class AutoDecoder:
    """The decoder ``method="auto"`` picked, with the choice attached to every result's stats."""

    def __init__(self, inner, choice: AutoChoice) -> None:
        self.inner = inner
        self.choice = choice
        self.method = inner.method

    def generate(self, request, on_tokens=None, abort=None):
        result = self.inner.generate(request, on_tokens, abort)
        result.stats.extra["auto"] = self.choice.summary()
        return result

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> AutoDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def build_auto_decoder(*, target, drafter, transport="threads", transport_options=None, num_target_servers=1,
                       tune_options: dict | None = None) -> AutoDecoder:
    """Choose (or read the cached choice), then build that decoder (:func:`decoder_for_choice`)."""
    choice = choose_method(target, drafter, transport=transport, transport_options=transport_options,
                           max_servers=num_target_servers, **(tune_options or {}))
    return decoder_for_choice(choice, target=target, drafter=drafter, transport=transport,
                              transport_options=transport_options)


def decoder_for_choice(choice: AutoChoice, *, target, drafter, transport="threads",
                       transport_options=None) -> AutoDecoder:
    """The decoder of ``choice``, built exactly as that method is built by hand (the engine's builder,
    the choice's lookahead and servers), with the threads per worker it was measured with.

    Nothing else is built or started beside it: a non-SI pick neither uses nor holds the drafter
    (``drafter`` may then be None, and a caller that loaded one may free it:
    :func:`dsi.models.loading.release`)."""
    if choice.method != "ar" and drafter is None:
        raise ConfigError(f"the choice {choice.label} needs a drafter")
    threads = worker_threads(target, drafter, choice.method, choice.num_target_servers, transport)
    if threads is not None:  # run as it was measured (the models keep this setting)
        for model in (target, drafter):
            model.threads = threads
    inner = build_decoder(target=target, drafter=drafter if choice.method != "ar" else None, method=choice.method,
                          lookahead=choice.lookahead if choice.method != "ar" else 5,
                          num_target_servers=choice.num_target_servers, transport=transport,
                          transport_options=transport_options if choice.method == "dsi" else None,
                          draft_tree=choice.draft_tree if choice.method != "ar" else None)
    return AutoDecoder(inner, choice)
