"""DARDA as the paper builds it: Eqs. 9-16 against hand-computed values, Algorithm 1's
memory bank, the Eq. 10 choice of a planted sub-network, the offline bundle (bit-for-bit
round trip, another model refused in one line) and the online phase's one backward pass
per perceived corruption."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import CARD
from torch import nn

from tta_core.api import DeadlineTunable
from tta_core.darda.bn import refreshing
from tta_core.darda.bundle import load_bundle, save_bundle
from tta_core.darda.corruption_memory import CorruptionMemory
from tta_core.darda.offline import OfflineConfig, run_offline
from tta_core.darda.subnet import (
    adaptation_loss,
    alpha_matrix,
    closest,
    cm_loss,
    pi_matrix,
    reg_loss,
    subnet_loss,
)
from tta_core.errors import InputError
from tta_core.model.source import load_source
from tta_core.registry import build_method

I2 = torch.eye(2)


def test_eq9_cm_loss_diagonal_and_off_diagonal_pairs() -> None:
    c = torch.tensor([[0.6, 0.8], [1.0, 0.0]])  # S.C^T = [[.6, 1], [.8, 0]]
    assert float(cm_loss(I2, c, "diagonal")) == pytest.approx(math.exp(-0.6) + math.exp(0.0))
    assert float(cm_loss(I2, c, "off_diagonal")) == pytest.approx(math.exp(-1.0)
                                                                  + math.exp(-0.8))
    with pytest.raises(ValueError, match="pairs"):
        cm_loss(I2, c, "all")


def test_eq10_pi_by_hand() -> None:
    c = torch.tensor([[1.0, 0.0], [0.6, 0.8]])  # S.C^T = [[1, .6], [0, .8]], trace 1.8
    pi = pi_matrix(I2, c)
    e0, e1 = math.exp(1 / 1.8), math.exp(0.6 / 1.8)
    assert float(pi[0, 0]) == pytest.approx(e0 / (e0 + e1), rel=1e-6)
    f0, f1 = math.exp(0.0), math.exp(0.8 / 1.8)
    assert float(pi[1, 1]) == pytest.approx(f1 / (f0 + f1), rel=1e-6)
    # an untrained S (trace <= 1): the denominator is floored at 1, logits = S.C^T
    flat = pi_matrix(I2, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    assert float(flat[0, 1]) == pytest.approx(math.e / (math.e + 1), rel=1e-6)


def test_eq11_alpha_and_eq12_kl_by_hand() -> None:
    a = torch.tensor([[0.5, 0.75], [0.9, 0.0]])
    alpha = alpha_matrix(a)
    # row 0: log-odds weights ln 2, ln 4 -> 1/3, 2/3 -> softmax
    e0, e1 = math.exp(1 / 3), math.exp(2 / 3)
    assert float(alpha[0, 0]) == pytest.approx(e0 / (e0 + e1), rel=1e-5)
    assert float(alpha[1, 0]) == pytest.approx(math.e / (math.e + 1), rel=1e-5)  # a=0 -> 0
    pi = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    want = sum(float(alpha[i, j]) * math.log(float(alpha[i, j]) / float(pi[i, j]))
               for i in range(2) for j in range(2))
    assert float(reg_loss(pi, alpha)) == pytest.approx(want, rel=1e-6)
    assert float(reg_loss(alpha, alpha)) == pytest.approx(0.0, abs=1e-7)
    c = torch.tensor([[0.6, 0.8], [1.0, 0.0]])
    total = subnet_loss(I2, c, a, lambda_r=0.5)
    assert float(total) == pytest.approx(
        float(cm_loss(I2, c)) + 0.5 * float(reg_loss(pi_matrix(I2, c), alpha)), rel=1e-6)


def test_eq16_and_planted_signature_is_chosen() -> None:
    s, c_bar = torch.tensor([0.6, 0.8]), torch.tensor([0.5, 0.5])
    assert float(adaptation_loss(s, c_bar)) == pytest.approx(math.exp(-0.7), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    sigs = torch.nn.functional.normalize(torch.randn(15, 32, generator=g), dim=1)
    planted = 11
    c = torch.nn.functional.normalize(sigs[planted] + 0.3 * torch.randn(32, generator=g), dim=0)
    assert closest(sigs, c) == planted


def test_algorithm1_memory_balances_classes_and_prefers_representative() -> None:
    centroid = torch.tensor([1.0, 0.0])
    mem = CorruptionMemory(capacity=4, num_classes=2, min_similarity=0.1)  # quota 2
    proj = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6], [0.6, 0.8], [0.99, 0.14]])
    x = torch.arange(5.0)[:, None]
    pred = torch.tensor([0, 0, 0, 0, 1])
    # sample 1 is not representative (cosine 0 < 0.1); class 0 fills with 0 and 2, then 3
    # (cosine .6) cannot replace the worse of them (.8)
    assert mem.add(x, pred, proj, centroid) == 3
    assert mem.class_counts() == [2, 1]
    assert sorted(mem.samples()[:, 0].tolist()) == [0.0, 2.0, 4.0]
    better = mem.add(torch.tensor([[9.0]]), torch.tensor([0]), torch.tensor([[0.95, 0.31]]),
                     centroid)
    assert better == 1 and sorted(mem.samples()[:, 0].tolist()) == [0.0, 4.0, 9.0]
    sims = torch.tensor([1.0, 0.99, 0.95])
    assert mem.similarity_variance(centroid) == pytest.approx(float(sims.var(correction=0)),
                                                              abs=1e-6)
    mean = mem.mean_projection()
    assert torch.allclose(mean, torch.tensor([[1.0, 0.0], [0.95, 0.31], [0.99, 0.14]]).mean(0))


def test_a_shift_drops_the_samples_of_the_previous_corruption() -> None:
    old, new = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    mem = CorruptionMemory(capacity=8, num_classes=2, min_similarity=0.0)
    proj = torch.tensor([[1.0, 0.0], [0.6, -0.8], [0.6, 0.8]])
    mem.add(torch.arange(3.0)[:, None], torch.tensor([0, 1, 1]), proj, old)
    assert len(mem) == 3
    # cosines to the new centroid: 0, -0.8, 0.8; only -0.8 is below min_similarity 0
    assert mem.retarget(new) == 1
    assert sorted(mem.samples()[:, 0].tolist()) == [0.0, 2.0]


def test_eq15_context_aware_bn_by_hand() -> None:
    bn = nn.BatchNorm2d(1).eval()
    bank = torch.tensor([1.0, 2.0, 3.0, 6.0]).view(4, 1, 1, 1)
    with torch.no_grad(), refreshing([bn], 0.5):
        bn(bank)
    assert not bn.training
    assert float(bn.running_mean) == pytest.approx(0.5 * 0 + 0.5 * 3.0)
    # unbiased variance of (1, 2, 3, 6): 14 / 3
    assert float(bn.running_var) == pytest.approx(0.5 * 1 + 0.5 * 14 / 3)


TINY = OfflineConfig(corruptions=("gaussian_noise", "fog"), samples=8, eval_samples=4,
                     epochs=1, batch=8, noise_count=2, s_hidden=8, s_steps=20,
                     encoder_steps=2, threads=1)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    torch.set_num_threads(1)
    model, card = load_source(CARD)
    off = run_offline(model, 32, tuple(card.mean), tuple(card.std), TINY)
    path = tmp_path_factory.mktemp("darda") / "b.safetensors"
    save_bundle(off, model, path)
    return path, off


def _parts(path) -> tuple[dict, bytes]:
    """(parsed header, data bytes) of a safetensors file: the Rust writer orders the
    metadata keys by hash, so only the header's bytes may differ between two saves."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_bundle_round_trips_bit_for_bit_and_refuses_another_model(bundle, tmp_path) -> None:
    path, off = bundle
    model, _ = load_source(CARD)
    back = load_bundle(path, model)
    assert back.names == ["gaussian_noise", "fog"] and torch.equal(back.accuracy, off.accuracy)
    for name in back.names:
        assert all(torch.equal(back.states[name][k], v) for k, v in off.states[name].items())
    again = tmp_path / "again.safetensors"
    save_bundle(back, model, again)
    assert _parts(again) == _parts(path)  # same tensor bytes, same header
    other, _ = load_source(CARD)
    with torch.no_grad():
        other.conv1.weight.add_(1.0)
    with pytest.raises(InputError) as exc:
        load_bundle(path, other)
    assert "\n" not in str(exc.value) and "another model" in str(exc.value)
    assert str(path) in str(exc.value)


def _stream() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 3, 32, 32, generator=g) * s for s in (1.0, 4.0) for _ in range(4)]


def test_online_phase_adapts_once_per_perceived_corruption(bundle) -> None:
    path, _ = bundle
    model, _ = load_source(CARD)
    m = build_method("darda", model, input_shape=(3, 32, 32), bundle_path=str(path),
                     max_wait=2, memory_format="contiguous")
    assert type(m).__name__ == "PaperDarda"
    backward = [m.step(x).adapted for x in _stream()]
    shifts = m.paper.shifts
    # the stream is two segments of 4 batches (scale 1, then 4): each is perceived on its
    # first batch and takes exactly one backward pass there, none on the batches after
    assert shifts == 2 and m.backward_passes == sum(backward) == shifts
    assert [i for i, b in enumerate(backward) if b] == [0, 4], backward
    assert m.current_domain() in ("gaussian_noise", "fog")
    m.reset()
    assert m.paper.shifts == 0 and m.backward_passes == 0
    forward_only = build_method("darda", load_source(CARD)[0], input_shape=(3, 32, 32),
                                bundle_path=str(path), variant="no_bn_adapt",
                                memory_format="contiguous")
    assert not any(forward_only.step(x).adapted for x in _stream())


def test_eq16_step_lowers_the_loss(bundle) -> None:
    path, _ = bundle
    model, _ = load_source(CARD)
    m = build_method("darda", model, input_shape=(3, 32, 32), bundle_path=str(path),
                     paper_lr=1e-2, context_momentum=0.0, memory_format="contiguous")
    p = m.paper
    x = _stream()[0]
    proj, c = p.signature(x)
    p.observe(c)
    p.remember(x, model(x).detach(), proj)
    with torch.no_grad():
        before = float(p._loss(p.memory.samples()))
    p.adapt()
    with torch.no_grad():
        after = float(p._loss(p.memory.samples()))
    assert p.backward_passes == 1 and after < before
    # the gradient reaches every BN gamma / beta and the dense layer through S
    assert all(t.grad is not None and float(t.grad.abs().sum()) > 0 for t in p.params)
    assert any(k.startswith("fc.") for k, t in p.live.items() if t.grad is not None)


def test_more_eq16_steps_lower_the_loss_further_and_are_counted(bundle) -> None:
    path, _ = bundle
    losses = {}
    for steps in (1, 5):
        model, _ = load_source(CARD)
        m = build_method("darda", model, input_shape=(3, 32, 32), bundle_path=str(path),
                         paper_lr=1e-2, paper_steps=steps, context_momentum=0.0,
                         memory_format="contiguous")
        p = m.paper
        x = _stream()[0]
        proj, c = p.signature(x)
        p.observe(c)
        p.remember(x, model(x).detach(), proj)
        p.adapt()
        with torch.no_grad():
            losses[steps] = float(p._loss(p.memory.samples()))
        assert p.backward_passes == steps
    assert losses[5] < losses[1]
    with pytest.raises(ValueError, match="paper_steps"):
        build_method("darda", load_source(CARD)[0], input_shape=(3, 32, 32),
                     bundle_path=str(path), paper_steps=0)


def _guarded(path):
    model, _ = load_source(CARD)
    m = build_method("darda", model, input_shape=(3, 32, 32), bundle_path=str(path),
                     variant="bn_only", paper_source_guard=True, memory_format="contiguous")
    p = m.paper
    x = _stream()[0]
    proj, c = p.signature(x)
    p.observe(c)
    p.remember(x, model(x).detach(), proj)
    return p


def test_the_source_guard_keeps_whichever_state_predicts_the_bank_surer(bundle) -> None:
    path, _ = bundle
    fc = [k for k in _guarded(path).live if k.endswith("weight")][-1]
    # a picked sub-network whose classifier is zero predicts uniformly: the source is kept
    p = _guarded(path)
    with torch.no_grad():
        p.live[fc].zero_()
    p.adapt()
    assert p.kept_source == 1 and torch.equal(p.live[fc], p.source_state[fc])
    # a source whose classifier is zero loses to the picked sub-network, which stays
    p = _guarded(path)
    picked = p.live[fc].detach().clone()
    p.source_state[fc].zero_()
    p.adapt()
    assert p.kept_source == 0 and torch.equal(p.live[fc], picked)


def test_a_deadline_that_leaves_no_room_defers_the_adaptation(bundle) -> None:
    path, _ = bundle
    m = build_method("darda", load_source(CARD)[0], input_shape=(3, 32, 32),
                     bundle_path=str(path), max_wait=1, deadline_mode="fixed",
                     deadline_ms=1e-6, memory_format="contiguous")
    assert isinstance(m, DeadlineTunable) and len(m.adapt_seen) == 1  # calibrated at build
    m.clock = lambda: 0.0  # only the injected costs below decide
    m.adapt_seen.clear()
    m.adapt_seen.append(1e6)
    res = [m.step(x) for x in _stream()[:4]]
    assert not any(r.adapted for r in res) and all(r.stats["deferred"] for r in res)
    assert m.paper.pending and m.deferred == 4  # still owed, for a batch where it fits
    # batches 2-4 had no room for the detection either: served plain by the sub-network
    assert [bool(r.stats.get("plain")) for r in res] == [False, True, True, True]
    m.set_deadline(deadline_ms=1e3)  # room for the detection, not for the adaptation
    m.step(_stream()[4])  # the next corruption came first: that adaptation is skipped
    assert m.skipped == 1 and m.paper.pending


def test_the_adaptation_runs_on_the_first_batch_whose_slack_fits_it(bundle) -> None:
    """Injected step costs and a fake clock (no wall-clock figure decides): a 100 s
    deadline; the adaptation is predicted at 200 s (deferred), then at 10 ms (taken); with
    99.995 s of the deadline spent on the clock, or gone to lateness, it waits again."""
    path, _ = bundle
    m = build_method("darda", load_source(CARD)[0], input_shape=(3, 32, 32),
                     bundle_path=str(path), max_wait=1, memory_format="contiguous")
    assert not m.adapt_seen  # no deadline: nothing calibrated, nothing deferred
    m.set_deadline(deadline_mode="fixed", deadline_ms=1e5)
    with pytest.raises(ValueError, match="deadline_mode"):
        m.set_deadline(deadline_mode="soon")
    now, tick = [0.0], [0.0]

    def clock() -> float:
        now[0] += tick[0]
        return now[0]

    m.clock = clock
    xs = _stream()
    m.adapt_seen.clear()
    m.adapt_seen.append(2e5)
    first = m.step(xs[0])
    assert first.stats["deferred"] and not first.adapted and m.paper.pending
    m.adapt_seen.append(10.0)  # the prediction is the most of the recent costs
    assert m.step(xs[1]).stats["deferred"]
    m.adapt_seen.clear()
    m.adapt_seen.append(10.0)
    tick[0] = 99.995  # each clock read advances 99.995 s: update starts that late
    assert m.step(xs[2]).stats["deferred"]
    tick[0] = 0.0
    m.plain_seen.clear()  # those steps measured 100 s each on the fake clock: forgotten
    m.set_lateness(1e5 - 5.0)  # a backlog: 5 ms of the deadline left
    assert m.step(xs[3]).stats["deferred"]
    m.set_lateness(0.0)
    taken = m.step(xs[3])
    assert taken.adapted and "deferred" not in taken.stats and not m.paper.pending
    assert m.deferred == 4 and m.backward_passes == 1 and len(m.adapt_seen) == 2


def test_train_darda_options_default_to_the_offline_config() -> None:
    import dataclasses

    from tta_core.cli.commands.train_darda import OFFLINE_DEFAULTS

    real = {f.name: getattr(OfflineConfig(), f.name) for f in dataclasses.fields(OfflineConfig)}
    assert {k: real[k] for k in OFFLINE_DEFAULTS} == OFFLINE_DEFAULTS


def test_extension_banks_a_novel_corruption_serves_its_revisit_and_persists(
        bundle, tmp_path) -> None:
    path, _ = bundle
    g = torch.Generator().manual_seed(5)
    x1, x2 = torch.randn(8, 3, 32, 32, generator=g), 4 * torch.randn(8, 3, 32, 32, generator=g)
    opts = dict(input_shape=(3, 32, 32), bundle_path=str(path), max_wait=1,
                learn_domains=True, novelty_cos=0.99999, shift_cos=0.99999,
                memory_format="contiguous")
    m = build_method("darda", load_source(CARD)[0], **opts)
    first = [m.step(x).adapted for x in (x1, x1, x2, x2)]
    assert sum(first) == 2 and list(m.paper.learnt) == ["learnt0", "learnt1"]
    assert not m.step(x1).adapted and m.current_domain() == "learnt0"  # revisit: no backward
    bank = tmp_path / "learnt.safetensors"
    m.save_bank(bank)
    again = build_method("darda", load_source(CARD)[0], bank_path=str(bank), **opts)
    assert again.bank_error == "" and list(again.paper.learnt) == ["learnt1", "learnt0"]  # LRU
    for name, d in m.paper.learnt.items():
        assert torch.equal(again.paper.learnt[name].signature, d.signature)
        assert all(torch.equal(again.paper.learnt[name].state[k], v) for k, v in d.state.items())
    assert not again.step(x2).adapted and again.current_domain() == "learnt1"
    online = build_method("darda", load_source(CARD)[0], input_shape=(3, 32, 32),
                          bank_path=str(bank), memory_format="contiguous")
    assert "another model" in online.bank_error and "\n" not in online.bank_error
