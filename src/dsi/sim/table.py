"""Table 1 of the paper, side by side with this project's three models of DSI/SI speed.

Columns, per row of the paper's Table 1 (Timor et al., ICLR 2025) (target/drafter TPOT in ms, acceptance rate):

- **paper**: the published DSI/SI speedup (the authors' wall-clock simulator, which has the
  weaknesses listed in docs/simulator.md section 1).
- **offline**: :mod:`dsi.sim.offline` in time units (``c`` = drafter / target TPOT), best ``k``
  of each method in ``lookaheads``; DSI only with ``k`` whose Equation 1 needs at most
  ``max_sp`` servers.
- **event**: :mod:`dsi.sim.events` in ms (TTFT = TPOT), best ``k`` of each method; DSI with
  ``SP = min(max_sp, Equation 1)`` servers (tasks queue when Equation 1 asks for more).
- **engine**: the real engine (:func:`dsi.generate`, thread transport) on a synthetic pair wrapped
  in :class:`dsi.models.WithLatency` at the row's latencies and acceptance rate, greedy, at the
  event simulator's best ``(k, SP)`` per method, ``repeats`` runs of different seeds. Each run
  is replayed through the event simulator with its own match pattern
  (:func:`dsi.sim.replay.greedy_match_pattern`): ``engine / ideal`` is its wall time over that
  ideal time.

The engine column runs on the wall clock (sleep-based latencies; about 2-5 s per row and
repeat); :func:`run_engine` takes any ``generate`` callable (``dsi table`` passes
:func:`dsi.generate`; tests use a fake), so this module never imports the engine.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsi.errors import ConfigError
from dsi.sim.events import simulate
from dsi.sim.files import figure_class, prepare_out_dir, write_csv
from dsi.sim.offline import required_sp, simulate_many
from dsi.sim.replay import greedy_match_pattern

log = logging.getLogger(__name__)

LOOKAHEADS = (1, 5, 10)
MAX_SP = 7
TOKENS = 50
PROMPT = (1, 2, 3)


@dataclass(frozen=True)
class PaperRow:
    target: str
    drafter: str
    dataset: str
    target_ms: float
    drafter_ms: float
    acceptance: float
    paper_speedup: float  # published DSI vs SI

    @property
    def c(self) -> float:
        return self.drafter_ms / self.target_ms

    @property
    def name(self) -> str:
        return f"{self.target}/{self.drafter} {self.dataset}"


TABLE1: tuple[PaperRow, ...] = (
    PaperRow("Vicuna-13B", "Vicuna-68M", "CNN-DM", 37.7, 2.5, 0.63, 1.47),
    PaperRow("Vicuna-13B", "Vicuna-68M", "Alpaca", 33.3, 2.5, 0.58, 1.41),
    PaperRow("Vicuna-7B", "Vicuna-68M", "CNN-DM", 29.4, 2.5, 0.67, 1.29),
    PaperRow("Vicuna-7B", "Vicuna-68M", "Alpaca", 26.0, 2.5, 0.59, 1.70),
    PaperRow("StarCoder-15B", "StarCoder-168M", "HumanEval", 20.6, 6.8, 0.93, 1.92),
    PaperRow("StarCoder-15B", "StarCoder-168M", "MBPP", 21.0, 6.8, 0.90, 1.66),
    PaperRow("Phi3-14B", "Phi3-4B", "HumanEval", 52.1, 34.0, 0.95, 1.41),
    PaperRow("Phi3-14B", "Phi3-4B", "MBPP", 52.2, 34.3, 0.94, 1.37),
    PaperRow("Phi3-14B", "Phi3-4B", "CNN-DM", 52.4, 34.6, 0.93, 1.39),
    PaperRow("Phi3-14B", "Phi3-4B", "Alpaca", 49.6, 33.4, 0.87, 1.60),
)


@dataclass(frozen=True)
class Choice:
    """A method's best configuration in one model and its mean time."""

    lookahead: int
    num_servers: int
    time: float  # time units (offline) or ms (event)


@dataclass(frozen=True)
class ModelColumn:
    si: Choice
    dsi: Choice

    @property
    def speedup(self) -> float:
        return self.si.time / self.dsi.time


@dataclass(frozen=True)
class EngineRun:
    method: str
    seed: int
    wall_s: float
    ideal_s: float
    acceptance: float  # fraction of positions where drafter and target agree

    @property
    def ratio(self) -> float:
        return self.wall_s / self.ideal_s


@dataclass(frozen=True)
class EngineColumn:
    si: Choice
    dsi: Choice
    runs: tuple[EngineRun, ...]

    def _walls(self, method: str) -> list[float]:
        return [r.wall_s for r in self.runs if r.method == method]

    @property
    def si_s(self) -> float:
        return float(np.mean(self._walls("si")))

    @property
    def dsi_s(self) -> float:
        return float(np.mean(self._walls("dsi")))

    @property
    def speedup(self) -> float:
        return self.si_s / self.dsi_s

    def ratio(self, method: str) -> float:
        """Median engine / ideal over this method's runs."""
        return float(statistics.median(r.ratio for r in self.runs if r.method == method))


@dataclass(frozen=True)
class TableRow:
    paper: PaperRow
    offline: ModelColumn
    event: ModelColumn
    engine: EngineColumn | None = None

    def to_dict(self) -> dict:
        p = self.paper
        data = {
            "target": p.target,
            "drafter": p.drafter,
            "dataset": p.dataset,
            "target_ms": p.target_ms,
            "drafter_ms": p.drafter_ms,
            "c": p.c,
            "acceptance": p.acceptance,
            "paper_dsi_vs_si": p.paper_speedup,
            "offline_dsi_vs_si": self.offline.speedup,
            "offline_k_si": self.offline.si.lookahead,
            "offline_k_dsi": self.offline.dsi.lookahead,
            "offline_sp_dsi": self.offline.dsi.num_servers,
            "event_dsi_vs_si": self.event.speedup,
            "event_si_ms": self.event.si.time,
            "event_dsi_ms": self.event.dsi.time,
            "event_k_si": self.event.si.lookahead,
            "event_k_dsi": self.event.dsi.lookahead,
            "event_sp_dsi": self.event.dsi.num_servers,
        }
        e = self.engine
        data.update(
            engine_dsi_vs_si=None if e is None else e.speedup,
            engine_si_ms=None if e is None else 1000 * e.si_s,
            engine_dsi_ms=None if e is None else 1000 * e.dsi_s,
            engine_over_ideal_dsi=None if e is None else e.ratio("dsi"),
            engine_over_ideal_si=None if e is None else e.ratio("si"),
            engine_runs=0 if e is None else len(e.runs) // 2,
        )
        return data


@dataclass(frozen=True)
class Table:
    rows: tuple[TableRow, ...]
    tokens: int
    lookaheads: tuple[int, ...]
    max_sp: int
    offline_repeats: int
    event_repeats: int
    seed: int
    engine_note: str = ""
    files: tuple[str, ...] = field(default=())

    @property
    def has_engine(self) -> bool:
        return any(r.engine is not None for r in self.rows)

    def median_engine_over_ideal(self, method: str = "dsi") -> float | None:
        values = [r.engine.ratio(method) for r in self.rows if r.engine is not None]
        return float(statistics.median(values)) if values else None

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "lookaheads": list(self.lookaheads),
            "max_sp": self.max_sp,
            "offline_repeats": self.offline_repeats,
            "event_repeats": self.event_repeats,
            "seed": self.seed,
            "median_engine_over_ideal_dsi": self.median_engine_over_ideal("dsi"),
            "median_engine_over_ideal_si": self.median_engine_over_ideal("si"),
            "engine_note": self.engine_note,
            "rows": [r.to_dict() for r in self.rows],
            "files": list(self.files),
        }


# ---- the two simulators -------------------------------------------------------------------------
def offline_column(
    row: PaperRow, *, tokens: int, lookaheads: Sequence[int], max_sp: int, repeats: int, seed: int
) -> ModelColumn:
    ks = np.asarray(lookaheads)
    si, dsi = simulate_many(row.c, row.acceptance, ks, tokens=tokens, repeats=repeats, seed=seed)
    si_mean, dsi_mean = si.mean(axis=1), dsi.mean(axis=1)
    need = np.array([required_sp(row.c, 1.0, int(k)) for k in ks])
    if not np.any(need <= max_sp):
        raise ConfigError(f"{row.name}: no lookahead in {list(lookaheads)} satisfies Equation 1 with sp <= {max_sp}")
    dsi_mean = np.where(need <= max_sp, dsi_mean, np.inf)
    i, j = int(np.argmin(si_mean)), int(np.argmin(dsi_mean))
    return ModelColumn(
        si=Choice(int(ks[i]), 1, float(si_mean[i])),
        dsi=Choice(int(ks[j]), int(need[j]), float(dsi_mean[j])),
    )


def event_column(
    row: PaperRow, *, tokens: int, lookaheads: Sequence[int], max_sp: int, repeats: int, seed: int
) -> ModelColumn:
    common = dict(
        target_tpot=row.target_ms, drafter_tpot=row.drafter_ms, tokens=tokens,
        acceptance=row.acceptance, repeats=repeats, seed=seed,
    )  # fmt: skip
    si = min((Choice(k, 1, simulate("si", lookahead=k, **common).mean) for k in lookaheads), key=lambda ch: ch.time)
    dsi_choices = []
    for k in lookaheads:
        sp = min(max_sp, required_sp(row.drafter_ms, row.target_ms, k))
        dsi_choices.append(Choice(k, sp, simulate("dsi", lookahead=k, num_servers=sp, **common).mean))
    return ModelColumn(si=si, dsi=min(dsi_choices, key=lambda ch: (ch.time, ch.num_servers)))


# ---- the engine ---------------------------------------------------------------------------------
Generate = Callable[..., object]


def run_engine(
    row: PaperRow,
    *,
    si: Choice,
    dsi: Choice,
    tokens: int = TOKENS,
    repeats: int = 2,
    generate: Generate,
    pair_factory: Callable[..., tuple[object, object]] | None = None,
) -> EngineColumn:
    """Run the engine ``repeats`` times per method at the given choices; replay each run's ideal.

    ``generate`` is called like :func:`dsi.generate`; it must return an object with ``tokens``
    (the new tokens) and ``stats.wall_time_s``. ``pair_factory(acceptance, seed=..., target_tpot=...,
    drafter_tpot=...)`` builds the models in seconds (default :func:`dsi.models.synthetic_pair`).
    """
    if pair_factory is None:
        from dsi.models import synthetic_pair as pair_factory
    from dsi.sampling import SamplingParams

    t_s, d_s = row.target_ms / 1000.0, row.drafter_ms / 1000.0
    runs = []
    for seed in range(repeats):
        target, drafter = pair_factory(row.acceptance, seed=seed, target_tpot=t_s, drafter_tpot=d_s)
        for method, choice in (("si", si), ("dsi", dsi)):
            result = generate(
                target=target, drafter=drafter, prompt=list(PROMPT), method=method, max_new_tokens=tokens,
                lookahead=choice.lookahead, num_target_servers=choice.num_servers,
                sampling=SamplingParams(temperature=0.0), transport="threads",
            )  # fmt: skip
            new_tokens = list(result.tokens)
            if len(new_tokens) != tokens:
                raise ConfigError(f"the engine returned {len(new_tokens)} tokens; expected {tokens}")
            matches = greedy_match_pattern(target, drafter, PROMPT, new_tokens)
            ideal = simulate(
                method, target_tpot=t_s, drafter_tpot=d_s, lookahead=choice.lookahead,
                num_servers=choice.num_servers, matches=matches,
            ).mean  # fmt: skip
            wall = float(result.stats.wall_time_s)
            runs.append(EngineRun(method, seed, wall, ideal, float(np.mean(matches))))
            log.info("%s %s seed=%d: wall %.3f s, ideal %.3f s", row.name, method, seed, wall, ideal)
    return EngineColumn(si=si, dsi=dsi, runs=tuple(runs))


# ---- the whole table ----------------------------------------------------------------------------
def build_table(
    rows: Sequence[PaperRow] = TABLE1,
    *,
    tokens: int = TOKENS,
    lookaheads: Sequence[int] = LOOKAHEADS,
    max_sp: int = MAX_SP,
    offline_repeats: int = 200,
    event_repeats: int = 100,
    seed: int = 42,
    engine: bool = True,
    engine_repeats: int = 2,
    generate: Generate | None = None,
    progress: Callable[[str], None] | None = None,
) -> Table:
    """Compute every column (the engine's only with ``engine``) for ``rows``."""
    for name, value in (("tokens", tokens), ("max_sp", max_sp), ("offline_repeats", offline_repeats),
                        ("event_repeats", event_repeats), ("engine_repeats", engine_repeats)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    if not lookaheads or any(not isinstance(k, int) or k < 1 for k in lookaheads):
        raise ConfigError(f"lookaheads={list(lookaheads)!r} must be integers >= 1")
    note = ""
    if engine and generate is None:
        engine, note = False, "engine column skipped: no generate= was given (dsi table passes dsi.generate)"
    elif not engine:
        note = "engine column skipped (--no-engine)"
    out = []
    for i, row in enumerate(rows):
        if progress is not None:
            progress(f"[{i + 1}/{len(rows)}] {row.name}")
        kwargs = dict(tokens=tokens, lookaheads=lookaheads, max_sp=max_sp)
        offline = offline_column(row, repeats=offline_repeats, seed=seed, **kwargs)
        event = event_column(row, repeats=event_repeats, seed=seed, **kwargs)
        eng = None
        if engine:
            eng = run_engine(row, si=event.si, dsi=event.dsi, tokens=tokens, repeats=engine_repeats, generate=generate)
        out.append(TableRow(row, offline, event, eng))
    return Table(tuple(out), tokens, tuple(lookaheads), max_sp, offline_repeats, event_repeats, seed, note)


# ---- outputs ------------------------------------------------------------------------------------
def _fmt(value: float | None, digits: int = 2, suffix: str = "x") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def to_markdown(table: Table) -> str:
    head = (
        "| target | drafter | dataset | c | a | paper DSI/SI | offline DSI/SI (k_SI, k_DSI/SP) "
        "| event DSI/SI (k_SI, k_DSI/SP) | engine DSI/SI | engine/ideal DSI | engine/ideal SI |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in table.rows:
        p, o, e, g = r.paper, r.offline, r.event, r.engine
        lines.append(
            f"| {p.target} | {p.drafter} | {p.dataset} | {p.c:.3f} | {p.acceptance:.2f} | {p.paper_speedup:.2f}x "
            f"| {o.speedup:.2f}x ({o.si.lookahead}, {o.dsi.lookahead}/{o.dsi.num_servers}) "
            f"| {e.speedup:.2f}x ({e.si.lookahead}, {e.dsi.lookahead}/{e.dsi.num_servers}) "
            f"| {_fmt(None if g is None else g.speedup)} | {_fmt(None if g is None else g.ratio('dsi'), 3, '')} "
            f"| {_fmt(None if g is None else g.ratio('si'), 3, '')} |"
        )
    med = table.median_engine_over_ideal("dsi")
    lines.append("")
    lines.append(
        f"{table.tokens} new tokens; k in {list(table.lookaheads)}; DSI with SP <= {table.max_sp}; offline "
        f"{table.offline_repeats} repeats (time units), event {table.event_repeats} repeats (ms)."
    )
    if med is not None:
        lines.append(f"Median engine/ideal across rows: DSI {med:.3f}, SI {table.median_engine_over_ideal('si'):.3f}.")
    if table.engine_note:
        lines.append(table.engine_note + ".")
    return "\n".join(lines) + "\n"


def plot_table(table: Table, path: Path, dpi: int = 110) -> Path:
    Figure = figure_class()
    labels = [f"{r.paper.target} {r.paper.dataset}" for r in table.rows]
    series = [
        ("paper (published)", [r.paper.paper_speedup for r in table.rows]),
        ("offline simulator", [r.offline.speedup for r in table.rows]),
        ("event simulator", [r.event.speedup for r in table.rows]),
    ]
    if table.has_engine:
        series.append(("engine (wall clock)", [r.engine.speedup if r.engine else np.nan for r in table.rows]))
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    top = max(max(v for v in values if np.isfinite(v)) for _, values in series)
    ax.set_ylim(0, 1.2 * top)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("DSI speedup over SI (x)")
    ax.set_title(f"Table 1: DSI vs SI, {table.tokens} tokens, k in {list(table.lookaheads)}, SP <= {table.max_sp}")
    ax.legend(fontsize=8, ncol=len(series), loc="upper center")
    fig.savefig(path, dpi=dpi)
    return path


def write_table(table: Table, out_dir, plot: bool = True) -> list[Path]:
    out = prepare_out_dir(out_dir)
    files = [write_csv(out / "table1.csv", [r.to_dict() for r in table.rows])]
    md = out / "table1.md"
    md.write_text(to_markdown(table), encoding="utf-8")
    files.append(md)
    if plot:
        files.append(plot_table(table, out / "table1.png"))
    return files
