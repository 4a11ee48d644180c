"""The benchmarks' one timing harness: a stopwatch on a named clock, warm-up and round-robin
timing of named callables, their per-round times and order statistics, and the results
JSON with its options (written by `results.save`, which records the command, machine,
date and commit, and renders the page).

    import harness
    times = harness.round_robin({"a": f, "b": g}, rounds=20, warmup=2, rotate=True)
    times["a"].stats()     # {"rounds": 20, "median": ..., "p50": ..., "p90": ..., ...}
    harness.save("kernels", data, options=args)

A device given as "cuda" (or a torch.device of that type) is synchronised before a clock
is read, so a step's kernels are inside its time. Every benchmark times through here.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import results

#: clock name -> seconds: wall (perf_counter), the process's CPU time (every thread) and
#: the calling thread's CPU time
CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}


def _check_clocks(clocks: Sequence[str]) -> tuple[str, ...]:
    bad = [c for c in clocks if c not in CLOCKS]
    if bad or not clocks:
        raise ValueError(f"clocks {list(clocks)}: each must be one of {sorted(CLOCKS)}")
    return tuple(clocks)


def sync(device: Any = None) -> None:
    """Wait for the device's queued work when it is a CUDA device (else nothing)."""
    if device is None or not str(getattr(device, "type", device)).startswith("cuda"):
        return
    import torch

    torch.cuda.synchronize(device)


class Stopwatch:
    """Milliseconds on each of `clocks` between entering and leaving, the device
    synchronised at both ends: `with Stopwatch() as sw: step()` then `sw.ms` (the first
    clock), `sw.elapsed["cpu"]`, `sw.s`."""

    def __init__(self, clocks: Sequence[str] = ("wall",), device: Any = None) -> None:
        self.clocks = _check_clocks(clocks)
        self.device = device
        self.elapsed: dict[str, float] = {}
        self._start: dict[str, float] = {}

    def __enter__(self) -> Stopwatch:
        return self.start()

    def start(self) -> Stopwatch:
        """Start (or restart) the clocks; `with` does this on entering."""
        sync(self.device)
        self._start = {c: CLOCKS[c]() for c in self.clocks}
        return self

    def lap_s(self) -> float:
        """Seconds on the first clock since the start, the clocks running on."""
        sync(self.device)
        return CLOCKS[self.clocks[0]]() - self._start[self.clocks[0]]

    def __exit__(self, *exc: object) -> None:
        sync(self.device)
        self.elapsed = {c: (CLOCKS[c]() - t) * 1e3 for c, t in self._start.items()}

    @property
    def ms(self) -> float:
        """Milliseconds on the first clock."""
        return self.elapsed[self.clocks[0]]

    @property
    def s(self) -> float:
        """Seconds on the first clock."""
        return self.ms / 1e3


def timed(fn: Callable[[], Any], clock: str = "wall", device: Any = None) -> tuple[float, Any]:
    """(ms on `clock`, what fn returned) of one call of `fn`."""
    with Stopwatch((clock,), device) as sw:
        out = fn()
    return sw.ms, out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between ranks (NaN if empty)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Timing:
    """One callable's measured rounds: ms per round on each clock, in round order (the
    rounds of two callables of one run line up: a ratio per round is zip of their lists)."""

    name: str
    times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ms(self) -> list[float]:
        """Per-round ms on the first clock."""
        return next(iter(self.times.values()))

    def stats(self, clock: str | None = None) -> dict[str, float]:
        """rounds, median (= p50), p90, min, max and mean of one clock's ms."""
        ms = self.times[clock] if clock is not None else self.ms
        return {"rounds": len(ms), "median": percentile(ms, 50), "p50": percentile(ms, 50),
                "p90": percentile(ms, 90), "min": min(ms, default=math.nan),
                "max": max(ms, default=math.nan),
                "mean": sum(ms) / len(ms) if ms else math.nan}

    @property
    def median(self) -> float:
        return percentile(self.ms, 50)


def round_robin(cases: Mapping[str, Callable[..., Any]], rounds: int | None = None, *,
                warmup: int = 1, inputs: Sequence[Any] | None = None, rotate: bool = False,
                clocks: Sequence[str] = ("wall",), device: Any = None,
                on_result: Callable[[str, Any, bool], None] | None = None,
                progress: Callable[[Iterable[int]], Iterable[int]] | None = None
                ) -> dict[str, Timing]:
    """Time every callable once per round, in turn, after `warmup` rounds that are run the
    same way but not counted. With `inputs`, round i calls each case with inputs[i] (there
    are len(inputs) rounds, the first `warmup` of them warm-up); else cases take no argument
    and there are warmup + rounds rounds. `rotate` starts round i at the i-th case, so no
    case always follows the same one. `on_result(name, returned, counted)` sees each call's
    return value, untimed (e.g. to finish a background update before the next case).
    `progress` wraps the round indices (e.g. tqdm)."""
    names = list(cases)
    clocks = _check_clocks(clocks)
    total = len(inputs) if inputs is not None else warmup + (rounds or 0)
    if not names or total <= warmup:
        raise ValueError(f"round_robin needs cases and rounds past the warm-up: {len(names)} "
                         f"cases, {total} rounds, warmup {warmup}")
    out = {n: Timing(n, {c: [] for c in clocks}) for n in names}
    indices: Iterable[int] = range(total)
    for i in (progress(indices) if progress is not None else indices):
        k = i % len(names) if rotate else 0
        args = (inputs[i],) if inputs is not None else ()
        for name in names[k:] + names[:k]:
            with Stopwatch(clocks, device) as sw:
                returned = cases[name](*args)
            counted = i >= warmup
            if counted:
                for c in clocks:
                    out[name].times[c].append(sw.elapsed[c])
            if on_result is not None:
                on_result(name, returned, counted)
    return out


def repeat(fn: Callable[[], Any], repeats: int, warmup: int = 1, clock: str = "wall",
           device: Any = None) -> Timing:
    """One callable timed `repeats` times after `warmup` uncounted calls."""
    return round_robin({"": fn}, repeats, warmup=warmup, clocks=(clock,), device=device)[""]


def options_dict(options: argparse.Namespace | Mapping[str, Any] | None) -> dict[str, Any]:
    """JSON-ready options of a run: paths and tuples as strings and lists."""
    raw = vars(options) if isinstance(options, argparse.Namespace) else dict(options or {})

    def plain(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return v if v is None or isinstance(v, bool | int | float | str) else str(v)

    return {k: plain(v) for k, v in raw.items()}


def save(stem: str, data: dict, options: argparse.Namespace | Mapping[str, Any] | None = None,
         out: Path = results.RESULTS, argv: list[str] | None = None) -> Path:
    """`results.save` (JSON with command, machine, date and commit; its page rendered) with
    the run's options in the provenance block (kept when `data` already has one)."""
    prov = data.get("provenance") or {**results.provenance(argv),
                                      "options": options_dict(options)}
    return results.save(stem, {**data, "provenance": prov}, out)
