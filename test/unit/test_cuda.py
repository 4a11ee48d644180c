"""Every method, the memory codec, the domain bank and the elastic sizes on an accelerator
give the predictions they give on the CPU, within float tolerance.

The device under test is `TTA_TEST_DEVICE` (default `cuda`; `cuda:N` for another card).
With a CUDA device these tests carry the `cuda` marker and are skipped where torch sees
none. `benchmarks/gpu_check.sh --dry-run` runs them with `TTA_TEST_DEVICE=cpu`: the same
code paths, the CPU compared with itself, so the script is tested where no GPU exists.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers.models import signs_batch, small_source

from tta_core.elasticdnn.gates import make_gated
from tta_core.model.zoo import build_model
from tta_core.registry import build_method

DEVICE = os.environ.get("TTA_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.cuda] if DEVICE.startswith("cuda") else []
METHODS = ["source", "bn_adapt", "tent", "eata", "sar", "cotta", "lame", "adashadow",
           "surgeon", "darda"]
SHAPE = (3, 32, 32)


@pytest.fixture(autouse=True)
def exact_math():
    """Full fp32 matmuls and convolutions on the GPU (TF32 off) for the comparisons."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _stream(n: int = 3) -> list[torch.Tensor]:
    """Sign images with a growing shift, in batches of 8."""
    x = signs_batch(8 * n, seed=3)
    return [x[8 * i:8 * (i + 1)] * (1 + 0.2 * i) + 0.1 * i for i in range(n)]


def _run(name: str, model: torch.nn.Module, device: str, xs: list[torch.Tensor],
         **settings) -> list[torch.Tensor]:
    """Logits of every step of `name` on `device`, on the CPU for comparison."""
    method = build_method(name, copy.deepcopy(model).to(device), input_shape=SHAPE,
                          arch=settings.pop("arch", "small_resnet"), **settings)
    outs = []
    for x in xs:
        res = method.step(x.to(device))
        assert res.logits.device.type == torch.device(device).type
        assert res.times.total_ms > 0 or res.times.forward_ms > 0
        outs.append(res.logits.cpu())
    method.close()
    return outs


def _assert_same(cpu: list[torch.Tensor], dev: list[torch.Tensor], atol: float) -> None:
    for i, (a, b) in enumerate(zip(cpu, dev, strict=True)):
        torch.testing.assert_close(b, a, atol=atol, rtol=1e-3, msg=f"batch {i}")


@pytest.mark.parametrize("name", METHODS)
def test_method_predictions_match_the_cpu(name):
    model, xs = small_source(), _stream()
    torch.manual_seed(0)
    cpu = _run(name, model, "cpu", xs)
    torch.manual_seed(0)
    _assert_same(cpu, _run(name, model, DEVICE, xs), atol=2e-3)


def test_quantized_saved_activations_match_the_cpu():
    """Tent at 4-bit saved activations (DAF codec; the Triton kernels on CUDA): widths and
    codes can differ where a value sits on a rounding edge, predictions may not."""
    model, xs = small_source(), _stream()
    cpu = _run("tent", model, "cpu", xs, activation_bits=4)
    dev = _run("tent", model, DEVICE, xs, activation_bits=4)
    _assert_same(cpu, dev, atol=5e-2)
    for a, b in zip(cpu, dev, strict=True):
        assert (a.argmax(1) == b.argmax(1)).float().mean() >= 0.9


def test_domain_bank_matches_the_cpu():
    model, xs = small_source(), _stream()
    settings = {"domain_bank": True, "trainable": "norm"}
    cpu = _run("adashadow", model, "cpu", xs, **settings)
    _assert_same(cpu, _run("adashadow", model, DEVICE, xs, **settings), atol=2e-3)


@pytest.mark.parametrize("keep", [1.0, 0.5])
def test_elastic_sizes_match_the_cpu(keep):
    torch.manual_seed(0)
    master = make_gated(build_model("small_resnet", 10))
    xs = _stream(3)
    outs = {}
    for device in ("cpu", DEVICE):
        method = build_method("elastic", copy.deepcopy(master).to(device),
                              input_shape=SHAPE, arch="small_resnet")
        method.set_size(keep if keep in method.sizes() else method.sizes()[-1])
        outs[device] = [method.step(x.to(device)).logits.cpu() for x in xs]
        method.close()
    _assert_same(outs["cpu"], outs[DEVICE], atol=2e-3)


def test_an_indexed_device_string_is_honoured():
    """`cuda:N` (or `cpu`) reaches every tensor the step makes."""
    torch.manual_seed(0)
    dev = torch.device(DEVICE if ":" in DEVICE or DEVICE == "cpu" else f"{DEVICE}:0")
    method = build_method("adashadow", small_source().to(dev), input_shape=SHAPE,
                          arch="small_resnet", sigma=1.0)
    for x in _stream(3):
        res = method.step(x.to(dev))
    assert res.logits.device == dev
    assert {p.device for p in method.model.parameters()} == {dev}
    method.close()


# ------------------------------------------------- CUDA graphs and mixed precision
# On CUDA: replays equal eager, one capture per batch shape (none per batch in steady
# state), fp16 predicts like fp32. With TTA_TEST_DEVICE=cpu the same tests check the
# fallback (eager, with its reason) and bf16 in place of fp16.
CUDA = torch.device(DEVICE).type == "cuda"
REDUCED = "fp16" if CUDA else "bf16"
AGREE = 0.99 if CUDA else 0.95  # bf16 keeps 8 mantissa bits, fp16 11


def _method(name: str, device: str, **settings):
    torch.manual_seed(0)
    return build_method(name, small_source().to(device), input_shape=SHAPE,
                        arch="small_resnet", memory_format="contiguous", **settings)


@pytest.mark.parametrize("name", ["source", "bn_adapt"])
def test_graphed_served_forward_equals_eager_and_captures_once_per_shape(name):
    graphed, eager = _method(name, DEVICE), _method(name, DEVICE, cuda_graphs=False)
    xs = [x.to(DEVICE) for x in _stream(3)]
    for i, x in enumerate(xs):
        torch.testing.assert_close(graphed.step(x).logits, eager.step(x).logits,
                                   atol=1e-4, rtol=1e-4, msg=f"batch {i}")
    g = graphed.graphs
    if not CUDA:
        assert g.captures == 0 and "not CUDA" in g.fallback_reason
        return
    assert g.fallback_reason == "" and g.graphed
    assert (g.captures, g.replays) == (1, 3)  # steady state: no capture per batch
    small = xs[0][:4]
    torch.testing.assert_close(graphed.step(small).logits, eager.step(small).logits,
                               atol=1e-4, rtol=1e-4)
    assert g.captures == 2 and g.cached == 2  # a new shape captures once more
    graphed.step(xs[1])
    assert g.captures == 2 and g.replays == 5
    assert eager.graphs.captures == 0 and "cuda_graphs=False" in eager.graphs.fallback_reason
    graphed.close()
    assert g.cached == 0


@pytest.mark.skipif(not CUDA, reason="graph capture needs a CUDA device")
def test_graph_cache_keys_on_signature_and_evicts_the_least_recent():
    from tta_core.runtime.graphs import GraphedForward

    model = small_source().to(DEVICE).eval()
    g = GraphedForward(model, max_graphs=2)
    x = _stream(1)[0].to(DEVICE)
    for sig in ("a", "a", "b"):
        g(x, signature=sig)
    assert (g.captures, g.cached) == (2, 2)
    g(x[:2])  # a third key: the least recently used ("a") goes
    g(x, signature="b")
    assert (g.captures, g.cached) == (3, 2)
    g(x, signature="a")
    assert g.captures == 4
    with torch.no_grad():
        torch.testing.assert_close(g(x, signature="a"), model(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["source", "bn_adapt", "tent"])
def test_reduced_precision_predicts_like_fp32(name):
    """fp16 on CUDA: >= 99 % of the predictions are fp32's (bf16 on the CPU: >= 95 %);
    the logits returned are fp32."""
    xs = [x.to(DEVICE) for x in signs_batch(256 if CUDA else 64, seed=11).split(8)]
    full, half = _method(name, DEVICE), _method(name, DEVICE, precision=REDUCED)
    a = torch.cat([full.step(x).logits for x in xs])
    b = torch.cat([half.step(x).logits for x in xs])
    assert b.dtype == torch.float32
    agree = float((a.argmax(1) == b.argmax(1)).float().mean())
    assert agree >= AGREE, f"{name} at {REDUCED}: {agree:.3f} of predictions equal fp32's"
    full.close()
    half.close()


@pytest.mark.skipif(not CUDA, reason="graph capture needs a CUDA device")
def test_a_failed_capture_serves_eagerly_and_says_why():
    """A forward that reads the device from the host cannot be captured: the graphed
    forward says so once and keeps serving the right answer eagerly. (Last in the file:
    it leaves a capture that failed behind it.)"""
    from tta_core.runtime.graphs import GraphedForward

    g = GraphedForward(lambda t: t * float(t.abs().sum() > 0), name="host read")
    x = torch.ones(4, 3, device=DEVICE)
    torch.testing.assert_close(g(x), x)
    assert not g.graphed and "capture failed" in g.fallback_reason and g.captures == 0
    torch.testing.assert_close(g(2 * x), 2 * x)
