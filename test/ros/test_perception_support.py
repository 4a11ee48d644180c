"""Perception worker helpers: bounded keep-latest queue, plan staleness, divergence guard."""

from __future__ import annotations

import math
import threading
import time

import pytest

from tta_ros.nodes.perception_support import DivergenceGuard, FrameQueue, PlanGate


def test_queue_keeps_latest_and_counts_drops() -> None:
    q = FrameQueue(3)
    dropped = [q.push(i) for i in range(10)]
    assert dropped == [False] * 3 + [True] * 7
    assert q.dropped == 7 and q.received == 10 and len(q) == 3
    assert q.take(5, batch_timeout_s=0.0) == [7, 8, 9]
    assert q.take(5, batch_timeout_s=0.0, poll_s=0.01) == []


def test_queue_take_waits_for_a_full_batch() -> None:
    q = FrameQueue(8)
    q.push(0)
    threading.Timer(0.05, lambda: [q.push(i) for i in (1, 2)]).start()
    assert q.take(3, batch_timeout_s=2.0) == [0, 1, 2]
    q.push(3)
    assert q.take(3, batch_timeout_s=0.05) == [3]  # partial batch after the timeout


def test_queue_says_how_long_ago_the_newest_frame_of_a_batch_arrived() -> None:
    q = FrameQueue(8)
    assert q.late_ms() == 0.0  # no batch yet
    for i in range(3):
        q.push(i)
    time.sleep(0.05)
    q.push(3)
    assert q.take(2, 0.0) == [0, 1]
    assert q.late_ms() >= 50.0  # frames 0 and 1 have waited
    assert q.take(2, 0.0) == [2, 3]
    assert q.late_ms() < 50.0  # frame 3 just came


def test_queue_resize_keeps_newest() -> None:
    q = FrameQueue(5)
    for i in range(5):
        q.push(i)
    q.resize(2)
    assert q.dropped == 3 and q.take(5, 0.0) == [3, 4]
    with pytest.raises(ValueError, match="queue_size"):
        FrameQueue(0)


def test_plan_gate_stale_only_when_an_importance_waits() -> None:
    g = PlanGate(timeout_s=1.0)
    assert g.current(now=100.0) is None and not g.stale(now=100.0)
    g.on_plan("p1", now=100.0)
    assert g.current(now=500.0) == "p1"  # idle stream: never stale
    g.on_importance_sent(now=501.0)
    g.on_importance_sent(now=501.8)  # the oldest unanswered one counts
    assert g.current(now=501.9) == "p1"
    assert g.stale(now=502.1) and g.current(now=502.1) is None
    g.on_plan("p2", now=502.2)  # plans resume
    assert g.current(now=502.3) == "p2" and not g.stale(now=510.0)


def test_divergence_guard() -> None:
    g = DivergenceGuard(num_classes=10, ratio=0.5, patience=3)
    limit = 0.5 * math.log(10)
    assert g.check(True, limit + 0.1) == "" and g.check(True, limit + 0.1) == ""
    assert "3 batches" in g.check(True, limit + 0.1)
    assert g.check(True, limit + 0.1) == ""  # streak restarted after the reset
    assert g.check(True, limit - 0.1) == "" and g.high_streak == 0
    assert g.check(False, 0.0) == "non-finite logits" and g.resets == 2


def test_sequence_gaps_count_missed_frames_per_publisher() -> None:
    pytest.importorskip("rclpy")
    from tta_ros.nodes.intake import SequenceGaps

    g = SequenceGaps()
    assert [g.missed(b"a", s) for s in (1, 2, 5, 6)] == [0, 0, 2, 0]
    assert [g.missed(b"b", s) for s in (10, 13)] == [0, 2]  # its own sequence
    assert g.missed(b"a", 1) == 0 and g.missed(b"a", None) == 0  # reordered / unknown
    assert g.missed(b"a", 8) == 1  # counted from the newest seen (6), never twice
    q = FrameQueue(4)
    q.count_lost(3)
    q.count_lost(0)
    assert q.dropped == 3


def test_wait_below_returns_when_the_worker_takes_frames() -> None:
    q = FrameQueue(8)
    for i in range(4):
        q.push(i)
    assert not q.wait_below(4, timeout=0.01)  # 4 queued: no room below 4
    threading.Timer(0.05, lambda: q.take(2, 0.0)).start()
    assert q.wait_below(4, timeout=5.0) and len(q) == 2
