"""CPU cost of TelemetrySampler.sample() (goal: <= 2 % of one core at 10 Hz).

Prints JSON: CPU ms per sample at the real 10 Hz cadence (includes the periodic process-table
rescan), the duty cycle in % of one core, the back-to-back cost (no rescan), and the cost of
one process-table rescan. Usage: python benchmarks/field/bench_telemetry.py [--samples 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import psutil

from tta_core.telemetry import PsutilSource, TelemetrySampler


def _cpu_ms(fn, n: int, period_s: float) -> tuple[float, float]:
    """(CPU ms per call, wall s) for n calls spaced by period_s (sleep not counted as CPU)."""
    with harness.Stopwatch(("cpu", "wall")) as sw:
        for _ in range(n):
            ms, _ = harness.timed(fn)
            rest = period_s - ms / 1e3
            if rest > 0:
                time.sleep(rest)
    return sw.elapsed["cpu"] / n, sw.elapsed["wall"] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--hz", type=float, default=10.0)
    args = ap.parse_args()
    with TelemetrySampler() as sampler:
        time.sleep(0.6)
        sampler.sample()
        per_sample_ms, wall_s = _cpu_ms(sampler.sample, args.samples, 1.0 / args.hz)
        b2b_ms, _ = _cpu_ms(sampler.sample, args.samples, 0.0)
        last = sampler.sample()
        sources = [d.name for d in sampler.describe() if d.available]
    ps = PsutilSource(proc_interval_s=1e-9)
    scan_ms, _ = _cpu_ms(ps.read, 20, 0.0)
    print(json.dumps({
        "samples": args.samples,
        "hz": args.hz,
        "processes": len(psutil.pids()),
        "sources_available": sources,
        "source_answered": last.source,
        "cpu_ms_per_sample_at_hz": round(per_sample_ms, 4),
        "cpu_ms_total_100_samples_at_hz": round(per_sample_ms * 100, 2),
        "duty_percent_of_one_core": round(per_sample_ms * args.hz / 10.0, 3),
        "wall_s": round(wall_s, 2),
        "cpu_ms_per_sample_back_to_back": round(b2b_ms, 4),
        "cpu_ms_per_process_rescan": round(scan_ms, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
