"""Plan a DSI deployment: which lookahead and how many target servers, and how fast it will be.

Inputs are a pair's measured latencies (TTFT, TPOT in ms) and acceptance rate, given directly
or read from the JSON files ``dsi measure`` writes. Equation 1 gives, for each lookahead ``k``,
the servers that keep every verification task from waiting; within the budget ``max_servers``
each ``k`` gets ``min(max_servers, Equation 1)`` servers (fewer means tasks queue), and the
event simulator (:mod:`dsi.sim.events`) predicts the latency of each. The fastest wins; among
candidates as fast (within ``TIE_RTOL``) the order is fewer servers, then a ``k`` that meets
Equation 1 before one that queues, then less queue wait, then smaller ``k``. A plan that queues is
thus strictly faster than every ``k`` that does not; :attr:`Plan.fastest_meeting_equation1` says by how
much. SI (best ``k``) and non-SI are simulated the same way for the speedups. Every candidate reads
the same acceptance patterns (common random numbers).

Beside the fixed lookaheads the planner simulates DSI's event-driven policy (``lookahead="auto"``:
a window whenever a target server is idle, with every draft made since the previous one, paced by
:mod:`dsi.windows`; no k to choose) with each number of servers ``1..max_servers``, and compares
it, for each number of servers, with the best fixed ``k`` among the candidates that use exactly
that many (below the budget those are the ``k`` Equation 1 pairs with it; at the budget also the
smaller ``k`` that queue). :attr:`Plan.event_driven` is the fastest of them (ties: fewer servers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dsi.errors import ConfigError
from dsi.sim.events import simulate
from dsi.sim.offline import min_lookahead, required_sp

LATENCY_KEYS = ("target_ttft_ms", "target_tpot_ms", "drafter_ttft_ms", "drafter_tpot_ms")
TIE_RTOL = 1e-9  # latencies this close (relative) are equal: the order among them decides


@dataclass(frozen=True)
class PlanInputs:
    target_tpot_ms: float
    drafter_tpot_ms: float
    acceptance: float
    target_ttft_ms: float
    drafter_ttft_ms: float
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    lookahead: int
    num_servers: int
    required_sp: int  # Equation 1 for this lookahead
    latency_ms: float  # mean over the repeats, for ``tokens`` tokens
    per_token_ms: float
    queue_wait_ms: float  # mean total time tasks waited for a server
    utilisation: float

    @property
    def meets_equation1(self) -> bool:
        """Enough servers for Equation 1 (no verification task waits, in its model)."""
        return self.num_servers >= self.required_sp


def rank(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """Fastest first; candidates within ``TIE_RTOL`` of each other are ordered by fewer servers, then Equation 1
    met before not, then less queue wait, then smaller ``k`` (the first of a tie is the one the planner takes)."""
    ranked: list[Candidate] = []
    rest = sorted(candidates, key=lambda c: c.latency_ms)
    while rest:
        tied = [c for c in rest if c.latency_ms <= rest[0].latency_ms * (1 + TIE_RTOL)]
        ranked += sorted(tied, key=lambda c: (c.num_servers, not c.meets_equation1, c.queue_wait_ms, c.lookahead))
        rest = rest[len(tied):]
    return tuple(ranked)


@dataclass(frozen=True)
class AutoCandidate:
    """The event-driven policy (``lookahead="auto"``) with ``num_servers`` target servers."""

    num_servers: int
    latency_ms: float
    per_token_ms: float
    mean_window: float  # drafts per verification window
    queue_wait_ms: float
    utilisation: float


def better(fixed_ms: float | None, auto_ms: float) -> str:
    """Which policy is faster: "event-driven", "fixed k" or "tie" (equal within 1e-9)."""
    if fixed_ms is None or fixed_ms > auto_ms * (1 + 1e-9):
        return "event-driven"
    if auto_ms > fixed_ms * (1 + 1e-9):
        return "fixed k"
    return "tie"


@dataclass(frozen=True)
class ServerComparison:
    """With exactly ``num_servers`` target servers: the best fixed k beside the event-driven policy."""

    num_servers: int
    fixed: Candidate | None  # None: no k in 1..max_lookahead is given exactly this many servers
    event_driven: AutoCandidate

    @property
    def better(self) -> str:
        return better(None if self.fixed is None else self.fixed.latency_ms, self.event_driven.latency_ms)

    def to_dict(self) -> dict:
        return {
            "num_servers": self.num_servers,
            "fixed": None if self.fixed is None else asdict(self.fixed),
            "event_driven": asdict(self.event_driven),
            "better": self.better,
        }


@dataclass(frozen=True)
class TreeComparison:
    """Draft trees against chains for a rate ``side_rescue`` (the chance that a rejected draft's correction is
    one of its position's side children: the drafter's second choice, for the tree ``"2"``). SI: the best k
    with chains and with the tree ``"auto"`` (the chain's k drafts, each with its side children); DSI:
    event-driven windows with each number of servers, chains and trees (side children at every position),
    the fastest of each. Side children cost the target nothing (the GPU-like model)."""

    side_rescue: float
    si_chain: tuple[int, float]  # (k, ms per token)
    si_tree: tuple[int, float]
    dsi_chain: tuple[int, float]  # (servers, ms per token)
    dsi_tree: tuple[int, float]

    @property
    def si_gain(self) -> float:
        """Chain time over tree time for SI (> 1: the tree is faster)."""
        return self.si_chain[1] / self.si_tree[1]

    @property
    def dsi_gain(self) -> float:
        return self.dsi_chain[1] / self.dsi_tree[1]

    def to_dict(self) -> dict:
        return {"side_rescue": self.side_rescue,
                "si": {"chain": {"lookahead": self.si_chain[0], "ms_per_token": self.si_chain[1]},
                       "tree": {"lookahead": self.si_tree[0], "ms_per_token": self.si_tree[1]}, "gain": self.si_gain},
                "dsi": {"chain": {"num_servers": self.dsi_chain[0], "ms_per_token": self.dsi_chain[1]},
                        "tree": {"num_servers": self.dsi_tree[0], "ms_per_token": self.dsi_tree[1]},
                        "gain": self.dsi_gain}}


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    best: Candidate
    candidates: tuple[Candidate, ...]
    si_lookahead: int
    si_per_token_ms: float
    nonsi_per_token_ms: float
    max_servers: int
    min_lookahead_for_budget: int  # Equation 1 solved for k with max_servers
    tokens: int
    repeats: int
    seed: int
    auto_candidates: tuple[AutoCandidate, ...] = ()  # the event-driven policy with 1..max_servers servers
    trees: TreeComparison | None = None  # with a side-child rescue rate: draft trees against chains

    @property
    def ranked(self) -> tuple[Candidate, ...]:
        """The candidates in the planner's order (:func:`rank`): ``ranked[0]`` is :attr:`best`."""
        return rank(self.candidates)

    @property
    def ties(self) -> tuple[Candidate, ...]:
        """The other candidates as fast as the plan (within ``TIE_RTOL``), in the planner's order."""
        limit = self.best.latency_ms * (1 + TIE_RTOL)
        return tuple(c for c in self.ranked[1:] if c.latency_ms <= limit)

    @property
    def fastest_meeting_equation1(self) -> Candidate | None:
        """The first candidate, in the planner's order, whose servers meet Equation 1 (None if no ``k`` up to
        ``max_lookahead`` does): the plan itself unless a ``k`` that queues is strictly faster."""
        return next((c for c in self.ranked if c.meets_equation1), None)

    @property
    def event_driven(self) -> AutoCandidate | None:
        """The fastest event-driven configuration (ties: fewer servers)."""
        if not self.auto_candidates:
            return None
        return min(self.auto_candidates, key=lambda c: (round(c.latency_ms, 9), c.num_servers))

    @property
    def event_driven_better(self) -> str:
        """"event-driven", "fixed k" or "tie": the event-driven policy against the plan's (k, SP)."""
        return better(self.best.latency_ms, self.event_driven.latency_ms)

    @property
    def by_servers(self) -> tuple[ServerComparison, ...]:
        """For each number of servers: the best fixed-k candidate using exactly that many, and event-driven."""
        rows = []
        for auto in self.auto_candidates:
            fixed = rank([c for c in self.candidates if c.num_servers == auto.num_servers])
            rows.append(ServerComparison(auto.num_servers, fixed[0] if fixed else None, auto))
        return tuple(rows)

    @property
    def speedup_vs_si(self) -> float:
        return self.si_per_token_ms / self.best.per_token_ms

    @property
    def speedup_vs_nonsi(self) -> float:
        return self.nonsi_per_token_ms / self.best.per_token_ms

    def to_dict(self) -> dict:
        return {
            "lookahead": self.best.lookahead,
            "num_target_servers": self.best.num_servers,
            "gpus": self.best.num_servers + 1,
            "predicted_ms_per_token": self.best.per_token_ms,
            "predicted_latency_ms": self.best.latency_ms,
            "speedup_vs_si": self.speedup_vs_si,
            "speedup_vs_nonsi": self.speedup_vs_nonsi,
            "si": {"lookahead": self.si_lookahead, "ms_per_token": self.si_per_token_ms},
            "nonsi": {"ms_per_token": self.nonsi_per_token_ms},
            "equation1": {
                "required_sp": self.best.required_sp,
                "min_lookahead_for_budget": self.min_lookahead_for_budget,
                "max_servers": self.max_servers,
                "met": self.best.meets_equation1,  # False: the plan queues, being faster than every k that does not
                "fastest_meeting_it": None if (alt := self.fastest_meeting_equation1) is None else asdict(alt),
            },
            "ties": [asdict(c) for c in self.ties],
            "inputs": asdict(self.inputs),
            "tokens": self.tokens,
            "repeats": self.repeats,
            "seed": self.seed,
            "candidates": [asdict(c) for c in self.candidates],
            "event_driven": None if self.event_driven is None else {
                **asdict(self.event_driven),
                "speedup_vs_plan": self.best.per_token_ms / self.event_driven.per_token_ms,
                "speedup_vs_si": self.si_per_token_ms / self.event_driven.per_token_ms,
                "speedup_vs_nonsi": self.nonsi_per_token_ms / self.event_driven.per_token_ms,
                "better": self.event_driven_better,
            },
            "by_servers": [row.to_dict() for row in self.by_servers],
            "trees": None if self.trees is None else self.trees.to_dict(),
        }


# ---- inputs -------------------------------------------------------------------------------------
def _number(name: str, value: object, source: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} in {source} must be a number")
    return float(value)


def read_measure_file(path: str | Path) -> dict:
    """Load one JSON file written by ``dsi measure`` (kind "latency" or "acceptance")."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--from file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--from file {str(p)!r} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--from file {str(p)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") not in ("latency", "acceptance"):
        raise ConfigError(f'--from file {str(p)!r} needs "kind": "latency" or "acceptance" (from dsi measure)')
    data = dict(data)
    data["_source"] = str(p)
    return data


def inputs_from_files(files: Sequence[Mapping]) -> dict[str, float]:
    """Merge measurement files into ``{target_tpot_ms, ..., acceptance}`` (missing keys absent).

    A latency file with ``role`` null is matched to the acceptance file's target/drafter model
    names; failing that, with two such files the slower (TPOT) is the target.
    """
    values: dict[str, float] = {}
    unassigned: list[Mapping] = []
    acceptance_files = [f for f in files if f.get("kind") == "acceptance"]
    names: dict[str, str] = {}
    for f in acceptance_files:
        src = f["_source"]
        if "acceptance" in f:
            a = _number("acceptance", f["acceptance"], src)
            values["acceptance"] = a
        for key in LATENCY_KEYS:
            if f.get(key) is not None:
                values[key] = _number(key, f[key], src)
        for role in ("target", "drafter"):
            if isinstance(f.get(role), str):
                names[f[role]] = role
    for f in files:
        if f.get("kind") != "latency":
            continue
        role = f.get("role")
        if role is None and isinstance(f.get("model"), str):
            role = names.get(f["model"])
        if role is None:
            unassigned.append(f)
            continue
        if role not in ("target", "drafter"):
            raise ConfigError(f'role={role!r} in {f["_source"]} must be "target", "drafter" or null')
        _take_latency(values, role, f)
    if unassigned:
        taken = {r for r in ("target", "drafter") if f"{r}_tpot_ms" in values}
        free = [r for r in ("target", "drafter") if r not in taken]
        if len(unassigned) > len(free):
            raise ConfigError(
                f"cannot tell target from drafter in {', '.join(f['_source'] for f in unassigned)}: "
                'set "role" in the files or pass --target-tpot/--drafter-tpot'
            )
        if len(unassigned) == 2:
            tpots = [_number("tpot_ms", f.get("tpot_ms"), f["_source"]) for f in unassigned]
            unassigned.sort(key=lambda f: -float(f["tpot_ms"]))  # slower first: the target
            if tpots[0] == tpots[1]:
                raise ConfigError("two latency files with equal TPOT and no role: which is the target?")
            free = ["target", "drafter"]
        elif len(free) == 2:
            raise ConfigError(
                f"latency file {unassigned[0]['_source']} has no role and there is no second one to "
                'compare with: set "role" or pass the other model\'s latencies'
            )
        for f, role in zip(unassigned, free, strict=False):
            _take_latency(values, role, f)
    return values


def _take_latency(values: dict[str, float], role: str, f: Mapping) -> None:
    src = f["_source"]
    if f.get("tpot_ms") is None:
        raise ConfigError(f"latency file {src} has no tpot_ms")
    values[f"{role}_tpot_ms"] = _number("tpot_ms", f["tpot_ms"], src)
    if f.get("ttft_ms") is not None:
        values[f"{role}_ttft_ms"] = _number("ttft_ms", f["ttft_ms"], src)


def resolve_inputs(
    *,
    files: Sequence[Mapping] = (),
    target_tpot_ms: float | None = None,
    drafter_tpot_ms: float | None = None,
    acceptance: float | None = None,
    target_ttft_ms: float | None = None,
    drafter_ttft_ms: float | None = None,
) -> PlanInputs:
    """File values overridden by explicit ones; TTFTs default to the TPOTs; everything validated."""
    values = inputs_from_files(files)
    explicit = {
        "target_tpot_ms": target_tpot_ms,
        "drafter_tpot_ms": drafter_tpot_ms,
        "acceptance": acceptance,
        "target_ttft_ms": target_ttft_ms,
        "drafter_ttft_ms": drafter_ttft_ms,
    }
    values.update({k: float(v) for k, v in explicit.items() if v is not None})
    flags = {"target_tpot_ms": "--target-tpot", "drafter_tpot_ms": "--drafter-tpot", "acceptance": "--acceptance"}
    missing = [flag for key, flag in flags.items() if key not in values]
    if missing:
        raise ConfigError(
            f"missing {', '.join(missing)}: pass it, or --from a file written by dsi measure that contains it"
        )
    for key in LATENCY_KEYS:
        if key in values and not (values[key] >= 0 and math.isfinite(values[key])):
            raise ConfigError(f"{key.removesuffix('_ms').replace('_', '-')}={values[key]} ms must be >= 0")
    for key in ("target_tpot_ms", "drafter_tpot_ms"):
        if values[key] <= 0:
            raise ConfigError(f"{key.removesuffix('_ms').replace('_', '-')}={values[key]} ms must be > 0")
    if values["drafter_tpot_ms"] >= values["target_tpot_ms"]:
        raise ConfigError(
            f"drafter-tpot={values['drafter_tpot_ms']} ms must be below target-tpot="
            f"{values['target_tpot_ms']} ms: c = drafter/target must be in (0, 1) for speculation to pay"
        )
    if not 0 <= values["acceptance"] <= 1:
        raise ConfigError(f"acceptance={values['acceptance']} must be in [0, 1]")
    return PlanInputs(
        target_tpot_ms=values["target_tpot_ms"],
        drafter_tpot_ms=values["drafter_tpot_ms"],
        acceptance=values["acceptance"],
        target_ttft_ms=values.get("target_ttft_ms", values["target_tpot_ms"]),
        drafter_ttft_ms=values.get("drafter_ttft_ms", values["drafter_tpot_ms"]),
        sources=tuple(str(f["_source"]) for f in files),
    )


# ---- the plan -----------------------------------------------------------------------------------
def make_plan(
    inputs: PlanInputs,
    *,
    max_servers: int = 7,
    max_lookahead: int = 20,
    tokens: int = 200,
    repeats: int = 30,
    seed: int = 0,
    event_driven: bool = True,
    side_rescue: float | None = None,
) -> Plan:
    """Simulate every lookahead ``1..max_lookahead`` within the server budget; keep the fastest.

    With ``event_driven`` also the event-driven policy with ``1..max_servers`` servers. With ``side_rescue``
    (a probability) also draft trees against chains (:class:`TreeComparison`), the rescues drawn i.i.d. per
    position from ``seed`` beside the acceptance patterns.
    """
    if side_rescue is not None and not (isinstance(side_rescue, int | float) and 0.0 <= side_rescue <= 1.0):
        raise ConfigError(f"side-rescue={side_rescue!r} must be a probability in [0, 1]")
    for name, value in (("max_servers", max_servers), ("max_lookahead", max_lookahead),
                        ("tokens", tokens), ("repeats", repeats)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name.replace('_', '-')}={value!r} must be an integer >= 1")
    lat = dict(
        target_tpot=inputs.target_tpot_ms, target_ttft=inputs.target_ttft_ms,
        drafter_tpot=inputs.drafter_tpot_ms, drafter_ttft=inputs.drafter_ttft_ms,
        tokens=tokens, acceptance=inputs.acceptance, repeats=repeats, seed=seed,
    )  # fmt: skip
    candidates = []
    for k in range(1, max_lookahead + 1):
        need = required_sp(inputs.drafter_tpot_ms, inputs.target_tpot_ms, k)
        sp = min(max_servers, need)
        result = simulate("dsi", lookahead=k, num_servers=sp, **lat)
        candidates.append(
            Candidate(
                lookahead=k,
                num_servers=sp,
                required_sp=need,
                latency_ms=result.mean,
                per_token_ms=result.mean / tokens,
                queue_wait_ms=result.queue_wait,
                utilisation=result.utilisation,
            )  # fmt: skip
        )
    best = rank(candidates)[0]
    si = min(((k, simulate("si", lookahead=k, **lat).mean) for k in range(1, max_lookahead + 1)), key=lambda kv: kv[1])
    nonsi = simulate("ar", **lat).mean
    autos = []
    for sp in range(1, max_servers + 1) if event_driven else ():
        result = simulate("dsi", lookahead="auto", num_servers=sp, **lat)
        autos.append(
            AutoCandidate(
                num_servers=sp,
                latency_ms=result.mean,
                per_token_ms=result.mean / tokens,
                mean_window=result.mean_window,
                queue_wait_ms=result.queue_wait,
                utilisation=result.utilisation,
            )
        )
    trees = None
    if side_rescue is not None:
        import numpy as np

        rescues = np.random.default_rng([seed, 24]).random((repeats, tokens)) < side_rescue  # [repeats, tokens]

        def per_token(method: str, **options) -> float:
            return simulate(method, **lat, **options).mean / tokens

        ks = range(1, max_lookahead + 1)
        si_chain = min(((k, per_token("si", lookahead=k)) for k in ks), key=lambda kv: kv[1])
        si_tree = min(((k, per_token("si", lookahead=k, rescues=rescues, si_tree="auto")) for k in ks),
                      key=lambda kv: kv[1])
        sps = range(1, max_servers + 1)
        dsi_chain = min(((sp, per_token("dsi", lookahead="auto", num_servers=sp)) for sp in sps),
                        key=lambda kv: kv[1])
        dsi_tree = min(((sp, per_token("dsi", lookahead="auto", num_servers=sp, rescues=rescues)) for sp in sps),
                       key=lambda kv: kv[1])
        trees = TreeComparison(float(side_rescue), si_chain, si_tree, dsi_chain, dsi_tree)
    return Plan(
        trees=trees,
        inputs=inputs,
        best=best,
        candidates=tuple(candidates),
        si_lookahead=si[0],
        si_per_token_ms=si[1] / tokens,
        nonsi_per_token_ms=nonsi / tokens,
        max_servers=max_servers,
        min_lookahead_for_budget=min_lookahead(inputs.drafter_tpot_ms, inputs.target_tpot_ms, max_servers),
        tokens=tokens,
        repeats=repeats,
        seed=seed,
        auto_candidates=tuple(autos),
    )
