"""A sweep's cells as statistics: per method and condition the mean and 95 % confidence
interval over seeds (Student t), and paired differences against a baseline method (paired
by seed within a condition; two-sided paired t-test, marked `*` at p < 0.05)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scipy import stats

from tta_core.sweep.spec import Cell

#: the figures aggregated, as (name, where in a cell result)
METRICS = ("mean_accuracy", "overall_accuracy", "within_budget", "adapted")
#: a segmentation cell's figures (eval.seg_bench.sweep_summaries), and its `miou@<condition>`
SEG_METRICS = ("mean_miou", "online_error", "cache_mib", "cache_peak_mib")
STREAM_METRICS = ("strict", "streaming", "deadline_met")


@dataclass(frozen=True)
class Interval:
    """Mean and 95 % confidence interval over `n` values (half-width NaN when n < 2)."""

    mean: float
    half_width: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width


def mean_ci(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean and the t-interval half-width of `values` (NaN-free)."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, 0)
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, math.nan, 1)
    sd = statistics.stdev(values)  # exact for equal values (scipy's warns and rounds)
    return Interval(mean, float(stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)), n)


@dataclass(frozen=True)
class Paired:
    """method − baseline over the seeds both ran: the difference's interval and p-value."""

    diff: Interval
    p_value: float

    @property
    def marker(self) -> str:
        return "*" if self.p_value < 0.05 else ""


def paired(values: Sequence[float], base: Sequence[float]) -> Paired:
    """Paired difference of equal-length, seed-aligned samples."""
    diffs = [a - b for a, b in zip(values, base, strict=True)]
    if len(diffs) < 2:
        return Paired(mean_ci(diffs), math.nan)
    if all(d == diffs[0] for d in diffs):  # no spread: t undefined
        return Paired(mean_ci(diffs), 0.0 if diffs[0] != 0 else 1.0)
    return Paired(mean_ci(diffs), float(stats.ttest_rel(values, base).pvalue))


@dataclass(frozen=True)
class Sample:
    """One method's figure in one cell."""

    condition: tuple[tuple[str, Any], ...]
    method: str
    seed: int
    metric: str
    value: float


def samples(results: Iterable[dict[str, Any]]) -> list[Sample]:
    """Every finite figure of every finished cell (summaries and streaming rows)."""
    out = []
    for res in results:
        if res.get("status") != "done":
            continue
        opts = res["options"]
        cond = Cell(tuple(opts.items())).condition
        seed = int(opts.get("seed", 0))
        for s in res["summaries"]:
            per_condition = tuple(k for k in s if k.startswith("miou@"))
            for m in (*METRICS, *SEG_METRICS, *per_condition):
                v = s.get(m)
                if isinstance(v, int | float) and math.isfinite(v):
                    out.append(Sample(cond, s["method"], seed, m, float(v)))
        for r in res.get("streaming", []):
            for m in STREAM_METRICS:
                v = r.get(m)
                if isinstance(v, int | float) and math.isfinite(v):
                    out.append(Sample(cond, r["method"], seed, f"{m}@{r['hz']:g}Hz", float(v)))
    return out


@dataclass(frozen=True)
class Row:
    """Aggregated figure of one method under one condition."""

    condition: dict[str, Any]
    method: str
    metric: str
    ci: Interval
    vs_baseline: Paired | None

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci"] = {"mean": self.ci.mean, "half_width": self.ci.half_width, "n": self.ci.n}
        if self.vs_baseline is not None:
            b = self.vs_baseline
            d["vs_baseline"] = {"diff": b.diff.mean, "half_width": b.diff.half_width,
                                "n": b.diff.n, "p_value": b.p_value, "marker": b.marker}
        return d


def aggregate(all_samples: Sequence[Sample], baseline: str = "") -> list[Row]:
    """Rows per (condition, method, metric), each with its paired test when a baseline
    ran under the same condition on common seeds."""
    groups: dict[tuple, dict[int, float]] = defaultdict(dict)
    for s in all_samples:
        groups[(s.condition, s.method, s.metric)][s.seed] = s.value
    rows = []
    for (cond, method, metric), by_seed in groups.items():
        seeds = sorted(by_seed)
        vs = None
        base = groups.get((cond, baseline, metric)) if baseline and method != baseline else None
        if base:
            common = [k for k in seeds if k in base]
            if common:
                vs = paired([by_seed[k] for k in common], [base[k] for k in common])
        rows.append(Row(dict(cond), method, metric, mean_ci([by_seed[k] for k in seeds]), vs))
    return rows
