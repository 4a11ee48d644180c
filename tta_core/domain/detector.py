"""Online shift and domain detection on batch embeddings (tta_core.domain.embedding).

Known domains and the distance d_j of a batch to each are in `tta_core.domain.table`
(standardised Euclidean, about 1 within a domain). Decision per batch:

- candidate = the nearest domain, or NEW when every d_j exceeds the novelty threshold;
- hysteresis: the active domain changes only after `hysteresis` consecutive batches away
  from it (or at once when the nearest known domain is within `confident` x the
  threshold and the active one beyond the threshold: a recurring domain is recognised
  on its first batch; a single outlier batch of a novel or a less close domain never
  switches, and is not absorbed); the target is the known domain nearest to those
  batches' mean, if within the threshold, else NEW after `novel_hysteresis` such
  batches (a spurious domain costs more than a late new one); the
  away batches must agree with each other (`DomainTable.pair_distance`), so an outlier
  followed by the next domain's first batch does not found a mixed domain;
- a persisting NEW candidate becomes a domain (centroid and spreads from those batches),
  named "d0", "d1", ... in order of creation (names are never reused);
- batches of the active domain update its statistics; the novelty threshold follows the
  measured within-domain spread: `novelty_margin` times the `novelty_quantile` (median)
  of recent in-domain distances (distances, before the update, of batches that stayed in
  a domain with >= `calib_after` batches); `novelty_default` until `calib_min` are known.
  The median, not a high quantile: only accepted batches are recorded, so a high
  quantile is truncated by the threshold itself and ratchets it down (within a couple of
  passes, until in-domain batches split off as spurious domains);
- the first `warmup` batches all belong to the first domain (`warmup_pooled` without
  within-batch spreads: the spread is then learnt from those batches only);
- at most `max_domains`: creating one more evicts the least recently active (LRU).

benchmarks/domains/bench_domain.py measures the recognition, with domains learnt online from
nothing and enrolled from a labelled pass (`enroll`, DARDA's offline phase). What it
misses: similar corruptions merge online (impulse into Gaussian noise, motion into glass
blur), and the first batch after each shift (the hysteresis delay), which bounds
recognition on a stream of distinct corruptions. Tried and dropped: a pooled spread (young
blur domains split), a high quantile for the threshold (see above), a test on the mean of
the last few batches to separate similar corruptions (split domains).

Deterministic (float64 on the CPU), O(domains x dim) per batch; the scalars a batch's
decision needs are read from their tensors in one transfer (`DomainDetector._scalars`).

Shift test (`ShiftTest`, both darda variants): which domain a batch belongs to is the
detector's question; *whether the stream changed* is a change-point test of its own, so
that a shift between two corruptions the domain table merges (three noises in one domain)
is still perceived. Its reference is the current segment (the batches since the last
shift, the latest `window`); a batch is *away* when

    s = mean_i (e_i - m_i)^2 / (W_i (1 + 1/n)),  W = (n W_seg + n0 W_stream) / (n + n0),

exceeds `threshold` (m: the reference's mean, W_seg its batches' mean within-batch spread,
W_stream the stream's, n0 = `prior_weight`: the spread of a reference of a few batches of
4 samples is itself uncertain). `confirm` away batches in a row are a shift (the new
segment starts with them), and so is one batch beyond `instant` x threshold (a shift
between two noises whose later batches hardly differ: the first batch of the new noise
can be far, the next ones close); an away batch followed by one that is not is an outlier
and joins the reference. A segment is tested once it has `min_reference` batches (a
reference of one or two batches flagged its own next batches as away, on blur segments
above all). Without within-batch spreads (batches of one sample, pooled moments) the
reference's own batch-to-batch variance stands in for W. `score_shifts`
(tta_core.eval.shifts) measures recall and false alarms against known shift points.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from tta_core.domain.table import F64, DomainTable

NEW = -1  # candidate index meaning "a domain not seen yet"
Batch = tuple[Tensor, Tensor | None]  # (embedding, within-batch spread)


@dataclass
class DetectorConfig:
    """Detection settings (defaults measured in benchmarks/domains/bench_domain.py)."""

    hysteresis: int = 2  # consecutive batches away from the active domain before a switch
    novel_hysteresis: int = 2  # ... before a switch to a new domain
    confident: float = 0.8  # no hysteresis when nearest <= this x threshold (0: never)
    novelty_quantile: float = 0.5  # of in-domain distances, for the novelty threshold
    novelty_margin: float = 1.5  # threshold = margin * that quantile
    novelty_default: float = 1.5  # threshold until calib_min in-domain distances exist
    calib_min: int = 16
    calib_window: int = 512  # in-domain distances kept for calibration
    calib_after: int = 4  # a domain's distances count once it has this many batches
    alpha: float = 0.05  # EMA rate of centroids and spreads (after 1/alpha batches)
    prior_weight: float = 2.0  # pseudo-count of the prior spread in a domain's spread
    within_scale: float = 1.0  # prior spread = this x the mean within-batch spread
    warmup: int = 2  # first batches: all the first domain
    warmup_pooled: int = 8  # the same without within-batch spreads (the spread is learnt)
    max_domains: int = 32
    var_floor: float = 1e-8

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        checks = [("hysteresis", self.hysteresis >= 1),
                  ("novel_hysteresis", self.novel_hysteresis >= self.hysteresis),
                  ("confident", 0 <= self.confident < 1),
                  ("alpha", 0 < self.alpha <= 1),
                  ("novelty_quantile", 0 < self.novelty_quantile <= 1),
                  ("novelty_margin", self.novelty_margin > 0),
                  ("novelty_default", self.novelty_default > 0),
                  ("calib_min", self.calib_min >= 1),
                  ("calib_window", self.calib_window >= self.calib_min),
                  ("calib_after", self.calib_after >= 1),
                  ("prior_weight", self.prior_weight >= 0),
                  ("within_scale", self.within_scale > 0), ("warmup", self.warmup >= 1),
                  ("warmup_pooled", self.warmup_pooled >= 1),
                  ("max_domains", self.max_domains >= 2), ("var_floor", self.var_floor > 0)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"detector {name}={getattr(self, name)!r} is out of range")


@dataclass
class Detection:
    """What one batch did to the detector."""

    domain: str  # active domain after this batch
    previous: str  # active domain before it ("" on the first batch)
    distance: float  # to the active domain's centroid before this batch (nan: none)
    nearest: str  # nearest known domain before this batch ("" when none)
    nearest_distance: float
    threshold: float  # novelty threshold in force
    novel: bool  # farther than the threshold from every known domain
    switched: bool = False  # the active domain changed on this batch
    created: bool = False  # the active domain was created on this batch
    evicted: str = ""  # domain dropped (LRU) to make room for a new one


@dataclass
class _Scalars:
    """A batch's decision inputs on the host (`DomainDetector._scalars`)."""

    distances: list[float]
    near: int  # nearest domain (-1: none known)
    threshold: float
    alone: tuple[int, float] = (-1, math.inf)  # vote target of this batch alone
    pair: float = math.nan  # distance to the previous away batch
    joined: tuple[int, float] = (-1, math.inf)  # vote target of the run with this batch


def _calibrated(values: Tensor, q: float, margin: float, default: float, n_min: int) -> float:
    if values.numel() < n_min:
        return default
    return margin * float(torch.quantile(values, q))


class DomainDetector:
    """Hysteresis and novelty decisions over a DomainTable (see the module docstring)."""

    def __init__(self, dim: int, config: DetectorConfig | None = None) -> None:
        self.config = c = config if config is not None else DetectorConfig()
        c.validate()
        self.table = DomainTable(dim, c.alpha, c.prior_weight, c.within_scale, c.var_floor)
        self.own = torch.zeros(0, dtype=F64)  # recent in-domain batch distances
        self.current, self.batches, self.next_id = -1, 0, 0
        self._streak = 0
        self._buffer: list[Batch] = []  # consecutive batches away from the active domain

    @property
    def dim(self) -> int:
        """Embedding dimension."""
        return self.table.dim

    @property
    def names(self) -> list[str]:
        """Known domains in creation order."""
        return self.table.names

    @property
    def current_name(self) -> str:
        """The active domain's name ('' before the first batch)."""
        return self.names[self.current] if self.current >= 0 else ""

    def threshold(self) -> float:
        """Per-batch novelty threshold (see the module docstring)."""
        c = self.config
        return _calibrated(self.own, c.novelty_quantile, c.novelty_margin, c.novelty_default,
                           c.calib_min)

    def assess(self, e: Tensor) -> tuple[int, float, bool]:
        """(nearest row or NEW, its distance, novel) without changing anything."""
        d = self.table.distances(self._check(e))
        if d.numel() == 0:
            return NEW, math.inf, True
        j = int(torch.argmin(d))
        novel = float(d[j]) > self.threshold()
        return (NEW if novel else j), float(d[j]), novel

    # ------------------------------------------------------------------ bookkeeping
    def _check(self, e: Tensor) -> Tensor:
        if e.ndim != 1 or e.numel() != self.dim:
            raise ValueError(f"embedding must be a vector of {self.dim}, got {tuple(e.shape)}")
        e = e.detach().to(F64, copy=False)
        return e if e.device.type == "cpu" else e.cpu()

    def _absorb(self, j: int, batches: list[Batch]) -> None:
        for e, w in batches:
            self.table.absorb(j, e, w, self.batches)

    def _mature(self, j: int) -> bool:
        return self.table.count(j) >= self.config.calib_after

    def _record(self, d: float) -> None:
        kept = torch.cat([self.own, torch.tensor([d], dtype=F64)])
        self.own = kept[-self.config.calib_window:]

    def add_domain(self, name: str | None = None) -> tuple[int, str]:
        """A new empty domain (named d<k> unless `name`); returns (row, evicted name)."""
        evicted = ""
        if len(self.table) >= self.config.max_domains:
            evicted = self.remove(self.names[self.table.lru(self.current)])
        if name is None:
            name, self.next_id = f"d{self.next_id}", self.next_id + 1
        return self.table.add(name, self.batches), evicted

    def remove(self, name: str) -> str:
        """Forget domain `name` (not the active one); returns the name."""
        j = self.table.index(name)
        if j == self.current:
            raise ValueError(f"cannot remove the active domain {name!r}")
        self.table.remove(j)
        self.current -= int(self.current > j)
        return name

    def enroll(self, name: str, embeddings: Tensor, within: Tensor | None = None) -> None:
        """Supervised: add (or extend) domain `name` with labelled embeddings [n, dim]
        (and their within-batch spreads, same shape)."""
        if embeddings.ndim != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings must be [n, {self.dim}], got {tuple(embeddings.shape)}")
        j = self.names.index(name) if name in self.names else self.add_domain(name)[0]
        ws = [None] * len(embeddings) if within is None else list(within.to(F64))
        for e, w in zip(embeddings, ws, strict=True):  # calibrates as online batches would
            if self._mature(j):
                self._record(float(self.table.distances(e.to(F64))[j]))
            self._absorb(j, [(e.to(F64), w)])

    # ------------------------------------------------------------------ the decision
    def observe(self, e: Tensor, within: Tensor | None = None) -> Detection:
        """Assign one batch embedding (`within`: its sampling spread, if known); may switch
        or create the active domain."""
        e = self._check(e)
        w = None if within is None else self._check(within)
        self.batches += 1
        prev = self.current_name
        s = self._scalars(e, w)
        d, near, thr = s.distances, s.near, s.threshold
        near_d = d[near] if near >= 0 else math.nan
        cur_d = d[self.current] if self.current >= 0 else math.nan
        det = Detection(prev, prev, cur_d, self.names[near] if near >= 0 else "", near_d,
                        thr, near < 0 or near_d > thr)
        if self.current < 0:  # first batch: a known (enrolled or loaded) domain, else new
            return self._switch(NEW if det.novel else near, [(e, w)], det)
        if self.batches <= (self.config.warmup if w is not None else self.config.warmup_pooled):
            self._absorb(self.current, [(e, w)])
            return det
        cand = NEW if det.novel else near
        if cand == self.current:
            self._streak, self._buffer = 0, []
            if self._mature(self.current):
                self._record(cur_d)
            self._absorb(self.current, [(e, w)])
            return det
        return self._vote(cand, (e, w), det, s)

    def _scalars(self, e: Tensor, w: Tensor | None) -> _Scalars:
        """Everything a batch's decision reads, in one `tolist`: the distances to every
        domain and the nearest, the novelty threshold's quantile, and for a vote (`_vote`)
        the agreement with the previous away batch and the known domain other than the
        active one nearest to the away batches' mean, with or without the earlier ones."""
        c, t = self.config, self.table
        d = t.distances(e)
        n = d.numel()
        pieces = [d]
        if n:
            pieces.append(torch.argmin(d).reshape(1).to(F64))
        calibrated = self.own.numel() >= c.calib_min
        if calibrated:
            pieces.append(torch.quantile(self.own, c.novelty_quantile).reshape(1))
        vote = n > 0 and 0 <= self.current < n
        if vote:
            alone = d.clone()  # the mean of this batch alone is this batch
            alone[self.current] = math.inf
            pieces.append(torch.argmin(alone).reshape(1).to(F64))
        run = vote and bool(self._buffer)
        if run:
            last, w_last = self._buffer[-1]
            dm = t.distances(torch.stack([x for x, _ in self._buffer] + [e]).mean(0))
            dm[self.current] = math.inf
            jm = torch.argmin(dm).reshape(1)
            pieces += [t.pair_distances(last, w_last, e, w).reshape(1), jm.to(F64),
                       dm.gather(0, jm)]
        v = torch.cat(pieces).tolist() if len(pieces) > 1 else []  # none: nothing known
        out = _Scalars(v[:n], int(v[n]) if n else -1, c.novelty_default)
        k = n + 1 if n else 0
        if calibrated:
            out.threshold, k = c.novelty_margin * v[k], k + 1
        if vote:
            j = int(v[k])
            out.alone, k = (j, math.inf if j == self.current else v[j]), k + 1
        if run:
            out.pair, out.joined = v[k], (int(v[k + 1]), v[k + 2])
        return out

    def _vote(self, cand: int, batch: Batch, det: Detection, s: _Scalars) -> Detection:
        """A batch away from the active domain; after `hysteresis` in a row, switch to the
        known domain nearest to their mean if it is within the threshold, else to a new one
        (so a run that alternates between a known candidate and NEW still switches)."""
        joined = bool(self._buffer)
        if joined and s.pair > det.threshold:  # away batches must agree, or the run
            self._streak, self._buffer, joined = 0, [], False  # restarts from this one
        self._streak += 1
        self._buffer.append(batch)
        if self._streak < self.config.hysteresis and not self._sure(cand, det):
            return det
        j, dj = s.joined if joined else s.alone
        if dj <= det.threshold:
            return self._switch(j, self._buffer, det)
        if self._streak < self.config.novel_hysteresis:
            return det
        return self._switch(NEW, self._buffer, det)

    def _sure(self, cand: int, det: Detection) -> bool:
        """A known domain with >= `calib_after` batches so close (<= `confident` x
        threshold) while the active one is beyond the threshold that one batch decides:
        the switch batch itself is then served by the recognised state."""
        c = self.config
        return cand != NEW and self._mature(cand) and det.distance > det.threshold \
            and det.nearest_distance <= c.confident * det.threshold

    def _switch(self, target: int, batches: list[Batch], det: Detection) -> Detection:
        """Make `target` (a row, or NEW) active and give it `batches`."""
        if target == NEW:
            target, det.evicted = self.add_domain()
            det.created = True
        self.current = target
        self._absorb(target, batches)
        self._streak, self._buffer = 0, []
        det.switched, det.domain = True, self.current_name
        return det

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """(tensors, JSON-able metadata) of the learnt state; pending votes are transient
        and not included."""
        t = self.table
        tensors = {"centroids": t.centroids, "spreads": t.spreads, "within": t.within,
                   "counts": t.counts, "last_used": t.last_used, "own": self.own}
        meta = {"names": list(t.names), "current": self.current, "batches": self.batches,
                "next_id": self.next_id, "dim": self.dim, "config": asdict(self.config)}
        return {k: v.detach().clone().contiguous() for k, v in tensors.items()}, meta

    def load_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Restore `state()`; ValueError naming what does not fit."""
        n, dim = len(meta["names"]), int(meta["dim"])
        if dim != self.dim:
            raise ValueError(f"detector state has embedding dim {dim}, expected {self.dim}")
        shapes = {"centroids": (n, dim), "spreads": (n, dim), "within": (n, dim),
                  "counts": (n,), "last_used": (n,)}
        for k, shape in shapes.items():
            if tuple(tensors[k].shape) != shape:
                raise ValueError(f"detector {k} has shape {tuple(tensors[k].shape)}, "
                                 f"expected {shape}")
        t = self.table
        t.names = [str(x) for x in meta["names"]]
        for k in ("centroids", "spreads", "within", "counts"):
            setattr(t, k, tensors[k].to(F64).clone())
        t.last_used = tensors["last_used"].to(torch.int64).clone()
        self.own = tensors["own"].to(F64).clone()
        self.current = int(meta["current"]) if -1 <= int(meta["current"]) < n else -1
        self.batches, self.next_id = int(meta["batches"]), int(meta["next_id"])
        self._streak, self._buffer = 0, []


# ---------------------------------------------------------------------- the shift test
@dataclass
class ShiftConfig:
    """Change-point test settings (module docstring, "Shift test"; defaults measured in
    benchmarks/domains/bench_darda_realtime.py)."""

    threshold: float = 3.0  # mean standardised square above which a batch is away
    confirm: int = 2  # away batches in a row that make a shift
    instant: float = 5.0  # ... or one batch beyond this times the threshold (0: never)
    min_reference: int = 3  # batches of a segment before it is tested
    window: int = 16  # latest batches of the segment in the reference
    prior_weight: float = 2.0  # pseudo-count of the stream's within-batch spread
    dims: int = 0  # leading embedding dimensions read (0: all)
    var_floor: float = 1e-12

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        checks = [("threshold", self.threshold > 0), ("confirm", self.confirm >= 1),
                  ("instant", self.instant == 0 or self.instant >= 1),
                  ("min_reference", self.min_reference >= 1),
                  ("window", self.window >= self.min_reference),
                  ("prior_weight", self.prior_weight >= 0), ("dims", self.dims >= 0),
                  ("var_floor", self.var_floor > 0)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"shift test {name}={getattr(self, name)!r} is out of range")


@dataclass
class ShiftDecision:
    """What one batch did to the shift test."""

    score: float  # s of the module docstring (NaN: not tested, the segment is too young)
    away: bool  # s above the threshold
    shift: bool  # the confirm-th away batch in a row: the stream changed


class ShiftTest:
    """Online change-point test on batch embeddings (module docstring, "Shift test")."""

    def __init__(self, config: ShiftConfig | None = None) -> None:
        self.config = config if config is not None else ShiftConfig()
        self.config.validate()
        self.fresh()

    def fresh(self) -> None:
        """Forget the stream: no segment, no spreads seen."""
        self._ref: deque[Batch] = deque(maxlen=self.config.window)
        self._away: list[Batch] = []
        self._within_sum: Tensor | None = None
        self._within_n = 0
        self._last: Batch | None = None
        self.batches = 0
        self.shifts = 0

    @property
    def segment_batches(self) -> int:
        """Batches in the reference (at most `window`)."""
        return len(self._ref)

    def _cut(self, e: Tensor, w: Tensor | None) -> Batch:
        d = self.config.dims
        e = e.detach().to(F64).reshape(-1)
        w = None if w is None else w.detach().to(F64).reshape(-1)
        if d:
            e, w = e[:d], (None if w is None else w[:d])
        return e, w

    def score(self, e: Tensor, w: Tensor | None = None) -> float:
        """s of `e` against the current segment (NaN while it has < min_reference batches),
        without changing anything."""
        return self._score(self._cut(e, w))

    def _score(self, batch: Batch) -> float:
        c, n = self.config, len(self._ref)
        if n < c.min_reference:
            return math.nan
        es = torch.stack([b[0] for b in self._ref])
        ws = [b[1] for b in self._ref]
        if all(x is not None for x in ws) and self._within_sum is not None:
            seg = torch.stack(ws).mean(0)  # type: ignore[arg-type]
            stream = self._within_sum / self._within_n
            var = (n * seg + c.prior_weight * stream) / (n + c.prior_weight)
        else:  # no within-batch spreads: the reference's batch-to-batch variance
            var = es.var(0)
        var = (var * (1.0 + 1.0 / n)).clamp_min(c.var_floor)
        return float(((batch[0] - es.mean(0)) ** 2 / var).mean())

    def _take(self, batches: list[Batch]) -> None:
        for b in batches:
            self._ref.append(b)
            if b[1] is not None:
                self._within_sum = b[1].clone() if self._within_sum is None \
                    else self._within_sum + b[1]
                self._within_n += 1

    def observe(self, e: Tensor, w: Tensor | None = None) -> ShiftDecision:
        """Test one batch embedding (`w`: its within-batch spread, if known) and update the
        segment."""
        batch = self._last = self._cut(e, w)
        self.batches += 1
        s = self._score(batch)
        if math.isnan(s) or s <= self.config.threshold:
            self._take([*self._away, batch])  # an outlier joins the reference
            self._away = []
            return ShiftDecision(s, False, False)
        self._away.append(batch)
        far = self.config.instant and s > self.config.instant * self.config.threshold
        if len(self._away) < self.config.confirm and not far:
            return ShiftDecision(s, True, False)
        if far:  # the new segment starts with this batch (not with earlier outliers)
            self._take(self._away[:-1])
            self._away = [batch]
        self.restart()
        self.shifts += 1
        return ShiftDecision(s, True, True)

    def restart(self) -> None:
        """A new segment from the last batch observed: the away batches up to it (or that
        batch alone when it was not away) are its reference (a shift decided elsewhere:
        the paper's cosine rule, a domain switch)."""
        start = self._away or ([self._last] if self._last is not None else [])
        self._ref.clear()
        self._away = []
        self._take(start)
