"""The report shared by `tta bench` and `tta replay`: per-frame records of one run (or of
several methods) -> summary (accuracy per domain in stream order, throughput, latency per
phase, end-to-end latency, peak memory) -> JSON + markdown table. The PNG plots come
from tta_core.eval.report_plots; tta_core.eval.report_files writes all of them.

Latency parts are per batch: every frame of a batch carries the same `phases_ms`,
`budget_ms` and `batch_id`, and phase statistics count each batch once. A method with a
latency budget (AdaShadow's sigma * T) is also scored by how many of its batches held it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tta_core.io.strict_json import write_json

PHASES: tuple[str, ...] = ("forward", "plan", "backward", "reforward")
"""Phases stacked in the latency plot, in pipeline order; `total` is reported alongside."""


@dataclass
class FrameRecord:
    """One frame of a stream: ground truth, prediction and the latency of its batch."""

    domain: str
    label: int
    prediction: int
    batch_id: int = -1  # -1: unknown, the frame counts as a batch of its own
    phases_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: float = math.nan  # image stamp -> prediction received (replay only)
    stamp_ns: int = 0
    confidence: float = math.nan
    budget_ms: float = math.nan  # the batch's latency budget; NaN: the method has none
    adapted: bool | None = None  # did the batch update the model (None: not reported)
    recognised: str = ""  # the domain the method recognised for the batch ("": none)


@dataclass
class RunRecord:
    """All frames of one method over one stream, plus run-level measurements."""

    method: str
    frames: list[FrameRecord] = field(default_factory=list)
    wall_s: float = math.nan  # wall time of the stream, for throughput
    peak_memory_mb: float = math.nan
    frames_dropped: int = 0
    meta: dict[str, object] = field(default_factory=dict)


@dataclass
class Stats:
    """Distribution summary of a latency, in ms."""

    n: int
    mean: float
    p50: float
    p90: float
    max: float


@dataclass
class Segment:
    """A contiguous run of frames of one domain: the x axis of accuracy over time."""

    domain: str
    start: int
    stop: int
    accuracy: float


@dataclass
class RunSummary:
    """Summary numbers of one run; `accuracy` keys follow the stream order of domains."""

    method: str
    n_frames: int
    n_batches: int
    accuracy: dict[str, float]
    mean_accuracy: float  # mean over domains (AdaShadow Table 5 style)
    overall_accuracy: float  # over all frames
    throughput_fps: float
    phases: dict[str, Stats]
    e2e: Stats | None
    peak_memory_mb: float
    frames_dropped: int
    segments: list[Segment]
    # fraction of the batches with a budget whose total time held it (NaN: no budget)
    within_budget: float = math.nan
    # fraction of the batches that updated the model (NaN: not reported)
    adapted: float = math.nan
    # saved activations per batch, MiB (NaN: not measured; bench --measure-activations)
    saved_mib_mean: float = math.nan
    saved_mib_max: float = math.nan
    # share of batches whose saved activations held `tta bench --memory-budget-mb` (NaN: none)
    saved_within_budget: float = math.nan
    # domains the method recognised, and the share of batches whose recognised domain is
    # the true domain most of its batches came from (NaN: the method recognises none)
    domains_found: int = 0
    domain_purity: float = math.nan


# ----------------------------------------------------------------------------- summary


def latency_stats(values: Iterable[float]) -> Stats | None:
    """Mean, p50, p90 and max of the finite `values`; None when there are none."""
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return None
    p50, p90 = np.percentile(arr, [50, 90])
    return Stats(int(arr.size), float(arr.mean()), float(p50), float(p90), float(arr.max()))


def domain_segments(frames: Sequence[FrameRecord]) -> list[Segment]:
    """Contiguous same-domain runs of `frames` with their accuracy, in stream order."""
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(frames) + 1):
        if i == len(frames) or frames[i].domain != frames[start].domain:
            part = frames[start:i]
            acc = sum(f.prediction == f.label for f in part) / len(part)
            segments.append(Segment(frames[start].domain, start, i, acc))
            start = i
    return segments


def _accuracy_by_domain(frames: Sequence[FrameRecord]) -> dict[str, float]:
    correct: dict[str, int] = {}
    total: dict[str, int] = {}
    for f in frames:  # dicts keep first-appearance order = stream order
        total[f.domain] = total.get(f.domain, 0) + 1
        correct[f.domain] = correct.get(f.domain, 0) + int(f.prediction == f.label)
    return {d: correct[d] / total[d] for d in total}


def _batches(frames: Sequence[FrameRecord]) -> list[FrameRecord]:
    """The first frame of every batch (frames with batch_id -1 are batches of their own)."""
    seen: set[int] = set()
    out: list[FrameRecord] = []
    for f in frames:
        if f.batch_id < 0 or f.batch_id not in seen:
            seen.add(f.batch_id)
            out.append(f)
    return out


def _share(flags: Iterable[bool | None]) -> float:
    known = [bool(f) for f in flags if f is not None]
    return sum(known) / len(known) if known else math.nan


def domain_purity(batches: Sequence[FrameRecord]) -> tuple[int, float]:
    """(recognised domains, purity): each recognised domain stands for the true domain most
    of its batches came from; purity is the share of batches with a recognised domain
    whose true domain is that one (NaN when no batch has one)."""
    votes: dict[str, dict[str, int]] = {}
    for f in batches:
        if f.recognised:
            by_true = votes.setdefault(f.recognised, {})
            by_true[f.domain] = by_true.get(f.domain, 0) + 1
    n = sum(sum(v.values()) for v in votes.values())
    if not n:
        return 0, math.nan
    return len(votes), sum(max(v.values()) for v in votes.values()) / n


def within_budget(batches: Sequence[FrameRecord]) -> float:
    """Fraction of the batches with a finite budget whose total time was within it."""
    pairs = [(f.phases_ms.get("total", math.nan), f.budget_ms) for f in batches
             if math.isfinite(f.budget_ms) and f.budget_ms > 0]
    if not pairs:
        return math.nan
    return sum(t <= b for t, b in pairs) / len(pairs)


def summarize(run: RunRecord) -> RunSummary:
    """Summary of `run`; raises ValueError on a run without frames."""
    frames = run.frames
    if not frames:
        raise ValueError(f"run {run.method!r} has no frames to summarise")
    acc = _accuracy_by_domain(frames)
    firsts = _batches(frames)
    batches = [f.phases_ms for f in firsts]
    names = [p for p in (*PHASES, "total") if any(p in b for b in batches)]
    names += sorted({k for b in batches for k in b} - set(names))
    phases = {p: latency_stats(b.get(p, math.nan) for b in batches) for p in names}
    wall = run.wall_s
    saved = run.meta.get("saved_activations")
    saved = saved if isinstance(saved, dict) else {}
    found, purity = domain_purity(firsts)
    return RunSummary(
        method=run.method,
        n_frames=len(frames),
        n_batches=len(batches),
        accuracy=acc,
        mean_accuracy=float(np.mean(list(acc.values()))),
        overall_accuracy=sum(f.prediction == f.label for f in frames) / len(frames),
        throughput_fps=len(frames) / wall if wall > 0 else math.nan,
        phases={p: s for p, s in phases.items() if s is not None},
        e2e=latency_stats(f.e2e_ms for f in frames),
        peak_memory_mb=run.peak_memory_mb,
        frames_dropped=run.frames_dropped,
        segments=domain_segments(frames),
        within_budget=within_budget(firsts),
        adapted=_share(f.adapted for f in firsts),
        saved_mib_mean=_num(saved.get("saved_mib_mean")),
        saved_mib_max=_num(saved.get("saved_mib_max")),
        saved_within_budget=_num(saved.get("within_budget_share")),
        domains_found=found,
        domain_purity=purity,
    )


def _num(v: object) -> float:
    """A JSON number, NaN for None (a missing or non-finite figure)."""
    return math.nan if v is None else float(v)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- files


def _fmt(v: float, spec: str = ".1f") -> str:
    return "–" if v is None or not math.isfinite(v) else format(v, spec)


def markdown_table(summaries: Sequence[RunSummary]) -> str:
    """Markdown table: one row per method, accuracy (%) per domain, mean, latency, memory;
    the column "saved MiB (mean/max)" only when some run measured saved activations."""
    domains: list[str] = []
    for s in summaries:
        domains += [d for d in s.accuracy if d not in domains]
    saved = any(math.isfinite(s.saved_mib_mean) for s in summaries)
    mem = any(math.isfinite(s.saved_within_budget) for s in summaries)
    dom = any(s.domains_found for s in summaries)
    head = ["method", *domains, "mean", "fps", "total ms p50", "in budget %", "adapted %",
            "e2e ms p50", "e2e ms p90", "peak MB", *(["saved MiB (mean/max)"] if saved else []),
            *(["in mem budget %"] if mem else []),
            *(["domains found", "domain purity %"] if dom else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        total = s.phases.get("total")
        row = [s.method, *(_fmt(100 * s.accuracy[d]) if d in s.accuracy else "–"
                           for d in domains)]
        row += [_fmt(100 * s.mean_accuracy), _fmt(s.throughput_fps),
                _fmt(total.p50 if total else math.nan, ".2f"), _fmt(100 * s.within_budget, ".0f"),
                _fmt(100 * s.adapted, ".0f"),
                _fmt(s.e2e.p50 if s.e2e else math.nan, ".2f"),
                _fmt(s.e2e.p90 if s.e2e else math.nan, ".2f"), _fmt(s.peak_memory_mb, ".0f")]
        if saved:
            row.append(f"{_fmt(s.saved_mib_mean, '.2f')} / {_fmt(s.saved_mib_max, '.2f')}")
        if mem:
            row.append(_fmt(100 * s.saved_within_budget, ".0f"))
        if dom:
            row += [str(s.domains_found) if s.domains_found else "–",
                    _fmt(100 * s.domain_purity, ".0f")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def lr_markdown(runs: Sequence[RunRecord]) -> str:
    """Markdown table of the learning rate each run's method ran with (run.meta["lr"]:
    the configured lr at its reference batch, the effective rate per batch size); '' when
    no run records one (replays). Methods without an optimizer (lr None) show '–'."""
    if not any("lr" in r.meta for r in runs):
        return ""
    lines = ["", "Learning rate (SGD): lr is the rate at batch `lr_ref_batch`; each step runs "
             "with lr × batch / lr_ref_batch (lr itself when lr_ref_batch is 0). Memory "
             "format: the one the method measured faster at build (memory_format auto).", "",
             "| method | lr | lr_ref_batch | effective lr | memory format |",
             "|---|---|---|---|---|"]
    for r in runs:
        lr, fmt = r.meta.get("lr"), r.meta.get("memory_format") or "–"
        if not isinstance(lr, dict):
            lines.append(f"| {r.method} | – | – | – (no optimizer) | {fmt} |")
            continue
        eff = "; ".join(f"{float(v):.3g} at batch {b}" for b, v in dict(lr["effective"]).items())
        lines.append(f"| {r.method} | {float(lr['lr']):.3g} | {lr['ref_batch'] or 'off'} "
                     f"| {eff} | {fmt} |")
    return "\n".join(lines) + "\n"


def gain_over_source(summaries: Sequence[RunSummary]) -> dict[str, dict[str, float]]:
    """Per method other than "source": its accuracy minus source's, in points (100 x share),
    per domain source also ran and "mean" (mean over domains); {} without a source run."""
    src = next((s for s in summaries if s.method == "source"), None)
    if src is None:
        return {}
    out: dict[str, dict[str, float]] = {}
    for s in summaries:
        if s is src:
            continue
        gain = {d: 100 * (a - src.accuracy[d]) for d, a in s.accuracy.items()
                if d in src.accuracy}
        out[s.method] = {**gain, "mean": 100 * (s.mean_accuracy - src.mean_accuracy)}
    return out


def gain_markdown(summaries: Sequence[RunSummary]) -> str:
    """Markdown table of `gain_over_source` ('' without a source run or another method)."""
    gains = gain_over_source(summaries)
    if not gains:
        return ""
    cols = list(next(iter(gains.values())))
    lines = ["", "Accuracy gained over source, in points:", "",
             "| method | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    lines += [f"| {m} | " + " | ".join(f"{g[c]:+.1f}" if c in g else "–" for c in cols) + " |"
              for m, g in gains.items()]
    return "\n".join(lines) + "\n"


def layer_updates_markdown(runs: Sequence[RunRecord]) -> str:
    """Which layers each run's batches updated and how often (run.meta["layer_updates"],
    recorded by a replay: tta_ros.replay.layer_updates); '' when no run has it."""
    lines: list[str] = []
    for r in runs:
        lu = r.meta.get("layer_updates")
        if r.method == "source" or not isinstance(lu, dict) or not lu.get("batches"):
            continue
        n, units = int(lu["batches"]), dict(lu.get("units") or {})
        lines += ["", f"Layers {r.method} updated: {int(lu['adapted'])} of {n} batches adapted "
                  f"({100 * int(lu['adapted']) / n:.0f} %), "
                  f"{float(lu.get('units_updated_mean') or 0):.1f} units per batch on average"
                  + (f"; {int(lu['unnamed'])} adapted batch(es) planned inline, their units "
                     "unnamed" if lu.get("unnamed") else "") + "."]
        if units:
            lines += ["", "| layer | batches updated | % of batches |", "|---|---|---|"]
            lines += [f"| {u} | {k} | {100 * k / n:.0f} |" for u, k in units.items()]
    return "\n".join(lines) + "\n" if lines else ""


def write_json_atomic(path: Path, data: object) -> None:
    """Write `data` as strict JSON (NaN -> null) to `path` via a temporary file, so a crash
    never leaves half a file (used for the partial results flushed during a replay)."""
    write_json(path, data)


def report_dict(runs: Sequence[RunRecord], include_frames: bool = True) -> dict[str, object]:
    """JSON-ready content of a report: summaries, run metadata and (optionally) frames."""
    summaries = [summarize(r) for r in runs if r.frames]
    return {
        "summaries": [asdict(s) for s in summaries],
        "gain_over_source": gain_over_source(summaries),
        "runs": [
            {"method": r.method, "wall_s": r.wall_s, "peak_memory_mb": r.peak_memory_mb,
             "frames_dropped": r.frames_dropped, "meta": r.meta,
             **({"frames": [asdict(f) for f in r.frames]} if include_frames else {})}
            for r in runs
        ],
    }


def load_runs(path: str | Path) -> list[RunRecord]:
    """Runs (with frames) back from a report JSON written by `write_report`."""
    data = json.loads(Path(path).read_text())

    def nan(v: object) -> float:
        return math.nan if v is None else float(v)  # type: ignore[arg-type]

    runs = []
    for r in data["runs"]:
        frames = [FrameRecord(**{**f, "e2e_ms": nan(f["e2e_ms"]),
                                 "confidence": nan(f["confidence"]),
                                 "budget_ms": nan(f.get("budget_ms")),
                                 "phases_ms": {k: nan(v) for k, v in f["phases_ms"].items()}})
                  for f in r.get("frames", [])]
        runs.append(RunRecord(r["method"], frames, nan(r["wall_s"]), nan(r["peak_memory_mb"]),
                              int(r["frames_dropped"]), dict(r["meta"])))
    return runs
