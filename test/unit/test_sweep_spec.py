"""The sweep's spec (grid, exclusions, one-line errors), its cell keys (stable, sensitive to
every input) and its statistics (t-interval and paired t-test against scipy)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from tta_core.errors import InputError
from tta_core.sweep.aggregate import Sample, aggregate, mean_ci, paired
from tta_core.sweep.run import cell_key
from tta_core.sweep.spec import Cell, parse_spec

KNOWN = ["methods", "set", "batch_size", "seed", "data", "stream_hz", "samples_per_domain",
         "threads", "order", "severity", "model", "out", "no_progress"]


def _spec(**raw: object):
    return parse_spec({"name": "t", **raw}, KNOWN)


def test_grid_is_the_cartesian_product_less_exclusions() -> None:
    spec = _spec(base={"threads": 1}, grid={"methods": ["a", "b"], "batch-size": [4, 16],
                                            "seed": [0, 1, 2]},
                 exclude=[{"methods": "b", "batch_size": 16}])
    cells = spec.cells()
    assert len(cells) == 2 * 2 * 3 - 3
    points = {(c.method, c.as_dict["batch_size"], c.seed) for c in cells}
    assert ("b", 16, 0) not in points and ("b", 4, 2) in points and ("a", 16, 1) in points
    assert all(c.as_dict["threads"] == 1 for c in cells)
    assert cells[0].argv() == ["--threads", "1", "--methods", "a", "--batch-size", "4",
                               "--seed", "0"]


def test_repeatable_options_and_flags_become_arguments() -> None:
    cell = Cell((("set", ["tent.lr=0.1", "eata.e_margin=0.4"]), ("stream_hz", "250,1000"),
                 ("threads", True), ("order", False)))
    assert cell.argv() == ["--set", "tent.lr=0.1", "--set", "eata.e_margin=0.4",
                           "--stream-hz", "250,1000", "--threads"]


def test_a_set_reaches_only_the_cells_of_the_method_it_names() -> None:
    """Variants of one method configured in one base: each cell gets its own entries, a
    cell of another method none (its bench would refuse a --set for a method it lacks)."""
    spec = _spec(base={"set": ["darda@full.variant=full", "darda@bn.variant=bn_only",
                               "darda@full.bundle_path=b.safetensors"]},
                 grid={"methods": ["darda@full", "darda@bn", "tent"]})
    by_method = {c.method: c for c in spec.cells()}
    assert by_method["darda@full"].as_dict["set"] == ["darda@full.variant=full",
                                                      "darda@full.bundle_path=b.safetensors"]
    assert by_method["darda@bn"].argv() == ["--set", "darda@bn.variant=bn_only",
                                            "--methods", "darda@bn"]
    assert "set" not in by_method["tent"].as_dict
    # a variant's entries name the variant: its cells compare with the others'
    assert {c.condition for c in spec.cells()} == {()}
    sigma = _spec(grid={"methods": ["adashadow"], "set": [["adashadow.sigma=0.3"],
                                                         ["adashadow.sigma=0.5"]]})
    assert len({c.condition for c in sigma.cells()}) == 2  # a plain method's set is a condition


def test_condition_holds_everything_but_method_and_seed() -> None:
    a, b = _spec(grid={"methods": ["x", "y"], "seed": [0, 1], "severity": [3]}).cells()[:2]
    assert a.condition == b.condition == (("severity", 3),)


@pytest.mark.parametrize("raw, message", [
    ({"grid": {"bogus": [1]}}, "'bogus' is not a `tta bench` option"),
    ({"base": {"out": "x"}, "grid": {"seed": [0]}}, "'out' is set by the sweep itself"),
    ({"grid": {"seed": []}}, "'seed' has no values"),
    ({"grid": {"seed": [0]}, "colour": 1}, "unknown top-level key(s) colour"),
    ({"grid": {"methods": ["a"]}, "baseline": "zzz"}, "baseline 'zzz' is not among"),
    ({"grid": {"methods": ["a"]}, "exclude": [{"methods": "a"}]}, "leaves no cell"),
    ({"grid": {"seed": [0]}, "exclude": {"seed": 0}}, "expected a list"),
    ({"grid": [1, 2]}, "sweep grid: expected a mapping"),
])
def test_bad_spec_gives_one_line_naming_it(raw: dict, message: str) -> None:
    with pytest.raises(InputError) as exc:
        _spec(**raw)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_cell_key_is_stable_and_sensitive(tmp_path: Path) -> None:
    cell = Cell((("methods", "tent"), ("seed", 0)))
    key = cell_key(cell, tmp_path, "v1")
    assert key == cell_key(Cell((("methods", "tent"), ("seed", 0))), tmp_path, "v1")
    assert len(key) == 16
    others = {cell_key(Cell((("methods", "tent"), ("seed", 1))), tmp_path, "v1"),
              cell_key(Cell((("methods", "bn_adapt"), ("seed", 0))), tmp_path, "v1"),
              cell_key(cell, tmp_path, "v2"),
              cell_key(cell, tmp_path / "elsewhere", "v1")}
    assert key not in others and len(others) == 4


def test_cell_key_follows_the_data_content(tmp_path: Path) -> None:
    data = tmp_path / "imgs"
    data.mkdir()
    (data / "a.txt").write_text("1")
    cell = Cell((("methods", "tent"), ("data", f"folder:{data}")))
    first = cell_key(cell, tmp_path, "v1")
    assert cell_key(cell, tmp_path, "v1") == first
    (data / "b.txt").write_text("1")  # identity: file listing and sizes, not every byte
    second = cell_key(cell, tmp_path, "v1")
    (data / "b.txt").write_text("22")
    assert len({first, second, cell_key(cell, tmp_path, "v1")}) == 3


def test_mean_ci_matches_scipy_t_interval() -> None:
    xs = [0.41, 0.44, 0.39, 0.47, 0.43]
    ci = mean_ci(xs)
    lo, hi = stats.t.interval(0.95, len(xs) - 1, loc=np.mean(xs), scale=stats.sem(xs))
    assert ci.mean == pytest.approx(np.mean(xs), abs=1e-15)
    assert (ci.low, ci.high) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert ci.n == 5
    assert math.isnan(mean_ci([0.5]).half_width) and mean_ci([0.5]).mean == 0.5
    assert mean_ci([0.3, 0.3, 0.3]).half_width == 0.0


def test_paired_t_test_on_a_hand_example() -> None:
    # differences 0.02, 0.03, 0.01, 0.02: mean 0.02, sd sqrt(2/3)/100, t = 0.02/(sd/2) = 4.899
    method, base = [0.52, 0.63, 0.41, 0.72], [0.50, 0.60, 0.40, 0.70]
    res = paired(method, base)
    assert res.diff.mean == pytest.approx(0.02)
    t = 0.02 / (math.sqrt(2 / 3) / 100 / 2)
    assert t == pytest.approx(4.898979, rel=1e-6)
    assert res.p_value == pytest.approx(2 * stats.t.sf(t, 3), rel=1e-6)
    assert res.p_value == pytest.approx(stats.ttest_rel(method, base).pvalue, rel=1e-12)
    assert res.marker == "*"
    assert paired([0.5, 0.6, 0.55], [0.52, 0.58, 0.55]).marker == ""


def test_aggregate_pairs_by_seed_within_a_condition() -> None:
    cond = (("severity", 5),)
    s = [Sample(cond, "base", seed, "mean_accuracy", v) for seed, v in [(0, .5), (1, .6), (2, .7)]]
    s += [Sample(cond, "m", seed, "mean_accuracy", v) for seed, v in [(2, .75), (0, .52)]]
    s += [Sample((("severity", 3),), "m", 0, "mean_accuracy", 0.9)]  # no baseline there
    rows = {(r.condition.get("severity"), r.method): r for r in aggregate(s, "base")}
    m5 = rows[(5, "m")]
    assert m5.ci.n == 2 and m5.ci.mean == pytest.approx(0.635)
    assert m5.vs_baseline is not None and m5.vs_baseline.diff.n == 2  # seeds 0 and 2 only
    assert m5.vs_baseline.diff.mean == pytest.approx(((.52 - .5) + (.75 - .7)) / 2)
    assert rows[(5, "base")].vs_baseline is None and rows[(3, "m")].vs_baseline is None
