"""A method's shift detection and adaptation against a stream's known shift points.

A *true shift* is a batch whose domain label differs from the previous batch's (the
stream's first batch is not one: every method starts by perceiving its first domain). A
*perceived shift* (a method's `stats["shift"]`) matches the first unmatched true shift at
or before it and less than `window` batches earlier, and not past the next true shift;
one that matches none is a false alarm (a second detection of the same shift too).
Recall = matched true shifts / true shifts. Backward passes per true shift divide the
backward passes by the segments, true shifts + 1: the first segment is a shift from the
source's clean images too, and each segment may take its adaptation.

`reasons` counts why each backward pass ran (a method's `stats["reason"]`: "shift",
"new_domain", "drift", ...; "" or a missing one is counted as "unknown").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

#: batches after a true shift within which a perceived shift counts as its detection
WINDOW = 3


@dataclass
class ShiftScore:
    """Recall, false alarms and backward passes of one run (module docstring)."""

    batches: int
    true_shifts: int
    detected: int
    false_alarms: int
    perceived: int
    backward: int
    reasons: dict[str, int] = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)  # domains entered without detection
    window: int = WINDOW

    @property
    def recall(self) -> float:
        """Detected / true shifts (NaN without a true shift)."""
        return self.detected / self.true_shifts if self.true_shifts else float("nan")

    @property
    def backward_share(self) -> float:
        """Backward passes per batch."""
        return self.backward / self.batches if self.batches else float("nan")

    @property
    def backward_per_shift(self) -> float:
        """Backward passes per segment (true shifts + 1)."""
        return self.backward / (self.true_shifts + 1) if self.batches else float("nan")

    def to_dict(self) -> dict:
        """JSON-ready, with the derived figures."""
        return {**asdict(self), "recall": self.recall, "backward_share": self.backward_share,
                "backward_per_shift": self.backward_per_shift}


def true_shifts(domains: Sequence[str]) -> list[int]:
    """Batch indices whose domain differs from the previous batch's."""
    return [i for i in range(1, len(domains)) if domains[i] != domains[i - 1]]


def score_shifts(domains: Sequence[str], perceived: Sequence[bool],
                 backward: Sequence[bool] | None = None,
                 reasons: Sequence[str] | None = None, window: int = WINDOW) -> ShiftScore:
    """Score per-batch `perceived` shifts (and `backward` passes with their `reasons`)
    against the batches' `domains`; ValueError when the lengths differ."""
    n = len(domains)
    backward = [False] * n if backward is None else list(backward)
    reasons = [""] * n if reasons is None else list(reasons)
    if not len(perceived) == len(backward) == len(reasons) == n:
        raise ValueError(f"lengths differ: domains {n}, perceived {len(perceived)}, "
                         f"backward {len(backward)}, reasons {len(reasons)}")
    if window < 1:
        raise ValueError(f"window must be >= 1 batch, got {window}")
    starts = true_shifts(domains)
    bounds = [*starts[1:], n]  # a shift's detections stop at the next one
    matched: set[int] = set()
    false_alarms = count = 0
    for b in range(1, n):
        if not perceived[b]:
            continue
        count += 1
        hit = next((s for s, end in zip(starts, bounds, strict=True)
                    if s <= b < min(s + window, end) and s not in matched), None)
        if hit is None:
            false_alarms += 1
        else:
            matched.add(hit)
    why = Counter((r or "unknown") for r, b in zip(reasons, backward, strict=True) if b)
    return ShiftScore(n, len(starts), len(matched), false_alarms, count, sum(map(bool, backward)),
                      dict(sorted(why.items())),
                      [domains[s] for s in starts if s not in matched], window)


def run_meta(batches: Sequence[tuple[str, bool, bool, str]]) -> dict:
    """A bench run's `meta["shifts"]` from its batches' (domain, perceived shift, backward,
    reason)."""
    domains, perceived, backward, reasons = (list(c) for c in zip(*batches, strict=True))
    return score_shifts(domains, perceived, backward, reasons).to_dict()


def shifts_markdown(runs: Sequence) -> str:
    """The report's table of each run's `meta["shifts"]` ('' when no run has one): why
    the backward passes ran, against the stream's known shift points."""
    rows = [(r.method, r.meta["shifts"]) for r in runs if isinstance(r.meta.get("shifts"), dict)]
    if not rows:
        return ""
    lines = ["", "Shifts and backward passes (against the stream's domain changes; a shift "
             f"counts as detected when perceived within {WINDOW} batches of it):", "",
             "| method | true shifts | detected (recall %) | false alarms | backward passes "
             "(% of batches) | per true shift | reasons |", "|---|---|---|---|---|---|---|"]
    for name, s in rows:
        recall = "–" if s["recall"] is None or s["recall"] != s["recall"] else \
            f"{100 * s['recall']:.0f}"
        why = ", ".join(f"{k} {v}" for k, v in s["reasons"].items()) or "–"
        lines.append(f"| {name} | {s['true_shifts']} | {s['detected']} ({recall}) | "
                     f"{s['false_alarms']} | {s['backward']} ({100 * s['backward_share']:.0f}) "
                     f"| {s['backward_per_shift']:.2f} | {why} |")
    return "\n".join(lines) + "\n"
