"""State bank swaps (bit-identical, no rebuild), the label-balanced memory (RoTTA CSTU)
and the adapt-until-stable gate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tta_core.darda.memory import BalancedMemory
from tta_core.domain.bank import SOURCE, StateBank, adapted_tensors, last_linear
from tta_core.domain.gate import AdaptGate, GateConfig
from tta_core.model.zoo import build_model


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("small_resnet", 10)


def _perturb(tensors: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in tensors.values():
            t.add_(torch.randn(t.shape, generator=g))


def test_adapted_tensors_are_bn_state_and_classifier() -> None:
    model = _model()
    live = adapted_tensors(model, skip=lambda n: n == "bn1")
    assert last_linear(model) == "fc"
    assert "fc.weight" in live and "fc.bias" in live and "bn1.weight" not in live
    assert "layer1.0.bn1.running_var" in live
    assert all(t is dict(model.named_parameters()).get(k, t) for k, t in live.items())


def test_swap_restores_saved_tensors_bit_identically_without_rebuild() -> None:
    model = _model()
    ids = {n: id(p) for n, p in model.named_parameters()}
    conv = model.conv1.weight.detach().clone()
    live = adapted_tensors(model)
    bank = StateBank(live, capacity=4)
    bank.activate("a")
    _perturb(live, 1)
    saved_a = {k: v.detach().clone() for k, v in live.items()}
    bank.activate("b", init_from="a")  # starts from a's state
    assert all(torch.equal(live[k], saved_a[k]) for k in live)
    _perturb(live, 2)
    saved_b = {k: v.detach().clone() for k, v in live.items()}
    bank.activate("a")
    assert all(torch.equal(live[k], saved_a[k]) for k in live)
    bank.activate("b")
    assert all(torch.equal(live[k], saved_b[k]) for k in live)
    bank.activate(SOURCE)
    assert all(torch.equal(live[k], bank.source[k]) for k in live)
    assert {n: id(p) for n, p in model.named_parameters()} == ids  # same tensors, copied into
    assert torch.equal(model.conv1.weight, conv)  # only the state moved
    assert bank.state_bytes() == sum(t.numel() * 4 for t in live.values())


def test_bank_evicts_least_recently_activated_and_refuses_bad_states() -> None:
    live = adapted_tensors(_model())
    bank = StateBank(live, capacity=2)
    bank.activate("a")
    bank.activate("b")
    bank.activate("a")
    assert bank.activate("c") == "b" and bank.names == ["a", "c"]
    with pytest.raises(ValueError, match="cannot drop the active domain 'c'"):
        bank.drop("c")
    bad = {k: v.detach().clone() for k, v in live.items()}
    bad["fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"fc.weight has shape \(3, 3\)"):
        bank.load("x", bad)


def test_memory_keeps_classes_balanced_and_bounded() -> None:
    mem = BalancedMemory(capacity=8, num_classes=4)
    x = torch.arange(40, dtype=torch.float32).view(40, 1)
    logits = torch.full((40, 4), -10.0)
    logits[:30, 0] = 10.0  # 30 confident class-0 samples, then 10 spread over classes 1-3
    logits[30:, 1:] = torch.eye(3).repeat(4, 1)[:10] * 10.0
    for i in range(0, 40, 8):
        mem.add(x[i:i + 8], logits[i:i + 8])
    counts = mem.class_counts()
    assert len(mem) == 8 and counts[0] <= 3 and min(counts[1:]) >= 1, counts
    assert mem.samples().shape == (8, 1)
    mem.clear()
    assert len(mem) == 0 and mem.samples() is None


def test_gate_adapts_after_a_switch_until_stable_then_serves_forward_only() -> None:
    gate = AdaptGate(GateConfig(min_batches=3, max_batches=10, window=2, tol=0.05))
    assert not gate.wants_backward()  # no domain yet
    gate.switch("d0")
    flags = []
    for h in [2.0, 1.5, 1.2, 1.1, 1.1, 1.1, 1.1, 1.1]:
        flags.append(gate.wants_backward())
        gate.record(h, adapted=flags[-1])
    assert flags == [True] * 6 + [False] * 2
    gate.switch("d1")
    assert gate.wants_backward()
    gate.switch("d0")  # revisit of a stable domain: no backward
    assert not gate.wants_backward()
    for h in [1.1, 1.9, 2.0]:  # the entropy drifts well above its settled level
        gate.record(h, adapted=False)
    assert gate.wants_backward()


def test_gate_caps_adaptation_across_visits() -> None:
    gate = AdaptGate(GateConfig(min_batches=2, max_batches=4, window=1, tol=0.0))
    for visit in range(3):
        gate.switch("d0")
        for i in range(3):
            if gate.wants_backward():
                gate.record(float(10 * visit + i), adapted=True)
    assert gate.domains["d0"].adapted == 4 and gate.domains["d0"].stable
