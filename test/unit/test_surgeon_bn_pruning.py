"""SURGEON with BN inputs pruned (`prune_norm`, the default): the step's gradients against
plain dense autograd at fixed keep ratios (exact at keep 1, cosine falling with keep below
1), the centred encoding exact at keep 1, the bytes the codec holds (BN units included)
falling with the keep ratio, and on the shipped ResNet-18 card the step's peak (importance
pass included) under Tent's and the importance pass a small share of the step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.memory import SavedActivationCounter
from tta_core.memory.packed import CentredPruned
from tta_core.model.source import load_source
from tta_core.registry import build_method
from tta_core.surgeon.layer_importance import LayerImportance
from tta_core.surgeon.method import Surgeon

CARD = "checkpoints/small_resnet_signs32.json"
R18_CARD = "checkpoints/resnet18_cifar_w32_signs64.json"
KEEPS = (1.0, 0.5, 0.2, 0.05)

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(n: int = 16) -> torch.Tensor:
    return 0.5 * torch.randn((n, 3, 32, 32), generator=torch.Generator().manual_seed(0))


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _dense_grads(trainable: str, x: torch.Tensor) -> torch.Tensor:
    """Entropy gradient of SURGEON's trainable parameters by plain autograd (dense saves,
    batch statistics), on the same weights."""
    meth = build_method("surgeon", load_source(CARD)[0], trainable=trainable, lr=0.0)
    params = [p for n in meth.scored for p in meth._cand[n]]
    logp = meth.model(x).log_softmax(1)
    return _flat(list(torch.autograd.grad(-(logp.exp() * logp).sum(1).mean(), params)))


def _fixed_keep_step(trainable: str, keep: float, x: torch.Tensor) -> tuple[Surgeon, torch.Tensor]:
    """One SURGEON step (lr 0) with every scored layer at `keep` (the importance pass
    replaced by that ratio): the method and its parameters' gradients."""
    meth = build_method("surgeon", load_source(CARD)[0], trainable=trainable, lr=0.0)
    assert isinstance(meth, Surgeon) and meth.config.prune_norm
    fixed = LayerImportance({}, {}, {}, dict.fromkeys(meth.scored, keep))
    meth._importance_pass = lambda _x: (fixed, 1, 0)  # type: ignore[method-assign]
    meth.step(x)
    return meth, _flat([p.grad for n in meth.scored for p in meth._cand[n]])


def _bn_bytes(meth: Surgeon) -> int:
    """Bytes the last adaptation forward held for the BN units (the codec's ledger)."""
    bns = [n for n, m in meth._unit_mods.items() if isinstance(m, nn.BatchNorm2d)]
    return sum(meth._saved.per_unit.get(n, 0) for n in bns)


@pytest.mark.slow
@pytest.mark.parametrize("trainable", ["all", "norm"])
def test_pruned_bn_gradients_exact_at_keep_one_and_close_below(trainable: str) -> None:
    """SURGEON and SURGEON (BN): at keep 1 the step's gradients equal dense autograd's; below
    1 (BN inputs centred-pruned at the layer's keep, conv inputs pruned) they are
    approximate, their cosine with the dense ones falling as keep falls."""
    x = _batch()
    dense = _dense_grads(trainable, x)
    cos = {}
    for keep in KEEPS:
        _meth, got = _fixed_keep_step(trainable, keep, x)
        if keep == 1.0:
            torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-7)
        cos[keep] = float(nn.functional.cosine_similarity(got, dense, dim=0))
    assert cos[0.5] > 0.95 and cos[0.2] > 0.75, cos
    assert cos[1.0] > cos[0.5] > cos[0.2] > cos[0.05] and cos[0.5] < 1 - 1e-4, cos


def test_surgeon_bn_gradients_move_only_through_the_bn_inputs() -> None:
    """SURGEON (BN) with `prune_norm` off at the same keep: BN inputs dense, the gradient
    exact; on, it is approximate: the pruned BN inputs are what changes it."""
    x = _batch()
    dense = _dense_grads("norm", x)
    meth = build_method("surgeon", load_source(CARD)[0], trainable="norm", lr=0.0,
                        prune_norm=False)
    fixed = LayerImportance({}, {}, {}, dict.fromkeys(meth.scored, 0.2))
    meth._importance_pass = lambda _x: (fixed, 1, 0)  # type: ignore[method-assign]
    meth.step(x)
    got = _flat([p.grad for n in meth.scored for p in meth._cand[n]])
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-7)
    _m, pruned = _fixed_keep_step("norm", 0.2, x)
    assert float(nn.functional.cosine_similarity(pruned, dense, dim=0)) < 0.99


@pytest.mark.parametrize("keep", [1.0, 0.3])
def test_bn_backward_from_the_centred_input(keep: float) -> None:
    """A BN layer's backward computed from its centred-pruned input: ∂γ and ∂x equal the
    dense ones at keep 1 (the encoding itself, below the codec's dense shortcut) and are
    approximate at keep 0.3."""
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(8, 6, 10, 10, generator=gen) * 2 + 1
    w = torch.randn(6, generator=gen)
    up = torch.randn(8, 6, 10, 10, generator=gen)

    def grads(encode: bool) -> torch.Tensor:
        bn = nn.BatchNorm2d(6).train()
        with torch.no_grad():
            bn.weight.copy_(w)
        x = x0.clone().requires_grad_(True)

        def pack(t: torch.Tensor) -> object:
            if encode and t.shape == x0.shape:
                return CentredPruned.encode(t, keep, (0, 2, 3), 65536)
            return t

        def unpack(p: object) -> torch.Tensor:
            return p.decode() if isinstance(p, CentredPruned) else p  # type: ignore[return-value]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = bn(x)
        gx, gw = torch.autograd.grad((y * up).sum(), (x, bn.weight))
        return torch.cat([gx.reshape(-1), gw])

    dense, got = grads(False), grads(True)
    if keep == 1.0:
        torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-5)
    else:
        cos = float(nn.functional.cosine_similarity(got, dense, dim=0))
        assert 0.8 < cos < 1 - 1e-4, cos


def test_measured_saved_bytes_fall_with_the_keep_ratio() -> None:
    """The bytes SURGEON's codec holds for the step's backward (measured from what it
    stores), the BN units' among them, fall with the keep ratio; the BN inputs at keep k hold
    about k of their dense bytes (+ the 1-bit bitmap and the means), not all of them."""
    x = _batch()
    total, bn = [], []
    for keep in KEEPS:
        meth, _g = _fixed_keep_step("all", keep, x)
        total.append(meth._saved.total)
        bn.append(_bn_bytes(meth))
    assert total == sorted(total, reverse=True) and len(set(total)) == len(KEEPS), total
    assert bn == sorted(bn, reverse=True) and len(set(bn)) == len(KEEPS), bn
    for keep, b in zip(KEEPS[1:], bn[1:], strict=True):
        assert b < (keep + 0.1) * bn[0], (keep, b, bn[0])
    sizes = []
    model = load_source(CARD)[0]
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.register_forward_pre_hook(lambda _m, a: sizes.append(a[0].nbytes))
    with torch.no_grad():
        model(x)
    # keep 1: the BN inputs whole (+ the units' batch statistics and ReLU masks)
    assert sum(sizes) <= bn[0] < 1.05 * sum(sizes), (bn[0], sum(sizes))


def _stream_batch(card: str, size: int, n: int) -> torch.Tensor:
    model_card = load_source(card)[1]
    st = build_stream(StreamSpec(image_size=size, samples_per_domain=n,
                                 corruptions=("gaussian_noise",), seed=0))
    return images_to_tensor(st.images[:n], model_card.mean, model_card.std)


@pytest.mark.slow
def test_trained_resnet18_step_peak_under_tent_importance_pass_small() -> None:
    """The shipped ResNet-18 card (trained) at its 64 px, batch 8, on shift-stream images:
    the step's peak saved bytes, importance pass included, <= 0.45x Tent's (SURGEON) and
    <= 0.40x (SURGEON (BN)), and the importance pass <= 10 % of the adaptation pass (the
    same ledger: benchmarks/memory/bench_surgeon_peak.py at 224 px)."""
    x = _stream_batch(R18_CARD, 64, 8)
    tent = build_method("tent", load_source(R18_CARD)[0], memory_format="contiguous")
    counter = SavedActivationCounter(tent.model)
    with counter:
        tent.step(x)
    tent_bytes = counter.result.total
    for trainable, bound in (("all", 0.45), ("norm", 0.40)):
        meth = build_method("surgeon", load_source(R18_CARD)[0], trainable=trainable,
                            memory_format="contiguous")
        s = [meth.step(x).stats for _ in range(2)][-1]
        assert s["peak_saved_bytes"] <= bound * tent_bytes, (trainable, s, tent_bytes)
        assert 0 < s["importance_saved_bytes"] <= 0.10 * s["saved_bytes"], (trainable, s)
