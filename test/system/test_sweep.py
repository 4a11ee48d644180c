"""`tta sweep` on a local Ray: a 2 x 2 x 2 grid completes and aggregates over seeds; a
sweep killed mid-way resumes with only the unfinished cells; a cell with a bad option
fails alone, with its message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.system, pytest.mark.slow]

BASE = {"samples-per-domain": 1, "threads": 1}


def _bench():
    from tta_core.cli.commands import bench
    from tta_core.sweep.run import BenchCLI

    return BenchCLI(bench.add_arguments, bench.config_from_args)


def _spec(tmp: Path, name: str, grid: dict, **extra: object) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "base": BASE, "grid": grid} | extra))
    return path


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    from tta_core.sweep.run import init_ray

    init_ray("", workers=2, cpus_per_cell=1)
    yield ray
    ray.shutdown()


def test_grid_completes_aggregates_and_reruns_from_cache(ray_local, tmp_path) -> None:
    from tta_core.sweep.driver import sweep

    spec = _spec(tmp_path, "g", {"methods": ["bn_adapt", "tent"], "batch-size": [4, 8],
                                 "seed": [0, 1]}, baseline="bn_adapt")
    res = sweep(spec, _bench(), tmp_path / "out", progress=False)
    assert (res.cells, res.ran, res.cached, res.failed) == (8, 8, 0, 0)
    report = json.loads((tmp_path / "out" / "sweep.json").read_text())
    rows = [r for r in report["rows"] if r["metric"] == "mean_accuracy"]
    assert len(rows) == 4  # 2 methods x 2 batch sizes, seeds folded into the interval
    for r in rows:
        cells = [c for c in report["cells"] if c["options"]["methods"] == r["method"]
                 and c["options"]["batch_size"] == r["condition"]["batch_size"]]
        accs = [c["summaries"][0]["mean_accuracy"] for c in cells]
        assert r["ci"]["n"] == 2 and r["ci"]["mean"] == pytest.approx(sum(accs) / 2)
        assert (r["vs_baseline"] is None) == (r["method"] == "bn_adapt")
    again = sweep(spec, _bench(), tmp_path / "out", progress=False)
    assert (again.ran, again.cached) == (0, 8)


def test_a_bad_option_fails_its_cell_alone(ray_local, tmp_path) -> None:
    from tta_core.sweep.driver import sweep

    spec = _spec(tmp_path, "bad", {"methods": ["tent"],
                                   "set": [["tent.lr=0.001"], ["tent.no_such_option=1"]]})
    res = sweep(spec, _bench(), tmp_path / "out", progress=False)
    assert (res.cells, res.ran, res.failed) == (2, 2, 1)
    cells = json.loads((tmp_path / "out" / "sweep.json").read_text())["cells"]
    bad = [c for c in cells if c["status"] == "failed"]
    assert len(bad) == 1 and "no_such_option" in bad[0]["error"]
    assert "\n" not in bad[0]["error"]
    assert "no_such_option" in (tmp_path / "out" / "sweep.md").read_text()


def _results(out: Path) -> int:
    return len(list((out / "cells").glob("*/result.json")))


def test_killed_sweep_resumes_with_the_unfinished_cells(tmp_path) -> None:
    spec = _spec(tmp_path, "k", {"methods": ["bn_adapt", "tent"], "seed": [0, 1]})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tta_core.cli", "sweep", str(spec), "--out", str(out),
           "--workers", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while _results(out) < 1 and proc.poll() is None:  # wait on the cache, not a clock
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = _results(out)
    assert 1 <= done < 4
    rerun = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"4 cells, {4 - done} run now, {done} from cache, 0 failed" in rerun.stdout


def _bag_without_ground_truth(path: Path, n: int = 12) -> Path:
    """A bag as a camera driver records it: images only, no label topics."""
    import numpy as np

    from tta_core.io.bag import IMAGE_TOPIC, IMAGE_TYPE, OFFERED_QOS, Rosbag2Writer, tta_typestore

    store, rng = tta_typestore(), np.random.default_rng(0)
    t = store.types
    with Rosbag2Writer(path, version=9) as w:
        conn = w.add_connection(IMAGE_TOPIC, IMAGE_TYPE, typestore=store,
                                offered_qos_profiles=[OFFERED_QOS[IMAGE_TOPIC]])
        for i in range(n):
            ns = 10**18 + i * 33_000_000
            stamp = t["builtin_interfaces/msg/Time"](sec=ns // 10**9, nanosec=ns % 10**9)
            img = t[IMAGE_TYPE](header=t["std_msgs/msg/Header"](stamp=stamp, frame_id="cam"),
                                height=48, width=64, encoding="rgb8", is_bigendian=0,
                                step=64 * 3, data=rng.integers(0, 256, 48 * 64 * 3, np.uint8))
            w.write(conn, ns, store.serialize_cdr(img, IMAGE_TYPE))
    return path


def test_recorded_bags_are_sweep_data(ray_local, tmp_path) -> None:
    """The shipped sample bag (ground truth recorded) and a camera-only bag (agreement with
    the unadapted model) run as `--data bag:DIR` cells and report per-method figures."""
    from helpers import ROOT

    from tta_core.sweep.driver import sweep

    raw = _bag_without_ground_truth(tmp_path / "camera_only")
    spec = _spec(tmp_path, "bags", {"methods": ["source", "bn_adapt"],
                                    "data": [f"bag:{ROOT / 'bags' / 'signs32_sample'}",
                                             f"bag:{raw}"]},
                 base={"threads": 1, "samples-per-domain": 8, "batch-size": 4})
    res = sweep(spec, _bench(), tmp_path / "out", progress=False)
    assert (res.cells, res.failed) == (4, 0)
    cells = json.loads((tmp_path / "out" / "sweep.json").read_text())["cells"]
    by = {(c["options"]["data"].endswith("camera_only"), c["options"]["methods"]):
          c["summaries"][0] for c in cells}
    assert by[(False, "source")]["n_frames"] == 6 * 8  # 6 domain segments in the sample bag
    assert by[(True, "source")]["n_frames"] == 8  # one "recorded" domain, first 8 frames
    # no ground truth: scored against the unadapted model, which agrees with itself
    assert by[(True, "source")]["mean_accuracy"] == 1.0
    assert by[(True, "bn_adapt")]["n_frames"] == 8  # scored on the same frames
    assert 0.0 < by[(False, "source")]["mean_accuracy"] < 1.0
    report = json.loads(next((tmp_path / "out" / "cells").glob("*/bench/report.json"))
                        .read_text())
    assert report["runs"][0]["meta"]["ran"]["data"]["kind"] == "bag"
