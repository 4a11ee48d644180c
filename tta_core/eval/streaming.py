"""Streaming accuracy (Li, Wang, Ramanan, "Towards Streaming Perception", ECCV 2020).

Frame i arrives at i * period (period = 1000 / hz ms). The method is busy for the time its
step took. The schedule, like the perception node's worker:

- arriving frames enter a bounded keep-latest queue of `queue_size` frames: a frame that
  arrives on a full queue evicts the oldest queued one (dropped, never answered);
- as soon as the method is free and a frame is queued it starts a step on the oldest
  min(batch_size, queued) frames, after waiting at most `batch_wait_ms` for a full batch
  (the node's FrameQueue.take with batch_timeout_s); the rest stay queued; a frame
  arriving exactly when the method gets free is queued before the take;
- the step's predictions for its frames become available when it ends (start + step ms).

Scoring. Frame i's deadline is arrival + L, L the latency allowance (`latency_ms`). By
default L = (2b - 1) / hz for batch size b: the camera deadline (tta_core.runtime.deadline
"camera" mode, what AdaShadow plans against), b / hz per batch, plus the (b - 1) / hz the
first frame of a batch waits for the batch to fill. A method whose steps all take <= b / hz
therefore answers every frame by its deadline (L = b / hz alone would leave the first frame
of a full batch 1 / hz for the step: strict capped near 1 / b as soon as batches fill).

- "strict": right when frame i's own prediction was available by its deadline and equals
  its label;
- "streaming" (Li et al.: the display shows the last answer): at frame i's deadline, the
  newest prediction available for any frame j <= i of the stream (the one with the largest
  j answered by then: its own when in time, else the latest earlier one), right when it
  equals frame i's label; wrong when none is available. streaming >= strict always.
  Frames after i are not used even if answered by then: they are later views.

"streaming" only means something on temporally coherent streams, where consecutive frames
show the same object (tta_core.data.streams StreamSpec.track_length: a sign seen over k
frames); on i.i.d. frames an earlier frame's prediction is a guess at another image.

A batch's deadline is the time its frames' successors take to arrive: len(frames) / hz
(the camera mode): a method that meets it on every batch keeps up with the camera. The
summary's `deadline_met` is the share of batches whose step time was within it.

The schedule is pure arithmetic on the step times: replaying
recorded step times (`replay_steps`) gives the same outcomes, and tests pass fake times.
`score_batches` scores batches that ran elsewhere (a live node's answers over DDS,
benchmarks/field/bench_fleet_dds.py) by the same rules.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: the perception node's defaults (config/vehicle.yaml queue_size, batch_timeout_s): what
#: `tta bench --stream-hz` schedules with, so the stream behaves as on the robot
NODE_QUEUE_SIZE = 32
NODE_BATCH_WAIT_MS = 50.0

# step(frame indices of the batch, lateness in ms) -> (one prediction per frame, step time
# in ms); lateness: how long after the batch's newest frame arrived the step starts (a
# backlog: a deadline-aware method has that much less of its deadline left)
StepFn = Callable[[Sequence[int], float], tuple[Sequence[int], float]]


@dataclass(frozen=True)
class StreamBatch:
    """One step of the method: its frames (oldest first), start/end in ms, predictions."""

    index: int
    frames: tuple[int, ...]
    start_ms: float
    end_ms: float
    predictions: tuple[int, ...]

    @property
    def step_ms(self) -> float:
        return self.end_ms - self.start_ms

    def deadline_ms(self, period_ms: float) -> float:
        """The batch's deadline: its frames' count of frame periods."""
        return len(self.frames) * period_ms


@dataclass(frozen=True)
class FrameOutcome:
    """One frame: arrival, deadline, its own answer (batch -1 / nan / -1 when dropped), and
    the prediction it is scored with in the strict and the streaming rule (-1: none)."""

    index: int
    label: int
    domain: str
    arrival_ms: float
    deadline_ms: float
    batch: int = -1
    answered_ms: float = math.nan
    prediction: int = -1
    strict_prediction: int = -1
    streaming_prediction: int = -1

    @property
    def dropped(self) -> bool:
        return self.batch < 0

    @property
    def in_time(self) -> bool:
        return self.answered_ms <= self.deadline_ms  # False for nan

    @property
    def strict_correct(self) -> bool:
        return self.strict_prediction == self.label

    @property
    def streaming_correct(self) -> bool:
        return self.streaming_prediction == self.label


@dataclass(frozen=True)
class StreamSummary:
    """Shares in [0, 1]; latency (answer time - arrival) in ms over the frames answered."""

    hz: float
    frames: int
    strict: float
    streaming: float
    answered: float  # own prediction by the deadline
    dropped: float  # never processed
    mean_latency_ms: float
    deadline_met: float = math.nan  # batches with step time <= len(frames) / hz (NaN: none)
    batches: int = 0
    latency_ms: float = math.nan  # the allowance L: a frame's deadline is arrival + L


@dataclass
class StreamResult:
    """Per-frame outcomes, the batches of the schedule and the summary."""

    frames: list[FrameOutcome]
    batches: list[StreamBatch]
    summary: StreamSummary
    params: dict = field(default_factory=dict)


def check_stream_params(hz: float, batch_size: int, queue_size: int,
                        batch_wait_ms: float = 0.0, latency_ms: float | None = None) -> None:
    """One-line ValueError naming the first bad value."""
    if not (isinstance(hz, int | float) and math.isfinite(hz) and hz > 0):
        raise ValueError(f"frame rate must be a finite number > 0 Hz, got {hz!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(queue_size, int) or queue_size < 1:
        raise ValueError(f"queue_size must be an integer >= 1, got {queue_size!r}")
    if not (math.isfinite(batch_wait_ms) and batch_wait_ms >= 0):
        raise ValueError(f"batch_wait_ms must be >= 0, got {batch_wait_ms!r}")
    if latency_ms is not None and not (math.isfinite(latency_ms) and latency_ms >= 0):
        raise ValueError(f"latency_ms must be a finite number >= 0, got {latency_ms!r}")


def _start_time(t0: float, queued: int, arrived: int, n: int, period: float,
                batch_size: int, wait_ms: float) -> float:
    """When a step that could start at t0 (free, a frame queued) starts: at once with a
    full batch, else when the frame completing it arrives, at most `wait_ms` after t0
    (FrameQueue.take: n frames, or batch_timeout_s after the first)."""
    needed = batch_size - queued
    if needed <= 0 or wait_ms <= 0:
        return t0
    last = arrived + needed - 1  # the frame that would complete the batch
    t_full = last * period if last < n else math.inf
    return min(max(t0, t_full), t0 + wait_ms)


def _schedule(n: int, period: float, batch_size: int, queue_size: int, wait_ms: float,
              step: StepFn) -> list[StreamBatch]:
    """Run the queue/step schedule and return its batches."""
    queue: deque[int] = deque(maxlen=queue_size)  # keep-latest: a full queue drops its oldest
    batches: list[StreamBatch] = []
    arrived, free = 0, 0.0

    def admit(until: float) -> None:
        nonlocal arrived
        while arrived < n and arrived * period <= until:
            queue.append(arrived)
            arrived += 1

    while arrived < n or queue:
        admit(free)
        if not queue:  # idle until the next frame arrives
            admit(arrived * period)
        t0 = max(free, queue[0] * period)
        start = _start_time(t0, len(queue), arrived, n, period, batch_size, wait_ms)
        admit(start)
        frames = tuple(queue.popleft() for _ in range(min(batch_size, len(queue))))
        preds, step_ms = step(frames, max(0.0, start - frames[-1] * period))
        preds = tuple(int(p) for p in preds)
        if len(preds) != len(frames):
            raise ValueError(f"step returned {len(preds)} predictions for {len(frames)} frames")
        if not (math.isfinite(step_ms) and step_ms >= 0):
            raise ValueError(f"step time must be a finite number >= 0 ms, got {step_ms!r}")
        free = start + float(step_ms)
        batches.append(StreamBatch(len(batches), frames, start, free, preds))
    return batches


def default_latency_ms(hz: float, batch_size: int) -> float:
    """The default allowance L: (2 * batch_size - 1) frame periods at `hz` (module doc)."""
    return (2 * batch_size - 1) * 1000.0 / hz


def _outcomes(labels: Sequence[int], domains: Sequence[str], period: float,
              latency_ms: float, batches: Sequence[StreamBatch]) -> list[FrameOutcome]:
    """Score every frame at arrival + `latency_ms` with the strict and the streaming rule."""
    own: dict[int, tuple[int, float, int]] = {}
    for b in batches:
        for f, p in zip(b.frames, b.predictions, strict=True):
            own[f] = (b.index, b.end_ms, p)
    # answers in the order they became available: (time, frame, prediction); kept sorted
    # by frame (a live node's answers may reach the consumer out of frame order)
    answers = sorted((end, f, p) for f, (_, end, p) in own.items())
    out: list[FrameOutcome] = []
    k, avail = 0, []  # avail: (frame, prediction) answered by the current deadline
    for i, label in enumerate(labels):
        arrival = i * period
        deadline = arrival + latency_ms
        while k < len(answers) and answers[k][0] <= deadline:
            insort(avail, (answers[k][1], answers[k][2]))
            k += 1
        b, end, pred = own.get(i, (-1, math.nan, -1))
        strict = pred if end <= deadline else -1
        upto = bisect_right(avail, (i, math.inf))  # answers for frames <= i
        newest = avail[upto - 1][1] if upto else -1
        out.append(FrameOutcome(i, int(label), str(domains[i]), arrival, deadline, b, end,
                                pred, strict, newest))
    return out


def deadline_met(batches: Sequence[StreamBatch], period_ms: float) -> float:
    """Share of `batches` whose step time held their deadline (NaN when none ran)."""
    if not batches:
        return math.nan
    return sum(b.step_ms <= b.deadline_ms(period_ms) for b in batches) / len(batches)


def _summary(hz: float, frames: Sequence[FrameOutcome], batches: Sequence[StreamBatch],
             latency_ms: float) -> StreamSummary:
    n = max(len(frames), 1)
    lat = [f.answered_ms - f.arrival_ms for f in frames if not f.dropped]
    return StreamSummary(hz, len(frames), sum(f.strict_correct for f in frames) / n,
                         sum(f.streaming_correct for f in frames) / n,
                         sum(f.in_time for f in frames) / n,
                         sum(f.dropped for f in frames) / n,
                         sum(lat) / len(lat) if lat else math.nan,
                         deadline_met(batches, 1000.0 / hz), len(batches), latency_ms)


def simulate_stream(labels: Sequence[int], hz: float, step: StepFn, batch_size: int = 1,
                    queue_size: int = 1, domains: Sequence[str] | None = None,
                    batch_wait_ms: float = 0.0,
                    latency_ms: float | None = None) -> StreamResult:
    """Stream `labels` at `hz` through `step`; see the module doc for the rules
    (`latency_ms` None: default_latency_ms)."""
    check_stream_params(hz, batch_size, queue_size, batch_wait_ms, latency_ms)
    if latency_ms is None:
        latency_ms = default_latency_ms(hz, batch_size)
    domains = list(domains) if domains is not None else [""] * len(labels)
    if len(domains) != len(labels):
        raise ValueError(f"lengths differ: labels {len(labels)}, domains {len(domains)}")
    period = 1000.0 / hz
    batches = _schedule(len(labels), period, batch_size, queue_size, batch_wait_ms, step)
    res = score_batches(labels, hz, batches, batch_size, domains, latency_ms)
    res.params.update({"queue_size": queue_size, "batch_wait_ms": batch_wait_ms})
    return res


def score_batches(labels: Sequence[int], hz: float, batches: Sequence[StreamBatch],
                  batch_size: int = 1, domains: Sequence[str] | None = None,
                  latency_ms: float | None = None) -> StreamResult:
    """Score batches that ran elsewhere by the same rules as `simulate_stream`: e.g. a
    live node's answers over DDS, frame i published at i * 1000 / hz ms and its answer
    received at `end_ms` (the same clock, 0 = frame 0's arrival). Frames no batch holds
    were never answered (wrong in both rules). `latency_ms` None: default_latency_ms.
    ValueError naming a frame outside the stream or answered twice."""
    check_stream_params(hz, batch_size, 1, 0.0, latency_ms)
    if latency_ms is None:
        latency_ms = default_latency_ms(hz, batch_size)
    domains = list(domains) if domains is not None else [""] * len(labels)
    if len(domains) != len(labels):
        raise ValueError(f"lengths differ: labels {len(labels)}, domains {len(domains)}")
    seen: set[int] = set()
    for b in batches:
        for f in b.frames:
            if not 0 <= f < len(labels) or f in seen:
                raise ValueError(f"batch {b.index}: frame {f} is outside the stream of "
                                 f"{len(labels)} frames or answered twice")
            seen.add(f)
    period = 1000.0 / hz
    frames = _outcomes(labels, domains, period, latency_ms, batches)
    params = {"hz": hz, "batch_size": batch_size, "latency_ms": latency_ms}
    return StreamResult(frames, list(batches), _summary(hz, frames, batches, latency_ms),
                        params)


def recorded_step(predictions: Sequence[int], step_ms: float | Sequence[float]) -> StepFn:
    """A step from recorded data: frame f gets predictions[f]; batch k takes step_ms (a
    constant, or step_ms[k], the last value repeating) — fake or measured times."""
    times = [float(step_ms)] if isinstance(step_ms, int | float) else [float(t) for t in step_ms]
    if not times:
        raise ValueError("step_ms is empty")
    calls = [0]

    def step(frames: Sequence[int], late_ms: float = 0.0) -> tuple[list[int], float]:
        k = calls[0]
        calls[0] += 1
        return [int(predictions[f]) for f in frames], times[min(k, len(times) - 1)]

    return step


def replay_steps(result: StreamResult) -> StepFn:
    """Replay a run's batches (predictions and measured step times): the same schedule and
    outcomes again, with no method and no clock; ValueError if the schedule diverges."""
    calls = [0]

    def step(frames: Sequence[int], late_ms: float = 0.0) -> tuple[tuple[int, ...], float]:
        b = result.batches[calls[0]]
        calls[0] += 1
        if tuple(frames) != b.frames:
            raise ValueError(f"replay diverged at batch {b.index}: frames {tuple(frames)} "
                             f"!= recorded {b.frames}")
        return b.predictions, b.step_ms

    return step


def timed_step(run: Callable[[Sequence[int], float], Sequence[int]],
               clock: Callable[[], float] = time.perf_counter) -> StepFn:
    """Run a real method on the frames the schedule gives it (`run(frames, late_ms)`); the
    step time is the measured wall time of `run` in ms (`run` must finish its device work
    before return)."""

    def step(frames: Sequence[int], late_ms: float = 0.0) -> tuple[Sequence[int], float]:
        t0 = clock()
        preds = run(frames, late_ms)
        return preds, (clock() - t0) * 1e3

    return step
