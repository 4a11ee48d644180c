"""Memory format of a method's model (tta_core.model.memory_format): forced and measured
choices, the timing probe leaves the model and the global RNG alone, and a method runs the
same numbers in either format."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tta_core.model.memory_format import apply_memory_format, time_formats
from tta_core.model.source import load_source
from tta_core.registry import build_method

CARD = "checkpoints/small_resnet_signs32.json"


def _cl(model: nn.Module) -> bool:
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    return all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)


def test_bad_format_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"memory_format must be one of .* got 'nhwc'"):
        build_method("bn_adapt", load_source(CARD)[0], memory_format="nhwc")


def test_forced_formats_and_when_auto_stays_contiguous() -> None:
    model = load_source(CARD)[0]
    assert apply_memory_format(model, "channels_last").format == "channels_last"
    assert _cl(model)
    assert apply_memory_format(model, "contiguous").format == "contiguous" and not _cl(model)
    # auto without an input shape, or a model without 2-D convolutions: nothing to measure
    assert apply_memory_format(model, "auto").format == "contiguous" and not _cl(model)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    assert apply_memory_format(mlp, "auto", (3, 2, 2)) == apply_memory_format(mlp, "auto")


def test_timing_probe_leaves_model_modes_statistics_and_rng_alone() -> None:
    model = load_source(CARD)[0]
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    ms = time_formats(model, (3, 32, 32), batch_stats=True, runs=1, passes=1)
    assert set(ms) == {"contiguous", "channels_last"} and all(v > 0 for v in ms.values())
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not _cl(model)


def test_auto_applies_what_it_measured() -> None:
    model = load_source(CARD)[0]
    choice = apply_memory_format(model, "auto", (3, 32, 32), batch_stats=True)
    faster = choice.measured_ms["channels_last"] <= 0.9 * choice.measured_ms["contiguous"]
    assert choice.format == ("channels_last" if faster else "contiguous")
    assert _cl(model) == faster


@pytest.mark.parametrize("method", ["bn_adapt", "tent", "adashadow"])
def test_a_method_computes_the_same_in_both_formats(method: str) -> None:
    """Same predictions and the same adapted parameters (float summation order aside)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 32, 32, generator=g) * 1.5 for _ in range(3)]
    out = {}
    for fmt in ("contiguous", "channels_last"):
        # adashadow: plans from the cost model only (learnt fixed costs depend on how
        # fast each format ran, and a different plan adapts differently)
        extra = {"fixed_cost_feedback": 0.0} if method == "adashadow" else {}
        meth = build_method(method, load_source(CARD)[0], memory_format=fmt,
                            input_shape=(3, 32, 32), **extra)
        assert meth.format.format == fmt and _cl(meth.model) == (fmt == "channels_last")
        logits = [meth.step(x).logits for x in xs]
        params = {k: v.detach().clone() for k, v in meth.model.state_dict().items()}
        out[fmt] = (logits, params)
        meth.close()
    for a, b in zip(out["contiguous"][0], out["channels_last"][0], strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    for k, v in out["contiguous"][1].items():
        w = out["channels_last"][1][k]
        assert v.shape == w.shape and (not v.is_floating_point()
                                       or torch.allclose(v, w, atol=1e-4, rtol=1e-4)), k
