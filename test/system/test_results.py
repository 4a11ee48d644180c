"""docs/results and README's headline table are rendered from benchmark JSON, never typed:
the committed pages equal what `python benchmarks/results.py` renders now, every results
JSON has a page and its provenance, and a saved result is strict JSON."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import numpy as np
import pytest
from helpers import ROOT

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("results", ROOT / "benchmarks" / "results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["results"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_committed_pages_and_readme_equal_their_rendering(results) -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in results.expected_files().items()
             if not p.exists() or p.read_text() != text]
    assert stale == [], "run `python benchmarks/results.py` and commit: " + ", ".join(stale)


def test_readme_blocks_come_from_the_json(results) -> None:
    readme = (ROOT / "README.md").read_text()
    for name, (stem, render) in results.README_BLOCKS.items():
        begin, end = results.markers(name)
        assert begin in readme and end in readme, name
        data = json.loads((results.RESULTS / f"{stem}.json").read_text())
        block = readme.split(begin)[1].split(end)[0]
        assert block.strip() == render(data).strip(), name
    head = json.loads((results.RESULTS / "paper_ratios.json").read_text())
    for run in head["runs"]:  # the figures a reader compares, found as printed
        assert f"{run['methods']['adashadow']['x_tent']:.2f}" in readme


def test_every_results_json_has_a_page_and_provenance(results) -> None:
    jsons = sorted(results.RESULTS.glob("*.json"))
    assert jsons
    for path in jsons:
        assert results.page_for(path.stem) is not None, path.name
        prov = json.loads(path.read_text())["provenance"]
        assert {"command", "machine", "date", "code"} <= prov.keys(), path.name


def test_save_writes_strict_json_with_provenance_and_its_page(results, tmp_path) -> None:
    data = json.loads((results.RESULTS / "paper_ratios.json").read_text())
    data.pop("provenance")
    path = results.save("paper_ratios", data, tmp_path, argv=["benchmarks/x.py", "--a", "1"])
    saved = json.loads(path.read_text())
    assert saved["provenance"]["command"].endswith("x.py --a 1")
    page = (tmp_path / "paper_ratios.md").read_text()
    assert page.startswith("---\n") and "x.py --a 1" in page
    path = results.save("paper_ratios", {**data, "unmeasured": math.nan}, tmp_path)
    assert "NaN" not in path.read_text()  # strict readers refuse a bare NaN
    assert json.loads(path.read_text(), parse_constant=pytest.fail)["unmeasured"] is None


def test_a_hand_edited_page_is_found_stale(results, tmp_path) -> None:
    for name in ("paper_ratios.json", "paper_ratios.md"):
        (tmp_path / name).write_text((results.RESULTS / name).read_text())
    files = results.expected_files(tmp_path, tmp_path / "README.md")
    assert files[tmp_path / "paper_ratios.md"] == (tmp_path / "paper_ratios.md").read_text()
    (tmp_path / "paper_ratios.md").write_text("typed by hand\n")
    stale = [p for p, text in results.expected_files(tmp_path, tmp_path / "README.md").items()
             if not p.exists() or p.read_text() != text]
    assert tmp_path / "paper_ratios.md" in stale



@pytest.fixture(scope="module")
def bench(results):
    spec = importlib.util.spec_from_file_location(
        "bench_paper_ratios", ROOT / "benchmarks" / "speed" / "bench_paper_ratios.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_paper_ratios"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_ratio_interval_covers_the_ratio_and_widens_with_the_load(results, bench) -> None:
    rng = np.random.default_rng(1)
    ref = list(100.0 + rng.uniform(0, 5, 60))
    steady = bench.ratio_interval([1.3 * v for v in ref], ref)
    assert steady == pytest.approx((1.3, 1.3))  # a round's load cancels in the ratio
    noisy = [1.3 * v + w for v, w in zip(ref, rng.exponential(40, 60), strict=True)]
    lo, hi = bench.ratio_interval(noisy, ref)
    assert lo < float(np.median(noisy) / np.median(ref)) < hi and hi - lo > 0.05
    assert all(math.isnan(v) for v in bench.ratio_interval(ref[:2], ref[:2]))
    row = {"x_inference": 1.31, "x_inference_ci95": [1.24, 1.42], "x_tent": 1.0,
           "x_tent_ci95": [None, None]}  # its own reference: null in the JSON
    assert results.with_interval(row, "x_inference") == "1.31 (1.24–1.42)"
    assert results.with_interval(row, "x_tent") == "1.00"
