"""`tta bench` machinery: a tiny run (2 domains, few samples, 3 methods) writes the report
files and gives the same accuracy twice; stream batching never straddles domains."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from helpers.models import make_model, tiny_stream

from tta_core.eval.bench_config import BenchConfig
from tta_core.eval.bench_inputs import batches_from_arrays, images_to_input
from tta_core.eval.bench_report import write_bench
from tta_core.eval.bench_run import run_methods


def test_batches_follow_domains_and_size() -> None:
    stream = tiny_stream(batch_size=4)
    assert [len(b.labels) for b in stream] == [4, 4, 4, 4, 4, 2, 2]
    assert [b.domain for b in stream] == ["clean"] * 3 + ["gaussian_noise"] * 3 + ["clean"]
    assert torch.equal(stream[0].x[1], images_to_input(
        np.random.default_rng(0).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8), {})[1])
    with pytest.raises(ValueError, match="lengths"):
        batches_from_arrays(stream[0].x, np.zeros(3), ["a"] * 4, 2)


@pytest.mark.slow
def test_tiny_bench_writes_files_and_is_deterministic(tmp_path) -> None:
    cfg = BenchConfig(methods=("source", "tent", "eata"), batch_size=4, samples_per_domain=12,
                      threads=1)
    stream = tiny_stream()
    runs1 = run_methods(stream, make_model, cfg, progress=False)
    runs2 = run_methods(stream, make_model, cfg, progress=False)
    preds1 = {r.method: [f.prediction for f in r.frames] for r in runs1}
    preds2 = {r.method: [f.prediction for f in r.frames] for r in runs2}
    assert preds1 == preds2
    assert preds1["tent"] != preds1["source"]  # adaptation changed something
    for r in runs1:
        assert len(r.frames) == 24 and r.wall_s > 0
        assert r.meta["rss_peak_mb"] >= r.meta["rss_start_mb"] > 0
        # on the CPU the peak is the RSS growth over the method's start, not the process's
        assert r.peak_memory_mb == pytest.approx(r.meta["rss_peak_mb"] - r.meta["rss_start_mb"])
        tot = r.frames[0].phases_ms["total"]
        assert tot >= r.frames[0].phases_ms["forward"] > 0
    files, text = write_bench(runs1, tmp_path, cfg, clean_accuracy=0.9)
    for p in (files.json, files.markdown, *files.plots):
        assert p.exists() and p.stat().st_size > 0
    data = json.loads(files.json.read_text())
    assert [s["method"] for s in data["summaries"]] == ["source", "tent", "eata"]
    src = next(r for r in runs1 if r.method == "source")
    acc = sum(f.prediction == f.label for f in src.frames if f.domain == "clean") / 14
    assert data["summaries"][0]["accuracy"]["clean"] == pytest.approx(acc)
    assert "| eata |" in text and "clean accuracy 90.0%" in text


def test_bench_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="nope"):
        BenchConfig(methods=("nope",)).validate()
    with pytest.raises(ValueError, match="mode"):
        BenchConfig(mode="both").validate()
    with pytest.raises(ValueError, match="severity"):
        BenchConfig(severity=6).validate()
    # an option the method lacks (tent has no sigma): refused before any data is read
    with pytest.raises(ValueError, match=r"option tent\.sigma: method tent has no option"):
        BenchConfig(methods=("tent",), method_options={"tent": {"sigma": 0.5}}).validate()


@pytest.mark.slow
def test_cli_bench_passes_method_options_and_refuses_bad_ones(tmp_path, capsys) -> None:
    from tta_core.cli import main as cli_main
    from tta_core.cli.commands.bench import _option

    assert _option("adashadow.sigma=0.5") == ("adashadow", "sigma", 0.5)
    assert _option("adashadow.loss=multilayer_kl") == ("adashadow", "loss", "multilayer_kl")
    assert _option("adashadow.domain_bank=true") == ("adashadow", "domain_bank", True)
    assert _option("tent.activation_bits=None") == ("tent", "activation_bits", None)
    assert _option("x.k=False") == ("x", "k", False)
    with pytest.raises(argparse.ArgumentTypeError, match=r"METHOD\.KEY=VALUE"):
        _option("sigma=0.5")
    out = tmp_path / "b"
    assert cli_main(["bench", "--methods", "adashadow", "--samples-per-domain", "1",
                     "--batch-size", "2", "--set", "adashadow.sigma=0.5", "--set",
                     "adashadow.memory_format=channels_last", "--out", str(out),
                     "--no-progress"]) == 0
    meta = json.loads((out / "report.json").read_text())["runs"][0]["meta"]
    assert meta["options"]["sigma"] == 0.5 and meta["memory_format"] == "channels_last"
    assert "| channels_last |" in (out / "report.md").read_text()
    with pytest.raises(SystemExit, match="'tent' is not among --methods"):
        cli_main(["bench", "--methods", "adashadow", "--set", "tent.lr=0.1", "--out",
                  str(out), "--no-progress"])
    with pytest.raises(SystemExit, match=r"tta: error: .*sigmaa"):  # no traceback
        cli_main(["bench", "--methods", "adashadow", "--samples-per-domain", "1",
                  "--set", "adashadow.sigmaa=0.5", "--out", str(out), "--no-progress"])


def test_live_telemetry_reaches_inline_planning() -> None:
    """A sampler (fake input: pi1 = 2, pi2 unknown) feeds AdaShadow's planning before each
    batch; the bench records what it fed; methods without telemetry are left alone."""
    from tta_core.eval.bench_config import BenchConfig
    from tta_core.eval.bench_run import run_method
    from tta_core.eval.live_telemetry import LiveExpansion
    from tta_core.model.zoo import build_model
    from tta_core.telemetry.sample import ResourceSample

    class FakeSampler:
        def sample(self) -> ResourceSample:
            return ResourceSample(compute_expansion=2.0)

    stream = batches_from_arrays(torch.randn(12, 3, 32, 32), np.zeros(12, dtype=int),
                                 ["a"] * 12, 4)
    cfg = BenchConfig(methods=("adashadow", "tent"), samples_per_domain=12)
    live = LiveExpansion(FakeSampler(), period_s=0.0)
    run = run_method("adashadow", build_model("small_resnet", 16), stream, cfg, live=live)
    assert run.meta["telemetry"] == {"pi1_mean": 2.0, "pi1_max": 2.0, "pi2_mean": 1.0,
                                     "pi2_max": 1.0, "batches": 3}
    tent = run_method("tent", build_model("small_resnet", 16), stream, cfg, live=live)
    assert "telemetry" not in tent.meta and not live.fed
    with pytest.raises(ValueError, match="neither 'live' nor a calibration file"):
        BenchConfig(telemetry="/nonexistent.json").validate()


@pytest.mark.slow
def test_measure_activations_reports_saved_mib(tmp_path) -> None:
    """--measure-activations: tent saves > 0 MiB per batch, source 0, surgeon (its codec's
    compressed bytes) less than tent; a variant (surgeon@robot) gets its own options and
    row; report.json and report.md carry the figures."""
    cfg = BenchConfig(methods=("source", "tent", "surgeon", "surgeon@robot"), batch_size=4,
                      samples_per_domain=12, threads=1, measure_activations=True,
                      method_options={"surgeon@robot": {"mode": "robot"}})
    runs = {r.method: r for r in run_methods(tiny_stream(), make_model, cfg, progress=False)}
    saved = {m: r.meta["saved_activations"] for m, r in runs.items()}
    assert saved["source"]["saved_mib_max"] == 0.0
    assert saved["tent"]["saved_mib_mean"] > 0.5 and saved["tent"]["reported_mib_mean"] == 0
    assert 0 < saved["surgeon"]["saved_mib_mean"] < saved["tent"]["saved_mib_mean"]
    assert saved["surgeon"]["measured_mib_mean"] == 0  # all under its codec, none twice
    assert saved["surgeon"]["batches"] == len(tiny_stream())
    assert runs["surgeon@robot"].meta["options"]["mode"] == "robot"
    assert runs["surgeon"].meta["options"].get("mode", "faithful") == "faithful"
    files, text = write_bench(list(runs.values()), tmp_path, cfg, clean_accuracy=0.9)
    assert "saved MiB (mean/max)" in text and "measured bytes" in text
    tent = saved["tent"]
    assert f"| {tent['saved_mib_mean']:.2f} / {tent['saved_mib_max']:.2f} |" in text
    data = json.loads(files.json.read_text())
    assert data["summaries"][1]["saved_mib_mean"] == pytest.approx(tent["saved_mib_mean"])
    plain = BenchConfig(methods=("tent",), samples_per_domain=12, threads=1)
    run = run_methods(tiny_stream(), make_model, plain, progress=False)[0]
    assert "saved_activations" not in run.meta
    _, text = write_bench([run], tmp_path / "plain", plain, clean_accuracy=0.9)
    assert "saved MiB" not in text
    with pytest.raises(ValueError, match="name one twice"):
        BenchConfig(methods=("tent", "tent")).validate()


def test_stream_batches_own_their_memory() -> None:
    """A batch that shared the stream's storage would be charged the whole stream by the
    saved-activation accounting (by storage) of any method that saves its input."""
    x = torch.randn(40, 32, 32, 3).permute(0, 3, 1, 2)  # NHWC images viewed as NCHW
    batches = batches_from_arrays(x, np.zeros(40), ["a"] * 20 + ["b"] * 20, 8)
    assert [len(b.labels) for b in batches] == [8, 8, 4, 8, 8, 4]
    for b in batches:
        assert b.x.is_contiguous()
        assert b.x.untyped_storage().nbytes() == b.x.numel() * b.x.element_size()
    assert torch.equal(torch.cat([b.x for b in batches]), x)


def test_domain_purity_counts_each_recognised_domain_by_its_majority() -> None:
    from tta_core.eval.report import FrameRecord, domain_purity

    def batch(true: str, seen: str, i: int) -> FrameRecord:
        return FrameRecord(true, 0, 0, i, recognised=seen)

    frames = [batch("fog", "d0", 0), batch("fog", "d0", 1), batch("snow", "d0", 2),
              batch("snow", "d1", 3), batch("snow", "", 4)]
    assert domain_purity(frames) == (2, 3 / 4)  # d0 = fog (2 of 3), d1 = snow; "" ignored
    assert domain_purity([batch("fog", "", 0)])[0] == 0


@pytest.mark.slow
def test_deadline_memory_budget_and_domain_bank_compose_on_adashadow(tmp_path) -> None:
    """One AdaShadow config with a camera deadline, a saved-activation budget and a domain
    bank: every batch holds the budget (measured saved bytes), the report names the
    domains recognised, and batches adapt within the deadline."""
    from tta_core.cli import main as cli_main

    out = tmp_path / "combo"
    budget = 0.25
    assert cli_main(["bench", "--methods", "adashadow", "--samples-per-domain", "12",
                     "--batch-size", "4", "--threads", "1", "--no-progress", "--out", str(out),
                     "--set", "adashadow.deadline_mode=camera", "--set",
                     "adashadow.camera_hz=100", "--set", f"adashadow.memory_budget_mb={budget}",
                     "--set", "adashadow.domain_bank=true"]) == 0
    run = json.loads((out / "report.json").read_text())["runs"][0]
    saved = run["meta"]["saved_activations"]
    assert saved["within_budget_share"] == 1.0 and 0 < saved["saved_mib_max"] <= budget
    batches = {f["batch_id"]: f for f in run["frames"]}.values()
    assert all(f["recognised"] for f in batches)
    assert any(f["adapted"] for f in batches)
    budgets = [f["budget_ms"] for f in batches if f["budget_ms"] is not None]
    assert budgets and max(budgets) <= 4 * 10.0 + 1e-6  # 4 frames at 100 Hz
    table = (out / "report.md").read_text()
    assert "domains found" in table and "in mem budget %" in table


def test_the_sequential_bench_warms_a_method_up_before_its_stream_as_a_node_does(
        monkeypatch) -> None:
    """A method that learns its run-time costs (api.WarmsUp) is warmed up once, on noise of
    a batch's shape, before the first real batch: a cold first batch (one-time allocations,
    several forwards' time) would otherwise teach the planner fixed costs that leave no
    plan for many batches. Its weights come back: the stream's predictions are those of a
    run whose warm-up does nothing (AdaShadow at sigma 1 without timing feedback: plans
    then do not depend on how fast a run is)."""
    from tta_core.adashadow.method import AdaShadow

    seen: list[tuple[int, ...]] = []
    warm = AdaShadow.warm_up

    def spy(self, x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return warm(self, x, *args, **kwargs)

    opts = {"adashadow": {"sigma": 1.0, "fixed_cost_feedback": 0.0,
                          "backward_feedback": 0.0, "forward_feedback": "off"}}
    cfg = BenchConfig(methods=("adashadow",), batch_size=4, threads=1, method_options=opts)
    stream = tiny_stream()
    monkeypatch.setattr(AdaShadow, "warm_up", lambda self, x: None)
    plain = run_methods(stream, make_model, cfg, progress=False)[0]
    monkeypatch.setattr(AdaShadow, "warm_up", spy)
    warmed = run_methods(stream, make_model, cfg, progress=False)[0]
    assert seen == [tuple(stream[0].x.shape)]
    assert [f.prediction for f in warmed.frames] == [f.prediction for f in plain.frames]
    assert any(f.adapted for f in warmed.frames)
