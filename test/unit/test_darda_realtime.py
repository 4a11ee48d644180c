"""DARDA in real time: the shift test's recall and false alarms on synthetic embeddings with
known change points, the scoring against known shift points, the gate's passes per
perceived shift and their reasons, at most two backward passes per true shift through the
method, and an owed backward pass that never runs inside a step whose deadline is already
spent (an injected clock and injected costs: no wall-clock figure decides)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import CARD

from tta_core.domain.detector import ShiftConfig, ShiftTest
from tta_core.domain.gate import DRIFT, NEW_DOMAIN, SHIFT, AdaptGate, GateConfig
from tta_core.eval.shifts import score_shifts, true_shifts
from tta_core.model.source import load_source
from tta_core.registry import build_method

SHAPE = (3, 32, 32)


def _batches(means: list[torch.Tensor], per_segment: int, batch: int, spread: torch.Tensor,
             seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """Batch embeddings (mean of `batch` samples, within-batch spread / batch) of segments
    with the given means; samples with heavy tails (Student t, 5 degrees of freedom, unit
    variance)."""
    g = torch.Generator().manual_seed(seed)
    out, labels = [], []
    for k, mu in enumerate(means):
        for _ in range(per_segment):
            u = torch.randn(batch, mu.numel(), generator=g, dtype=torch.float64)
            chi = torch.randn(batch, 5, generator=g, dtype=torch.float64).pow(2).mean(
                1, keepdim=True)
            x = mu + spread.sqrt() * u / chi.sqrt() * math.sqrt(3 / 5)
            out.append((x.mean(0), x.var(0, correction=0) / batch))
            labels.append(f"s{k}")
    return out, labels


def test_shift_test_finds_known_change_points_and_rarely_fires_otherwise() -> None:
    """15 segments of 10 batches of 4, dim 40; the segment means move by 1.5 to 6 sample
    standard deviations in a quarter of the dimensions: every change found within 3
    batches, at most 2 alarms elsewhere; on one long segment of 400 batches, at most 4."""
    g = torch.Generator().manual_seed(0)
    dim = 40
    spread = torch.rand(dim, generator=g, dtype=torch.float64) + 0.5
    means, mu = [], torch.zeros(dim, dtype=torch.float64)
    for k in range(15):
        step = torch.zeros(dim, dtype=torch.float64)
        idx = torch.randperm(dim, generator=g)[:dim // 4]
        step[idx] = (1.5 + 4.5 * k / 14) * spread[idx].sqrt() * \
            torch.where(torch.rand(len(idx), generator=g) < 0.5, -1.0, 1.0).double()
        mu = mu + step
        means.append(mu.clone())
    for seed in range(3):
        batches, labels = _batches(means, 10, 4, spread, seed)
        test = ShiftTest(ShiftConfig(threshold=3.0))
        fired = [test.observe(e, w).shift for e, w in batches]
        s = score_shifts(labels, fired)
        assert s.true_shifts == 14 and s.recall == 1.0 and s.false_alarms <= 2, (seed, s)
        still, _ = _batches(means[:1], 400, 4, spread, 10 + seed)
        test.fresh()
        alarms = sum(test.observe(e, w).shift for e, w in still)
        assert alarms <= 4, (seed, alarms)


def test_shift_test_confirms_before_it_fires_and_outliers_join_the_segment() -> None:
    test = ShiftTest(ShiftConfig(threshold=3.0, confirm=2, min_reference=3))
    e0, w = torch.zeros(8, dtype=torch.float64), torch.full((8,), 0.01, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)

    def near() -> torch.Tensor:
        return 0.1 * torch.randn(8, generator=g, dtype=torch.float64)

    decided = [test.observe(e0 + near(), w) for _ in range(3)]
    assert all(math.isnan(d.score) for d in decided)  # too young to be tested
    one = test.observe(e0 + 0.3, w)  # a single batch away: not yet a shift
    assert one.away and not one.shift and one.score < 5 * 3.0
    back = test.observe(e0 + near(), w)
    assert not back.away and test.segment_batches == 5  # the outlier joined the segment
    assert test.observe(e0 + 0.3, w).away
    second = test.observe(e0 + 0.3 + near(), w)
    assert second.shift and test.segment_batches == 2 and test.shifts == 1
    assert math.isnan(test.observe(e0 + 0.3, w).score)  # the new segment is young again
    for _ in range(3):
        test.observe(e0 + 0.3 + near(), w)
    far = test.observe(e0 + 5.0, w)  # beyond `instant` x threshold: a shift at once
    assert far.shift and test.segment_batches == 1 and test.shifts == 2


def test_score_shifts_by_hand() -> None:
    domains = ["a"] * 4 + ["b"] * 4 + ["c"] * 2 + ["d"] * 4
    assert true_shifts(domains) == [4, 8, 10]
    perceived = [False] * 14
    for b in (0, 5, 6, 9, 13):  # 0: the start (not scored); 5: b; 6: b again; 9: c; 13: none
        perceived[b] = True
    backward = [False] * 14
    reasons = [""] * 14
    for b, why in ((1, NEW_DOMAIN), (6, SHIFT), (7, ""), (10, DRIFT)):
        backward[b], reasons[b] = True, why
    s = score_shifts(domains, perceived, backward, reasons, window=3)
    assert (s.true_shifts, s.detected, s.false_alarms, s.perceived) == (3, 2, 2, 4)
    assert s.missed == ["d"] and s.recall == pytest.approx(2 / 3)
    assert s.backward == 4 and s.backward_per_shift == pytest.approx(1.0)
    assert s.reasons == {"drift": 1, "new_domain": 1, "shift": 1, "unknown": 1}
    late = score_shifts(domains, [b == 11 for b in range(14)], window=1)
    assert late.detected == 0 and late.false_alarms == 1  # a window of 1: too late
    with pytest.raises(ValueError, match="lengths differ"):
        score_shifts(domains, perceived[:3])


def test_gate_owes_per_shift_passes_with_their_reason() -> None:
    gate = AdaptGate(GateConfig(policy="shift", per_shift=1, window=2, drift_tol=0.5))
    assert not gate.wants_backward() and gate.reason == ""
    gate.switch("d0", created=True)
    assert gate.wants_backward() and gate.reason == NEW_DOMAIN
    gate.record(1.0, adapted=True)
    assert not gate.wants_backward() and gate.domains["d0"].stable
    gate.shift()  # a shift inside d0 (the shift test)
    assert gate.reason == SHIFT
    gate.record(1.0, adapted=True)
    gate.shift()  # perceived in d0 a batch before the detector switches away from it
    gate.switch("d1", created=True)
    assert gate.domains["d0"].stable and gate.skipped == 1  # d0 stays stable
    gate.switch("d0")  # back before d1's pass ran: d0 is stable, d1's pass is dropped
    assert not gate.wants_backward() and gate.skipped == 2
    gate.switch("d1")  # d1 never adapted: it still owes its first pass
    assert gate.wants_backward() and gate.reason == NEW_DOMAIN
    gate.record(1.0, adapted=True)
    for _ in range(2):  # drift waits `window` batches after settling, then owes once
        gate.record(1.0, adapted=False)
    assert not gate.wants_backward()
    gate.record(3.0, adapted=False)
    gate.record(3.0, adapted=False)
    assert gate.wants_backward() and gate.reason == DRIFT
    two = AdaptGate(GateConfig(policy="shift", per_shift=2))
    two.switch("d0", created=True)
    two.record(1.0, adapted=True)
    assert two.wants_backward()
    two.record(1.0, adapted=True)
    assert not two.wants_backward()
    with pytest.raises(ValueError, match="policy"):
        AdaptGate(GateConfig(policy="often"))


def _darda(**cfg):
    torch.set_num_threads(1)
    model, _ = load_source(CARD)
    return build_method("darda", model, input_shape=SHAPE, memory_format="contiguous", **cfg)


def _segments(scales: tuple[float, ...], per: int,
              batch: int = 8) -> list[tuple[torch.Tensor, str]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(batch, *SHAPE, generator=g) * s + (s - 1.0), f"x{s}")
            for s in scales for _ in range(per)]


def test_the_method_backpropagates_at_most_twice_per_true_shift_and_says_why() -> None:
    m = _darda()
    stream = _segments((1.0, 3.0, 0.3, 6.0), 8)
    res = [m.step(x) for x, _ in stream]
    domains = [d for _, d in stream]
    s = score_shifts(domains, [r.stats["shift"] for r in res], [r.adapted for r in res],
                     [r.stats["reason"] for r in res])
    assert s.recall == 1.0 and s.backward <= 2 * (s.true_shifts + 1), s
    assert s.backward >= s.true_shifts  # each new domain adapted
    assert all(r.stats["reason"] in (NEW_DOMAIN, SHIFT, DRIFT) for r in res if r.adapted)
    assert all(r.stats["reason"] == "" for r in res if not r.adapted)
    assert m.backward_passes == s.backward


def test_an_owed_pass_never_runs_in_a_step_whose_deadline_is_spent() -> None:
    """Fixed 100 ms deadline, an adapted step predicted at 10 ms: with the deadline spent
    by lateness, or by the clock, the owed pass waits (deferred, still owed); with room it
    runs. The fake clock advances only when told."""
    m = _darda(deadline_mode="fixed", deadline_ms=100.0)
    now, tick = [0.0], [0.0]

    def clock() -> float:
        now[0] += tick[0]
        return now[0]

    m.clock = clock
    xs = [x for x, _ in _segments((1.0,), 4)]
    first = m.step(xs[0])  # d0 created in this forward: its pass is owed from now
    assert not first.adapted and m.gate.wants_backward()
    m.adapt_seen.clear()
    m.adapt_seen.append(10.0)
    m.set_lateness(95.0)  # a backlog: 5 ms of the deadline left
    late = m.step(xs[1])
    assert late.stats["deferred"] and not late.adapted and m.gate.wants_backward()
    m.set_lateness(0.0)
    tick[0] = 0.0995  # each clock read advances 99.5 ms: spent by the time it decides
    spent = m.step(xs[2])
    assert spent.stats["deferred"] and not spent.adapted and m.gate.wants_backward()
    tick[0] = 0.0
    m.plain_seen.clear()  # that step measured seconds on the fake clock: inject 1 ms
    m.plain_seen.append(1.0)
    taken = m.step(xs[3])
    assert taken.adapted and not taken.stats["deferred"] and taken.stats["reason"] == NEW_DOMAIN
    assert m.deferred == 2 and not m.gate.wants_backward()


def test_a_batch_without_room_for_its_detection_is_served_plain() -> None:
    """The deadline left (lateness) below the forward-only step's predicted cost: the
    batch is served by the active state without detection (the detector and the shift
    test never see it), and counted; with room again, detection resumes."""
    m = _darda(deadline_mode="fixed", deadline_ms=100.0)
    m.clock = lambda: 0.0  # every step measures 0 ms: only injected costs decide
    xs = [x for x, _ in _segments((1.0,), 3)]
    assert m.step(xs[0]).stats["detected"]
    m.plain_seen.append(20.0)
    seen = m.detector.batches
    m.set_lateness(90.0)
    before = {k: v.clone() for k, v in m.model.state_dict().items()}
    m.model.eval()
    with torch.no_grad():  # what the frozen active state predicts (hooks quiet)
        with m._quiet():
            frozen = m.model(xs[1])
    plain = m.step(xs[1])
    assert not plain.stats["detected"] and plain.stats["undetected"] and not plain.adapted
    assert m.detector.batches == seen and m.undetected == 1 and plain.domain == "d0"
    # serve only: no robust-BN statistic moved, the prediction is the frozen state's
    after = m.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(plain.logits, frozen)
    m.set_lateness(0.0)
    assert m.step(xs[2]).stats["detected"] and m.detector.batches == seen + 1
