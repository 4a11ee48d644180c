"""benchmarks/harness.py, the benchmarks' one timing loop: round-robin order, warm-up left
out of the counts, the clock chosen is the clock read, order statistics, and the saved JSON
carrying the run's options next to its command, machine and commit."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # harness imports results as a sibling
    try:
        spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" /
                                                      "harness.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["harness"] = mod
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _spin_cpu(ms: float) -> None:
    """Burn `ms` of this thread's CPU time."""
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def test_rounds_interleave_the_cases_and_rotate_on_request(harness) -> None:
    log: list[str] = []
    cases = {n: (lambda n=n: log.append(n)) for n in "abc"}
    times = harness.round_robin(cases, rounds=2, warmup=1)
    assert log == list("abc") * 3
    assert [len(times[n].ms) for n in "abc"] == [2, 2, 2]
    log.clear()
    harness.round_robin(cases, rounds=2, warmup=1, rotate=True)
    assert log == list("abc") + list("bca") + list("cab")


def test_inputs_give_each_round_its_argument_and_results_are_seen(harness) -> None:
    seen: list[tuple[str, int, bool]] = []
    cases = {"double": lambda x: 2 * x, "neg": lambda x: -x}
    times = harness.round_robin(cases, warmup=1, inputs=[1, 2, 3],
                                on_result=lambda n, r, counted: seen.append((n, r, counted)))
    assert seen == [("double", 2, False), ("neg", -1, False), ("double", 4, True),
                    ("neg", -2, True), ("double", 6, True), ("neg", -3, True)]
    assert len(times["neg"].ms) == 2


def test_warm_up_calls_are_run_but_not_counted(harness) -> None:
    calls = []

    def slow_first() -> None:
        calls.append(1)
        if len(calls) <= 2:
            time.sleep(0.05)  # one-time setup, as a first kernel launch pays

    t = harness.repeat(slow_first, repeats=4, warmup=2)
    assert len(calls) == 6 and len(t.ms) == 4
    assert t.stats()["max"] < 40.0
    with pytest.raises(ValueError, match="past the warm-up"):
        harness.round_robin({"a": lambda: None}, rounds=0, warmup=3)


def test_the_cpu_clock_counts_work_and_not_sleep(harness) -> None:
    cases = {"spin": lambda: _spin_cpu(20.0), "sleep": lambda: time.sleep(0.02),
             "none": lambda: None}
    t = harness.round_robin(cases, rounds=3, warmup=0, clocks=("thread", "wall"))
    spin, slept, none = (t[n].stats("thread")["median"] for n in ("spin", "sleep", "none"))
    assert spin >= 19.0 and slept < 5.0 and none < 5.0
    assert t["sleep"].stats("wall")["min"] >= 19.0  # the wall clock does see the sleep
    assert t["spin"].ms == t["spin"].times["thread"]  # the first clock is the default one
    with pytest.raises(ValueError, match="clocks"):
        harness.Stopwatch(("sundial",))


def test_stopwatch_and_timed(harness) -> None:
    with harness.Stopwatch(("thread",)) as sw:
        _spin_cpu(10.0)
    assert 9.0 <= sw.ms < 200.0 and sw.s == pytest.approx(sw.ms / 1e3)
    ms, out = harness.timed(lambda: (_spin_cpu(5.0), 7)[1], clock="thread")
    assert out == 7 and ms >= 4.5


def test_order_statistics(harness) -> None:
    t = harness.Timing("x", {"wall": [float(v) for v in (10, 1, 9, 2, 8, 3, 7, 4, 6, 5)]})
    s = t.stats()
    assert s["rounds"] == 10 and s["median"] == s["p50"] == 5.5 == t.median
    assert s["p90"] == pytest.approx(9.1) and s["max"] == 10.0 and s["min"] == 1.0
    assert s["mean"] == 5.5
    assert harness.percentile([3.0], 90) == 3.0


def test_save_records_the_options_with_command_machine_and_commit(harness, tmp_path) -> None:
    results = sys.modules["results"]
    data = json.loads((results.RESULTS / "paper_ratios.json").read_text())
    data.pop("provenance")
    args = argparse.Namespace(threads=2, out=Path("docs/results"), sizes=(4, 16))
    path = harness.save("paper_ratios", data, options=args, out=tmp_path,
                        argv=["benchmarks/speed/x.py", "--threads", "2"])
    prov = json.loads(path.read_text())["provenance"]
    assert prov["options"] == {"threads": 2, "out": "docs/results", "sizes": [4, 16]}
    assert prov["command"].endswith("x.py --threads 2")
    assert prov["machine"] and prov["code"]
    assert (tmp_path / "paper_ratios.md").read_text().startswith("---\n")
