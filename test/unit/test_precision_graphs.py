"""Mixed precision (runtime.precision) and CUDA graphs of the served forward
(runtime.graphs) on the CPU: bf16 autocast really runs and predicts like fp32, what a loss
reads is fp32, fp16 off CUDA and unknown values are refused in one line naming the value,
the graphed forward falls back to eager with its reason and the same outputs. The CUDA side
(replays equal to eager, captures counted) is in test_cuda.py."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
from helpers.models import signs_batch, small_source

from tta_core.api import PhaseClock
from tta_core.registry import build_method
from tta_core.runtime import losses
from tta_core.runtime.graphs import GraphedForward
from tta_core.runtime.precision import (
    PRECISIONS,
    autocast_for,
    check_precision,
    fp32_logits,
    precision_error,
)

SHAPE = (3, 32, 32)


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return signs_batch(64, seed=5)


def _logits(name: str, x: torch.Tensor, **settings) -> torch.Tensor:
    torch.manual_seed(0)
    method = build_method(name, small_source(), input_shape=SHAPE, arch="small_resnet",
                          memory_format="contiguous", **settings)
    out = torch.cat([method.step(xb).logits for xb in x.split(8)])
    method.close()
    return out


@pytest.mark.parametrize("name", ["source", "bn_adapt", "tent"])
def test_bf16_on_the_cpu_predicts_like_fp32(name, batch):
    fp32 = _logits(name, batch)
    bf16 = _logits(name, batch, precision="bf16")
    assert bf16.dtype == torch.float32  # the returned logits are fp32
    assert not torch.equal(bf16, fp32)  # the bf16 forward really ran
    agree = (bf16.argmax(1) == fp32.argmax(1)).float().mean()
    assert agree >= 0.95, float(agree)


def test_bf16_autocast_runs_the_model_in_bf16_and_the_loss_reads_fp32(batch):
    model = small_source().eval()
    with autocast_for("cpu", "bf16"):
        raw = model(batch[:8])
    assert raw.dtype == torch.bfloat16
    logits = fp32_logits(raw)
    assert logits.dtype == torch.float32
    assert losses.entropy_loss(logits).dtype == torch.float32
    assert fp32_logits(logits) is logits


def test_tent_at_bf16_keeps_loss_bn_and_optimizer_state_in_fp32(batch):
    method = build_method("tent", small_source(), input_shape=SHAPE, arch="small_resnet",
                          precision="bf16")
    seen = []
    method.loss = lambda logits: seen.append(logits.dtype) or losses.entropy_loss(logits)
    res = method.step(batch[:8])
    assert res.adapted and seen == [torch.float32]
    assert {p.dtype for p in method.model.parameters()} == {torch.float32}
    assert {b.dtype for b in method.model.buffers() if b.is_floating_point()} <= {torch.float32}
    moments = [s[k] for s in method.optimizer.state.values()  # Adam at 32 px (the preset)
               for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    method.close()


def test_fp16_on_the_cpu_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        autocast_for("cpu", "fp16")
    assert "'fp16'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"source: precision='fp16' needs a CUDA device"):
        build_method("source", small_source(), precision="fp16")


@pytest.mark.parametrize("bad", ["fp8", "FP16", "", 16, None])
def test_bad_precision_values_are_refused_naming_the_value(bad):
    assert repr(bad) in precision_error(bad)
    with pytest.raises(ValueError, match="not one of fp32, fp16, bf16"):
        check_precision(bad)
    with pytest.raises(ValueError) as err:
        build_method("bn_adapt", small_source(), precision=bad)
    assert repr(bad) in str(err.value) and "\n" not in str(err.value)


def test_a_method_without_reduced_precision_refuses_it():
    with pytest.raises(ValueError, match=r"eata: precision='bf16' is not taken by this "
                                         r"method \(it serves fp32\)"):
        build_method("eata", small_source(), precision="bf16")


def test_every_precision_is_valid_on_cuda_and_fp32_needs_no_autocast():
    assert all(precision_error(p, "cuda") == "" for p in PRECISIONS)
    with autocast_for("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")


def test_graphed_forward_on_the_cpu_is_eager_with_its_reason(batch, caplog):
    model = small_source().eval()
    graphed = GraphedForward(model, name="probe")
    assert graphed.fallback_reason == ""
    with caplog.at_level(logging.INFO, logger="tta_core.runtime.graphs"):
        outs = [graphed(xb) for xb in batch.split(8)]
    with torch.no_grad():
        eager = [model(xb) for xb in batch.split(8)]
    assert all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))
    assert not graphed.graphed and "not CUDA" in graphed.fallback_reason
    assert graphed.captures == graphed.replays == graphed.cached == 0
    said = [r for r in caplog.records if "probe" in r.getMessage()]
    assert len(said) == 1  # reported once, not per batch
    assert not outs[0].requires_grad


def test_graphs_off_and_methods_without_graphs_say_why(batch):
    assert "off" in GraphedForward(lambda x: x, enabled=False).fallback_reason
    for name, reason in (("source", "not CUDA"), ("tent", "serves eagerly")):
        method = build_method(name, small_source(), input_shape=SHAPE, arch="small_resnet")
        method.step(batch[:8])
        assert reason in method.graphs.fallback_reason
        assert method.graphs.captures == 0
        method.close()
    off = build_method("source", small_source(), cuda_graphs=False)
    assert "cuda_graphs=False" in off.graphs.fallback_reason
    with pytest.raises(ValueError, match=r"cuda_graphs='yes' must be true or false"):
        build_method("source", small_source(), cuda_graphs="yes")


def test_graphed_source_equals_plain_eval_forward(batch):
    model = small_source()
    method = build_method("source", model, memory_format="contiguous")
    ref = small_source().eval()
    with torch.no_grad():
        assert torch.equal(method.step(batch[:8]).logits, ref(batch[:8]))


def test_phase_clock_events_are_none_on_the_cpu():
    clock = PhaseClock("cpu")
    start, end = clock.event(), clock.event()
    assert start is None and end is None
    assert math.isnan(PhaseClock.elapsed_ms(start, end))
    clock.mark()
    time.sleep(0.02)
    slept = clock.mark()  # milliseconds since the previous mark
    assert 20.0 <= slept < 10_000.0, slept
    assert clock.mark() < slept  # from the last mark, not from the first


def test_bench_passes_precision_to_the_methods_that_take_it():
    from helpers.models import make_model, tiny_stream

    from tta_core.eval.bench_config import BenchConfig, method_options, precision_note
    from tta_core.eval.bench_run import run_methods

    cfg = BenchConfig(methods=("source", "eata"), batch_size=4, samples_per_domain=12,
                      threads=1, precision="bf16")
    cfg.validate()
    assert method_options("source", cfg, SHAPE)["precision"] == "bf16"
    assert "precision" not in method_options("eata", cfg, SHAPE)
    assert precision_note(cfg, cfg.methods) == ("precision bf16: eata run fp32 (their "
                                                "forwards do not take it)")
    runs = {r.method: r.meta for r in run_methods(tiny_stream(), make_model, cfg,
                                                  progress=False)}
    assert runs["source"]["precision"] == "bf16" and runs["eata"]["precision"] == "fp32"
    assert "not CUDA" in runs["source"]["cuda_graphs"]["fallback_reason"]
    assert runs["source"]["cuda_graphs"]["captures"] == 0
    with pytest.raises(ValueError, match="precision='fp16' needs a CUDA device"):
        BenchConfig(precision="fp16").validate()
    with pytest.raises(ValueError, match="precision='half' not one of"):
        BenchConfig(precision="half").validate()
