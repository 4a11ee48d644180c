"""A `tta sweep` cell with `--task segmentation` runs the mIoU bench (no Ray needed for one
cell): its summaries carry mean mIoU, SURGEON's online error, the measured cache and the
mIoU per condition, and the aggregation turns them into samples; rounds repeat the
sequence and are scored one by one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tta_core.data import scene_set as ss
from tta_core.sweep.aggregate import samples
from tta_core.sweep.run import run_cell
from tta_core.sweep.spec import Cell

CARD = Path(__file__).resolve().parents[2] / "checkpoints" / "lraspp_mobilenet_v3_large_scenes.json"


def _bench():
    from tta_core.cli.commands import bench
    from tta_core.sweep.run import BenchCLI

    return BenchCLI(bench.add_arguments, bench.config_from_args)


def test_segmentation_cell_reports_miou_online_error_and_cache(tmp_path, one_thread):
    ss.generate(tmp_path / "scenes", ss.SceneSetConfig(train=0, val=0, per_condition=2, seed=3),
                progress=False)
    opts = {"task": "segmentation", "data": f"acdc:{tmp_path / 'scenes'}",
            "model_card": str(CARD), "batch_size": 2, "samples_per_domain": 2, "rounds": 2,
            "threads": 1, "measure_activations": True, "methods": "source,tent", "seed": 1}
    cell = Cell(tuple(opts.items()))
    res = run_cell(_bench(), cell.argv(), str(tmp_path / "out"), str(Path.cwd()))
    assert res["status"] == "done", res.get("error")
    source, tent = res["summaries"]
    assert (source["method"], tent["method"]) == ("source", "tent")
    for s in (source, tent):
        assert 0 < s["mean_miou"] < 1
        assert s["online_error"] == pytest.approx(1 - s["mean_miou"])
        conds = [s[f"miou@{c}"] for c in ("fog", "night", "rain", "snow")]
        assert s["mean_miou"] == pytest.approx(sum(conds) / 4)
    assert source["cache_mib"] == 0 and tent["cache_mib"] > 1  # no update, one update
    import json

    record = json.loads((tmp_path / "out" / "seg_bench.json").read_text())
    first = record["results"][0]
    assert len(first["online_miou"]) == 2  # two rounds, scored apart
    # the source model does not change: both rounds score the same images alike
    assert first["online_miou"][0] == first["online_miou"][1]
    got = {(s.method, s.metric) for s in samples([{**res, "options": cell.as_dict}])}
    assert {("tent", "cache_mib"), ("tent", "miou@night"), ("source", "online_error")} <= got


@pytest.mark.slow
def test_variant_cells_run_their_own_options_after_a_warm_up(tmp_path, one_thread,
                                                           monkeypatch):
    """`adashadow@robust` with `--set adashadow@robust.bn_batch_values=0` runs as its own
    row with its own options over the segmentation settings (adashadow's: batch statistics
    where a batch gives 4096 values); each AdaShadow is warmed up once on noise of the
    batch's shape before its stream, as the node starts it."""
    from tta_core.adashadow.method import AdaShadow

    seen: list[tuple[int, ...]] = []
    warm = AdaShadow.warm_up
    monkeypatch.setattr(AdaShadow, "warm_up",
                        lambda self, x: (seen.append(tuple(x.shape)), warm(self, x))[1])
    ss.generate(tmp_path / "scenes", ss.SceneSetConfig(train=0, val=0, per_condition=1, seed=3),
                progress=False)
    opts = {"task": "segmentation", "data": f"acdc:{tmp_path / 'scenes'}",
            "model_card": str(CARD), "batch_size": 1, "samples_per_domain": 1,
            "threads": 1, "methods": "adashadow,adashadow@robust",
            "set": ["adashadow@robust.bn_batch_values=0"], "seed": 1}
    res = run_cell(_bench(), Cell(tuple(opts.items())).argv(), str(tmp_path / "out"),
                   str(Path.cwd()))
    assert res["status"] == "done", res.get("error")
    assert [s["method"] for s in res["summaries"]] == ["adashadow", "adashadow@robust"]
    import json

    ran = {r["method"]: r["options"] for r in json.loads(
        (tmp_path / "out" / "seg_bench.json").read_text())["results"]}
    assert ran["adashadow"]["bn_batch_values"] == 4096
    assert ran["adashadow@robust"]["bn_batch_values"] == 0
    from tta_core.model.source import load_source

    h, w = load_source(CARD)[1].input_hw
    assert seen == [(1, 3, h, w)] * 2
