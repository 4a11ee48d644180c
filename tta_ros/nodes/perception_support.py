"""Helpers of the perception node without rclpy: frame queue, plan gate, guard, method set-up.

- FrameQueue: bounded keep-latest queue between the image callback (never blocks) and the
  worker; when full, the oldest frame is dropped and counted.
- PlanGate: which plan the next batch uses in `plan_source: topic`. A plan is *stale* when
  an importance message has waited longer than `timeout_s` without any plan arriving
  after it (scheduler gone); an idle stream is never stale. Stale -> plan inline.
- DivergenceGuard: reset the method when logits are non-finite, or when the mean entropy
  stays above `ratio * ln(num_classes)` for `patience` consecutive batches.
- TelemetryFeed: the monitor's latest pi1/pi2 for inline planning while fresh.
- build_warm: a method built and warmed up before its first frame; unit_names: the units
  its plans and importance name.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tta_core.api import TakesPlan, TakesTelemetry, TTAMethodLike, WarmsUp
from tta_core.model.units import decompose
from tta_core.registry import build_method
from tta_core.runtime.gc_pauses import freeze_startup_heap


class FrameQueue:
    """deque(maxlen) + condition; push never blocks, take waits for a batch. Each frame's
    arrival (monotonic clock) is kept: `late_ms` says how long ago the newest frame of
    the last batch taken arrived (what a deadline-aware method has already lost)."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"queue_size must be >= 1, got {maxlen}")
        self._q: deque = deque(maxlen=maxlen)
        self._cv = threading.Condition()
        self.dropped = 0
        self.received = 0
        self.closed = False
        self._newest_taken = math.nan  # arrival of the newest frame of the last batch

    def push(self, item: Any, arrived: float | None = None) -> bool:
        """Append `item` that arrived at `arrived` (time.monotonic(); now by default);
        returns True when the oldest frame was dropped to make room."""
        with self._cv:
            full = len(self._q) == self._q.maxlen
            if full:
                self.dropped += 1
            self._q.append((time.monotonic() if arrived is None else arrived, item))
            self.received += 1
            self._cv.notify()
        return full

    def count_refused(self) -> None:
        """A frame received and refused before it was queued (received, never taken)."""
        with self._cv:
            self.received += 1

    def resize(self, maxlen: int) -> None:
        """New capacity, keeping the newest frames (the ones cut are counted as dropped)."""
        if maxlen < 1:
            raise ValueError(f"queue_size must be >= 1, got {maxlen}")
        with self._cv:
            old = list(self._q)
            self.dropped += max(0, len(old) - maxlen)
            self._q = deque(old[-maxlen:], maxlen=maxlen)

    def take(self, n: int, batch_timeout_s: float, poll_s: float = 0.1) -> list:
        """Up to n frames: returns when n are queued, or `batch_timeout_s` after the first.

        Returns [] after `poll_s` without any frame, or when closed.
        """
        with self._cv:
            if not self._cv.wait_for(lambda: self._q or self.closed, timeout=poll_s):
                return []
            deadline = time.monotonic() + batch_timeout_s
            while len(self._q) < n and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(timeout=left)
            out = [self._q.popleft() for _ in range(min(n, len(self._q)))]
            self._cv.notify_all()  # room again: an intake waiting in wait_below goes on
            if out:  # converted frames can enter out of arrival order
                self._newest_taken = max(t for t, _ in out)
            return [item for _, item in out]

    def late_ms(self) -> float:
        """Milliseconds since the newest frame of the last batch taken arrived (0 before
        any batch): a batch that starts late has this much less of its deadline left."""
        t = self._newest_taken
        return 0.0 if math.isnan(t) else max(0.0, (time.monotonic() - t) * 1e3)

    def wait_below(self, n: int, timeout: float) -> bool:
        """Wait until fewer than n frames are queued (or closed, or timeout); True when
        there is room."""
        with self._cv:
            return self._cv.wait_for(lambda: len(self._q) < n or self.closed, timeout=timeout)

    def count_lost(self, n: int) -> None:
        """Frames that never reached the queue (lost upstream of it) count as dropped."""
        if n > 0:
            with self._cv:
                self.dropped += n

    def clear(self) -> int:
        """Drop every queued frame (counted as dropped); how many there were."""
        with self._cv:
            n = len(self._q)
            self.dropped += n
            self._q.clear()
            self._cv.notify_all()
        return n

    def __len__(self) -> int:
        return len(self._q)

    @property
    def maxlen(self) -> int:
        return int(self._q.maxlen or 0)

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()


class PlanGate:
    """Latest external plan + staleness; all times from time.monotonic() by default."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.plan: Any = None
        self.plan_time = -math.inf
        self.waiting_since: float | None = None  # oldest unanswered importance
        self._lock = threading.Lock()

    def on_plan(self, plan: Any, now: float | None = None) -> None:
        with self._lock:
            self.plan = plan
            self.plan_time = time.monotonic() if now is None else now
            self.waiting_since = None

    def on_importance_sent(self, now: float | None = None) -> None:
        with self._lock:
            if self.waiting_since is None:
                self.waiting_since = time.monotonic() if now is None else now

    def stale(self, now: float | None = None) -> bool:
        """True when an importance waits for a plan for more than timeout_s."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self.waiting_since is not None and now - self.waiting_since > self.timeout_s

    def current(self, now: float | None = None) -> Any:
        """The plan to apply to the next batch, or None (plan inline)."""
        if self.stale(now):
            return None
        with self._lock:
            return self.plan

    def discard(self, plan: Any) -> None:
        """Forget `plan` if it is still the current one (it failed): inline until the next
        plan arrives."""
        with self._lock:
            if self.plan is plan:
                self.plan = None

    def silent_for(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            return now - self.plan_time


@dataclass
class DivergenceGuard:
    """Decides when adaptation collapsed and the source weights must come back."""

    num_classes: int
    ratio: float = 0.95
    patience: int = 5
    high_streak: int = 0
    resets: int = 0

    def check(self, logits_finite: bool, mean_entropy: float) -> str:
        """'' when fine, else the reason to reset (the streak restarts after a reset)."""
        limit = self.ratio * math.log(max(self.num_classes, 2))
        if not logits_finite:
            reason = "non-finite logits"
        elif not math.isfinite(mean_entropy) or mean_entropy > limit:
            self.high_streak += 1
            if self.high_streak < self.patience:
                return ""
            reason = (f"mean entropy {mean_entropy:.3f} > {limit:.3f} nats for "
                      f"{self.high_streak} batches")
        else:
            self.high_streak = 0
            return ""
        self.high_streak = 0
        self.resets += 1
        return reason


class TelemetryFeed:
    """The latest telemetry pi1/pi2 for inline planning, until it is `timeout_s` old."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._latest: tuple[float, float, float] | None = None  # (time, pi1, pi2)

    def on_reading(self, pi1: float, pi2: float, now: float | None = None) -> None:
        self._latest = (time.monotonic() if now is None else now, float(pi1), float(pi2))

    def apply(self, method: object, now: float | None = None) -> None:
        """Hand the fresh factors to a method that plans with telemetry, or tell it to use
        offline ones (stale or none yet); other methods are left alone."""
        if not isinstance(method, TakesTelemetry):
            return
        now = time.monotonic() if now is None else now
        latest = self._latest
        if latest is not None and now - latest[0] <= self.timeout_s:
            method.set_expansion(latest[1], latest[2])
        else:
            method.clear_expansion()


def build_warm(name: str, config: Mapping[str, Any], model: torch.nn.Module,
               batch_size: int, sample: tuple[int, ...]) -> TTAMethodLike:
    """Method `name` with `config`, warmed up (api.WarmsUp) on noise batches of `sample`
    (C, H, W) at the batch size: its run-time costs learnt before the first frame, its
    state untouched (a deadline's first updates otherwise plan blind and miss)."""
    meth = build_method(name, model, **config)
    if isinstance(meth, WarmsUp):
        dev = next(model.parameters()).device
        meth.warm_up(torch.randn(batch_size, *sample, device=dev))
    freeze_startup_heap()  # full garbage collections skip what exists now (gc_pauses)
    return meth


def unit_names(method: TTAMethodLike, source_model: torch.nn.Module,
               sample: tuple[int, ...], arch: str, log: Callable[[str], None]) -> list[str]:
    """The units plans and importance name: the method's own (TakesPlan), else the source
    model's at input `sample` (decomposed without a forward through the method's hooks);
    [] for a model with no decomposition (a gated master, elastic: it plans nothing, sends
    no importance; `log` says why)."""
    if isinstance(method, TakesPlan):
        return list(method.unit_names)
    try:
        return [u.name for u in decompose(source_model, sample, arch).units]
    except ValueError as exc:
        log(f"no layer importance for this model: {exc}")
        return []
