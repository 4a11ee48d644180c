"""Saved-activation codec (tta_core.memory.codec): exactness where it must be exact, pruning
fidelity monotone in keep, measured bytes = predicted bytes, safe dedup, eager-only guard."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.models import entropy, grads_by_name
from torch import nn
from torchvision.models import resnet18

from tta_core.memory import (
    ActivationCodec,
    CodecPlan,
    SavedActivationCounter,
    predicted_bytes,
    profile_saves,
)
from tta_core.memory.bits import _pack_shift, _unpack_shift, pack_bits, packed_size, unpack_bits
from tta_core.memory.packed import prune_mask
from tta_core.memory.scope import ACT, OTHER, WGRAD
from tta_core.model.units import decompose
from tta_core.model.zoo import SmallResNet

KEEPS = (0.1, 0.3, 0.5, 0.8, 1.0)


pytestmark = pytest.mark.usefixtures("one_thread")


def _cos(a: dict, b: dict, names: list[str]) -> float:
    u = torch.cat([a[n].double().flatten() for n in names])
    v = torch.cat([b[n].double().flatten() for n in names])
    return float(u @ v / (u.norm() * v.norm()))


def _small() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return SmallResNet(num_classes=10).train(), torch.randn(8, 3, 32, 32)


def _r18(px: int = 64) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return resnet18(num_classes=10).train(), torch.randn(2, 3, px, px)


def test_bit_packing_round_trips_every_byte_pattern() -> None:
    patterns = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool().flatten()
    packed = pack_bits(patterns)
    assert torch.equal(packed, torch.arange(256, dtype=torch.uint8))  # little bit order
    assert torch.equal(unpack_bits(packed, 2048), patterns)
    odd = torch.rand(3, 5, 7) > 0.5  # 105 entries: padded last byte
    assert pack_bits(odd).numel() == packed_size(105) == 14
    assert torch.equal(unpack_bits(pack_bits(odd), 105).view(3, 5, 7), odd)
    assert torch.equal(_pack_shift(patterns.view(torch.uint8)), packed)
    assert torch.equal(_unpack_shift(packed), patterns)
    with pytest.raises(TypeError, match="float32"):
        pack_bits(torch.zeros(8))


@pytest.mark.parametrize("build", [_small, _r18])
def test_keep_one_gives_bit_identical_gradients(build) -> None:
    model, x = build()
    ref = grads_by_name(model, x)
    codec = ActivationCodec(model, CodecPlan.uniform(1.0))  # ReLU saves as 1-bit masks
    got = grads_by_name(model, x, codec)
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert codec.result.by_role[ACT] > 0  # the masks were really used


def test_relu6_and_hardtanh_masks_are_exact() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
                        nn.Conv2d(8, 8, 3, padding=1), nn.Hardtanh(-0.5, 0.5),
                        nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).train()
    x = 3 * torch.randn(4, 3, 8, 8)
    ref = grads_by_name(net, x)
    codec = ActivationCodec(net, CodecPlan.uniform(1.0))
    got = grads_by_name(net, x, codec)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert codec.result.by_role[ACT] == 2 * packed_size(4 * 8 * 8 * 8)


def test_bn_gradients_exact_when_only_conv_inputs_are_pruned() -> None:
    model, x = _r18()
    ref = grads_by_name(model, x)
    got = grads_by_name(model, x, ActivationCodec(model, CodecPlan.uniform(0.3)))
    bn = [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    bn_params = [f"{m}.{p}" for m in bn for p in ("weight", "bias")]
    for n in bn_params:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-6)
    conv_w = [n for n in ref if n.endswith("weight") and ref[n].dim() == 4]
    assert _cos(got, ref, conv_w) < 0.99  # pruning really changed the conv gradients


@pytest.mark.parametrize("build", [_small, pytest.param(_r18, marks=pytest.mark.slow)])
def test_conv_gradient_cosine_rises_with_keep(build) -> None:
    model, x = build()
    ref = grads_by_name(model, x)
    weights = [n for n in ref if n.endswith("weight") and ref[n].dim() > 1]
    cos = [_cos(grads_by_name(model, x, ActivationCodec(model, CodecPlan.uniform(k))), ref, weights)
           for k in KEEPS]
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(cos)), cos
    assert cos[-1] == pytest.approx(1.0, abs=1e-12)
    assert cos[0] < 0.95  # keep 0.1 is visibly lossy (the test could fail the other way)


@pytest.mark.parametrize("plan", [
    CodecPlan.uniform(0.3),
    CodecPlan.uniform(0.1, act_masks=False),
    CodecPlan({"conv1": "dense", "layer1.0.conv1": 0.1, "layer2.0.downsample.0": 0.5,
               "fc": 0.5}, default=0.3),
])
def test_measured_bytes_match_prediction(plan: CodecPlan) -> None:
    model, x = _r18()
    staged = decompose(model, (3, 64, 64))
    profile = profile_saves(staged, x, entropy)
    codec = ActivationCodec(staged, plan)
    with codec:
        entropy(model(x))
    measured, predicted = codec.result.total, predicted_bytes(profile, plan)
    assert abs(measured - predicted.total) <= 0.05 * measured, (measured, predicted.total)
    assert predicted.per_unit.keys() == codec.result.per_unit.keys()
    counter = SavedActivationCounter(staged)
    with counter:
        entropy(model(x))
    dense = counter.result.total
    if plan.act_masks:
        assert measured < 0.9 * dense
    else:  # a ReLU holds its output dense: pruning the next conv's reference frees nothing
        assert measured > 0.95 * dense
    assert predicted_bytes(profile, CodecPlan.uniform("dense", act_masks=False)).total \
        == counter.result.total


def test_one_encoding_for_a_tensor_two_convs_read() -> None:
    torch.manual_seed(0)

    class Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) * self.b(x)

    net, x = Fork(), torch.randn(2, 4, 16, 16)
    results = {}
    for name, plan in (("same", CodecPlan.uniform(0.5)),
                       ("split", CodecPlan({"a": 0.5, "b": 0.25}))):
        codec = ActivationCodec(net, plan)
        with codec:
            net(x)
        results[name] = codec.result

    def pruned(keep: float) -> int:
        kept = int(prune_mask(x.reshape(-1), keep, 65536).sum())
        return packed_size(x.numel()) + 4 * kept

    assert results["same"].by_role[WGRAD] == pruned(0.5) < 0.6 * x.nbytes  # stored once
    assert results["split"].by_role[WGRAD] == pruned(0.5) + pruned(0.25)
    assert results["same"].by_role[OTHER] == 2 * x.nbytes  # the product keeps both outputs
    assert results["same"].saves == results["split"].saves == 4


class _TwoBranch(nn.Module):
    """Two in-place ReLU outputs of one shape: the first dies before the second is made, so
    an allocator may give the second the first's address (same shape, stride and _version)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.relu = nn.Linear(64, 256), nn.Linear(64, 256), nn.ReLU(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.l1(x))
        a = h.sum(1, keepdim=True)
        del h
        h = self.relu(self.l2(x))
        return torch.cat((a, h.sum(1, keepdim=True)), 1) / 16  # two logits


def _reused_address(t: torch.Tensor) -> int:
    """The address a reusing allocator gives: one for both ReLU outputs (the only saved
    tensors of their shape), the real one for everything else. Whether the real allocator
    reuses the address depends on what else allocates, so the test makes the reuse certain."""
    return 0 if tuple(t.shape) == (32, 256) else t.data_ptr()


class _ReusedAddressCodec(ActivationCodec):
    """The product's dedup (key plus liveness check) under certain address reuse."""

    @staticmethod
    def _key(t: torch.Tensor, enc) -> tuple:
        return (_reused_address(t), *ActivationCodec._key(t, enc)[1:])


class _PointerKeyCodec(_ReusedAddressCodec):
    """The unsafe dedup: the same key, no liveness check."""

    def _lookup(self, t: torch.Tensor, enc) -> object | None:
        hit = self._cache.get(self._key(t, enc))
        return None if hit is None else hit[1]


def test_dedup_never_mixes_two_tensors_at_one_address() -> None:
    torch.manual_seed(0)
    net, x = _TwoBranch(), torch.randn(32, 64)
    net.l2.bias.data += 0.5  # the two masks differ
    ref = grads_by_name(net, x)

    def exact(codec_type: type) -> bool:
        got = grads_by_name(net, x, codec_type(net, CodecPlan.uniform(1.0)))
        return all(torch.equal(got[n], ref[n]) for n in ref)

    assert exact(ActivationCodec) and exact(_ReusedAddressCodec)
    assert not exact(_PointerKeyCodec)  # the reuse is real: without the check masks mix


def test_refuses_torch_compile(monkeypatch) -> None:
    model, x = _small()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match=r"torch\.compile"):
        ActivationCodec(model, CodecPlan.uniform(0.5)).__enter__()
    monkeypatch.undo()
    codec = ActivationCodec(model, CodecPlan.uniform(0.5))
    with pytest.raises(RuntimeError, match=r"torch\.compile"), codec:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        model(x)
    monkeypatch.undo()
    other = SmallResNet(num_classes=10)  # saves happen, but none of the hooked units ran
    with pytest.raises(RuntimeError, match="no unit module ran"), codec:
        other(x)


class _Square(torch.autograd.Function):
    """A custom autograd.Function: how a compiled graph saves its tensors at run time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g


@pytest.mark.slow
def test_refuses_saves_from_a_compiled_graph_runtime() -> None:
    """Compiled graphs run through torch's AOT-autograd runtime (a real compile takes ~20 s
    on this machine): a caller frame from that package is simulated with exec."""
    net = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    runtime = compile("y = square(net(x))",
                      "/site-packages/torch/_functorch/_aot_autograd/runtime_wrappers.py", "exec")
    with pytest.raises(RuntimeError, match="compile'd graph"), \
            ActivationCodec(net, CodecPlan.uniform(0.5)):
        exec(runtime, {"square": _Square.apply, "net": net, "x": x})
    codec = ActivationCodec(net, CodecPlan.uniform(0.5))
    with codec:  # the same custom Function in eager code is fine
        exec(compile("y = square(net(x))", "eager.py", "exec"),
             {"square": _Square.apply, "net": net, "x": x})
    assert codec.result.saves == 2  # the linear's input and the Function's input
    net.compile()
    with pytest.raises(RuntimeError, match=r"nn\.Module\.compile"):
        ActivationCodec(net, CodecPlan.uniform(0.5)).__enter__()


@pytest.mark.parametrize(("keep", "bad"), [
    ({"conv1": 0.0}, "0.0"), ({"conv1": 1.5}, "1.5"), ({"conv1": "sparse"}, "'sparse'"),
])
def test_plan_rejects_bad_keep_ratios(keep: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=f"'conv1'.*got {bad}"):
        CodecPlan(keep)


def test_codec_rejects_unknown_units() -> None:
    model, _x = _small()
    with pytest.raises(ValueError, match="layer9"):
        ActivationCodec(model, CodecPlan({"layer9.conv": 0.5}))
