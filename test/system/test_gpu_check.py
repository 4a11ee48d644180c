"""`benchmarks/gpu_check.sh --dry-run`: the GPU check's code paths on the CPU (tests with
TTA_TEST_DEVICE=cpu, the latency and memory figures at tiny shapes), so the script a GPU
run depends on is known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import ROOT


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~75 s at load 2; the whole script's subprocesses at load 5: > 300 s
def test_gpu_check_dry_run_writes_its_figures(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "GPU_CHECK_OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== gpu_check.sh done" in proc.stdout
    ratios = json.loads((tmp_path / "paper_ratios.json").read_text())
    methods = ratios["runs"][0]["methods"]
    assert set(methods) == {"source", "bn_adapt", "tent (with reforward)", "tent (original)",
                            "adashadow", "adashadow parallel", "adashadow bn_lag=False"}
    check_ratios(methods, "median_ms", {"x_inference": "source", "x_tent": "tent (with reforward)",
                                        "x_tent_original": "tent (original)"})
    figures = json.loads((tmp_path / "gpu_figures.json").read_text())
    memory = figures["memory"]
    share = memory["tent 4-bit"]["saved_share_of_tent"]
    assert 1 / 8 <= share < 0.5  # 4 of 32 bits, plus scales: less than dense, more than 4/32
    assert share == pytest.approx(memory["tent 4-bit"]["saved_mib"]
                                  / memory["tent"]["saved_mib"], rel=1e-2)
    assert (tmp_path / "paper_ratios.md").read_text().count("| adashadow") == 3
    serving = {(r["arch"], r["precision"]): r["methods"] for r in figures["serving"]}
    assert set(serving) == {(a, p) for a in ("resnet18", "card") for p in ("fp32", "bf16")}
    for methods in serving.values():
        check_ratios(methods, "step_ms", {"x_source_eager": "source eager",
                                          "x_source_graphs": "source graphs"})
        assert "not CUDA" in methods["source graphs"]["graphs"]["fallback_reason"]
    assert "agree_fp32" in serving[("card", "bf16")]["source eager"]
    assert "| card 32 px b2 | bf16 | tent |" in (tmp_path / "gpu_serving.md").read_text()
    daf = json.loads((tmp_path / "gpu_daf.json").read_text())["steps"]
    assert set(daf) == {"dense", "daf8", "daf4", "dyn12"}
    assert daf["daf4"]["saved_mib_max"] < daf["daf8"]["saved_mib_max"]
    assert daf["dense"]["x_dense"] == 1.0 and daf["dyn12"]["cuda_step_peak_mib"] is None


def check_ratios(methods: dict, time_key: str, refs: dict[str, str]) -> None:
    """Each method's ratio `key` is its time over the time of method `refs[key]`, as
    computed here from the times the report holds (rounded: within 1 %)."""
    for label, row in methods.items():
        for key, ref in refs.items():
            want = row[time_key] / methods[ref][time_key]
            assert row[key] == pytest.approx(want, rel=1e-2), (label, key)


def test_gpu_check_refuses_an_unknown_argument():
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--fast"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("gpu_check.sh: unknown argument '--fast' (expected "
                                   "--dry-run or nothing)")
