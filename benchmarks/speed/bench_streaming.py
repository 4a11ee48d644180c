"""`tta bench --stream-hz ...` with timing hygiene for a shared machine (issue #18).

Streaming results depend on measured step times, so a step that another process preempts
counts as a slow step. This wrapper runs the same command (same arguments, same files)
with two changes that only touch *when* steps run, never what they compute:

  * the process asks for SCHED_FIFO priority 50 (needs root or CAP_SYS_NICE; otherwise a
    one-line notice and normal priority), so other processes cannot preempt a step;
  * an untimed 60 ms pause every 0.5 s of wall time, between two steps: Linux throttles a
    real-time process after 950 ms of every second (sched_rt_runtime_us), and the stall
    would otherwise land inside a step (~50 ms, one batch in ~500 at 1 thread).

The stream's clock is virtual (tta_core.eval.streaming), so the pauses change no outcome.
Use --threads 1: a second torch thread competes with the rest of the machine on 2 cores.

Usage: python benchmarks/speed/bench_streaming.py --stream-hz 250,500,1000,2000 \\
           --samples-per-domain 100 --batch-size 4 --threads 1 --out runs/streaming
(README "Streaming accuracy" figures; every `tta bench` option works.)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness

import tta_core.eval.bench_stream as bench_stream
from tta_core.cli import main as cli_main
from tta_core.eval.streaming import StepFn, timed_step

WALL = harness.CLOCKS["wall"]
PAUSE_EVERY_S = 0.5
PAUSE_S = 0.06


def paced(run: Callable[[Sequence[int], float], Sequence[int]],
          clock: Callable[[], float] = WALL) -> StepFn:
    """timed_step, with an untimed pause before a step once PAUSE_EVERY_S has passed."""
    inner = timed_step(run, clock)
    since = harness.Stopwatch().start()

    def step(frames: Sequence[int], late_ms: float = 0.0) -> tuple[Sequence[int], float]:
        if since.lap_s() > PAUSE_EVERY_S:
            time.sleep(PAUSE_S)
            since.start()
        return inner(frames, late_ms)

    return step


def main(argv: list[str]) -> int:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
        print("bench_streaming: SCHED_FIFO 50", file=sys.stderr)
    except (PermissionError, AttributeError, OSError) as exc:
        print(f"bench_streaming: normal priority ({type(exc).__name__}: {exc})",
              file=sys.stderr)
    bench_stream.timed_step = paced  # stream_method builds its steps through this name
    return cli_main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
