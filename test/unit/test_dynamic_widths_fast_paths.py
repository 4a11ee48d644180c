"""The per-batch fast paths of DAF dynamic widths give what the plain paths give: the heap
greedy of bit_alloc (memory budget only) picks the scan's widths, ties included; a 0-bit
save decoded as a broadcast zero gives the gradients of materialized zeros; a ReLU output
held as mask + codes is packed by one fused pass (the separate passes' bytes) and decodes
once for both with the ReLU's gradient exact."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from torchvision.models import resnet18

from tta_core.daf.bit_alloc import FIDELITY, UnitChoice, greedy_bits
from tta_core.memory import ActivationCodec, CodecPlan
from tta_core.memory import codec as codec_mod
from tta_core.memory.quant import Dropped

pytestmark = pytest.mark.usefixtures("one_thread")


def _units(rng: random.Random, n: int, ties: bool) -> list[UnitChoice]:
    """Random knapsack items: conv-like (0/2/4/8) and norm-like (2/4/8, own table)."""
    out = []
    for i in range(n):
        imp = float(rng.randint(0, 3)) if ties else rng.random() ** 3
        size = rng.choice((64, 128)) if ties else rng.randint(10, 5000)
        if rng.random() < 0.3:
            fid = {2: 0.5 + 0.3 * rng.random(), 4: 0.95, 8: 1.0}
            out.append(UnitChoice(f"n{i}", imp, {b: size * b / 8 for b in (2, 4, 8)},
                                  fidelity=fid))
        else:
            out.append(UnitChoice(f"c{i}", imp, {b: size * b / 8 for b in (0, 2, 4, 8)}))
    return out


@pytest.mark.parametrize("ties", (False, True))
def test_heap_greedy_picks_the_scans_widths(ties: bool) -> None:
    """Memory budget only: greedy_bits (heap) equals the scan, which a finite time budget
    that never binds forces (memory stays the tighter resource, no upgrade costs time)."""
    rng = random.Random(7 + ties)
    for trial in range(60):
        units = _units(rng, rng.randint(1, 40), ties)
        floor = sum(min(u.mem.values()) for u in units)
        top = sum(max(u.mem.values()) for u in units)
        budget = floor + rng.random() * (top - floor)
        heap = greedy_bits(units, budget, fidelity=FIDELITY)
        scan = greedy_bits(units, budget, time_budget=1e300, fidelity=FIDELITY)
        assert heap.bits == scan.bits, trial
        assert (heap.value, heap.mem) == (scan.value, scan.mem)
        assert heap.mem <= budget


def _net() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return resnet18(num_classes=10).train(), torch.randn(2, 3, 48, 48)


def _grads(model: torch.nn.Module, x: torch.Tensor, plan: CodecPlan
           ) -> tuple[dict[str, torch.Tensor], int, ActivationCodec]:
    """The trainable parameters' gradients with the forward under the codec, how many
    saves were linked to a shared ReLU decode, and the codec."""
    model.zero_grad(set_to_none=True)
    codec = ActivationCodec(model, plan)
    with codec:
        loss = torch.log_softmax(model(x), 1).mean()
    linked = len(codec._shared)
    loss.backward()
    del loss
    gc.collect()
    assert not codec._shared  # the shared decodes die with the graph
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, linked, codec


def test_dropped_saves_decode_as_a_broadcast_zero_with_unchanged_gradients(monkeypatch) -> None:
    """Frozen convs (incl. stride-2 and 1x1 downsamples) and a frozen fc at 0 bits: the
    stride-0 zero gives bit-identical gradients to materialized zeros."""
    model, x = _net()
    frozen = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)][::2]
    mods = dict(model.named_modules())
    for n in frozen:
        mods[n].requires_grad_(False)
    plan = CodecPlan(bits=dict.fromkeys(frozen, 0), default_bits=4, norm_bits=8, group=64)
    broadcast, _, _ = _grads(model, x, plan)
    assert Dropped.encode(x).decode().stride() == (0, 0, 0, 0)
    monkeypatch.setattr(Dropped, "decode", lambda self: torch.zeros(self.shape, dtype=self.dtype))
    zeros, _, _ = _grads(model, x, plan)
    assert broadcast.keys() == zeros.keys() and len(zeros) > 10
    assert all(torch.equal(broadcast[k], zeros[k]) for k in zeros)


@pytest.mark.parametrize("bits", (2, 8))
def test_relu_mask_and_codes_share_one_decode(bits: int, monkeypatch) -> None:
    """Every ReLU output a conv stores quantized is linked (ResNet-18: 16 of its 17, the last
    one only pooling reads; 2 saves each). What flows through the ReLUs (BN and fc
    gradients) is bit-identical to the separate decodes; a conv's ∂W differs only by the
    2**-64 given to positives that rounded to 0 (terms ~5e-20 x grad: a float32 rounding
    at most)."""
    model, x = _net()
    plan = CodecPlan(default_bits=bits, norm_bits=8, group=64)
    shared, linked, _ = _grads(model, x, plan)
    monkeypatch.setattr(codec_mod.ActivationCodec, "_share_relu_decode", lambda *a: None)
    separate, none, _ = _grads(model, x, plan)
    assert none == 0 and linked == 2 * 16
    for k, g in separate.items():
        if k.endswith("conv1.weight") or k.endswith("conv2.weight") or "downsample.0" in k:
            assert torch.allclose(shared[k], g, rtol=1e-6, atol=1e-7 * float(g.abs().max())), k
        else:
            assert torch.equal(shared[k], g), k


def test_relu_masks_from_the_fused_pass_are_the_separate_passes_bytes(monkeypatch) -> None:
    """A ReLU output's mask waits for the tensor's next save: the 16 ResNet-18 outputs a
    conv (or the stem's max-pool, at the BN's 8 bits) quantizes come from one fused pass
    each, the last one (read only by pooling) is packed alone at the fc's save. Same saved
    bytes and bit-identical gradients as packing every mask at the ReLU."""
    model, x = _net()
    plan = CodecPlan(default_bits=4, norm_bits=8, group=64)
    fused, _, codec = _grads(model, x, plan)
    assert codec.fused_masks == 16
    monkeypatch.setattr(codec_mod, "native_masks", lambda *a: False)  # masks at the ReLU
    separate, _, plain = _grads(model, x, plan)
    assert plain.fused_masks == 0
    assert codec.result.total == plain.result.total
    assert fused.keys() == separate.keys()
    assert all(torch.equal(fused[k], separate[k]) for k in fused)


def test_a_relu_output_changed_in_place_before_its_next_save_is_refused() -> None:
    """The deferred mask would not be the ReLU's: a clear error, not a wrong gradient."""

    class Bad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.relu = torch.nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.relu(self.conv(x))
            y.mul_(2.0)
            return self.conv(y[:, :3]).sum()

    model = Bad()
    with pytest.raises(RuntimeError, match="modified in place before its next save"), \
            ActivationCodec(model, CodecPlan(default_bits=4)):
        model(torch.randn(1, 3, 16, 16))
