"""`tta demo --task segmentation` on a fresh checkout: the scene bag made on first use (or
reused), replayed over real ROS 2 in a subprocess with source and Tent; the masks the node
publishes are scored per domain and Tent, adapting, beats source."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

DOMAINS = ["clean", "fog/4", "night/4", "rain/4", "snow/3"]


def test_segmentation_demo_scores_masks_and_tent_beats_source(tmp_path) -> None:
    out = tmp_path / "report"
    env = {**os.environ, "ROS_DOMAIN_ID": str(random.randint(1, 200)),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tta_core.cli", "demo", "--task",
                           "segmentation", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "seg_report.json").read_text())
    runs = {r["method"]: r for r in report["runs"]}
    assert list(runs) == ["source", "tent"]
    for r in runs.values():  # every frame of the bag answered by a mask and scored
        assert r["frames"] == 40 and r["frames_dropped"] == 0, r
        assert list(r["miou"]) == DOMAINS
    src, tent = runs["source"], runs["tent"]
    assert src["miou"]["clean"] > 0.6  # the card's own domain
    assert src["adapted_share"] == 0 and tent["adapted_share"] == 1
    assert tent["mean_miou"] > src["mean_miou"], (tent["mean_miou"], src["mean_miou"])
    md = (out / "seg_report.md").read_text()
    assert "| tent |" in md and "| source |" in md
    assert f"mean mIoU {100 * tent['mean_miou']:.1f} %" in proc.stdout
