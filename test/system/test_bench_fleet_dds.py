"""benchmarks/field/bench_fleet_dds.py at a tiny scale over real rclpy + DDS: two perception
processes (retraining) and a scheduler process, every arm (paper objective, confidence
proxy, equal split) scored on every camera, the sizes the nodes served equal to the
scheduler's choice (a capacity nothing fits: the smallest size everywhere, not the nodes'
own full one), the paper arm planned with confidence (no past domains without a
calibration file: the nodes report no A, Ã), no process left over. No assertion on
accuracy or time (the benchmark measures those)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytest.importorskip("rclpy")


def test_bench_fleet_dds_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "field" / "bench_fleet_dds.py"),
           "--cameras", "2",
           "--rate-scale", "2", "--batch", "4", "--rounds", "1", "--seconds", "2",
           "--settle", "1", "--warm", "1", "--warmup-runs", "2", "--calibration", "",
           "--fixed-capacity", "0.001", "--ready-timeout", "0", "--out", str(out)]
    # no time limit of its own: the benchmark waits on readiness (every node's first
    # report, the scheduler's service) as long as the node processes live, and fails as
    # soon as one exits; its progress lines come in this order
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        stdout, stderr = proc.communicate()
    finally:  # interrupted (pytest's own timeout): SIGTERM, the benchmark stops its nodes
        if proc.poll() is None:
            proc.terminate()
            proc.communicate()
    assert proc.returncode == 0, stderr[-2000:]
    progress = [ln for ln in stderr.splitlines() if ln.startswith("N=2 ")]
    assert [ln.split(" ", 2)[1] for ln in progress[:2]] == ["/cam1", "/cam2"], stderr[-2000:]
    assert [ln.split()[5] for ln in progress[2:]] == ["paper", "confidence",
                                                      "equal_split"], progress
    runs = json.loads(out.read_text())["scenarios"]["2"]
    assert [r["seed"] for r in runs] == [0]
    sc = runs[0]
    assert [r["arm"] for r in sc["rounds"]] == ["paper", "confidence", "equal_split"]
    # without past domains the paper arm planned with the confidence proxy (fallback)
    assert set(sc["summary"]["paper"]["objective"]) == {"confidence"}
    assert set(sc["summary"]["equal_split"]["objective"]) == {"equal_split"}
    cams = {c["ns"]: c for c in sc["cameras"]}
    assert list(cams) == ["/cam1", "/cam2"] and [c["hz"] for c in cams.values()] == [60, 20]
    for r in sc["rounds"]:
        for ns, s in r["streams"].items():
            assert s["frames"] == cams[ns]["window_frames"] == round(2 * cams[ns]["hz"])
            assert s["answered"] > 0.5, (r["arm"], ns, s)  # scored answers on every camera
            assert s["strict"] <= s["streaming"]
        for ns in cams:  # a capacity nothing fits: both arms choose every smallest size
            # (the nodes' own choice would be the full one), and the nodes serve it
            assert r["served"][ns] and r["chosen"][ns], (r["arm"], ns)
            assert set(r["served"][ns]) == set(r["chosen"][ns]) == {0.3}, r
    assert "| **paper** |" in stdout and "| **equal_split** |" in stdout
    assert "| 2 | 0 |" in stdout  # the per-seed results table
    for pid in sc["pids"]:  # every node process was stopped
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
