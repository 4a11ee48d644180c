"""Streaming accuracy (tta_core.eval.streaming): fake step times, fake predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tta_core.eval.streaming import (
    StreamBatch,
    default_latency_ms,
    recorded_step,
    replay_steps,
    score_batches,
    simulate_stream,
)


def _labels(n: int) -> list[int]:
    return [i % 3 for i in range(n)]


def test_fast_method_answers_every_frame_and_strict_is_offline_accuracy() -> None:
    labels = _labels(20)
    preds = [lab if i % 4 else (lab + 1) % 3 for i, lab in enumerate(labels)]  # 75% right
    r = simulate_stream(labels, 10, recorded_step(preds, 40.0), batch_size=4, queue_size=8,
                        latency_ms=100.0)
    offline = sum(p == lab for p, lab in zip(preds, labels, strict=True)) / len(labels)
    s = r.summary
    assert s.answered == 1.0 and s.dropped == 0.0
    assert s.strict == s.streaming == offline == 0.75
    assert s.mean_latency_ms == 40.0
    assert [f.answered_ms for f in r.frames] == [i * 100 + 40.0 for i in range(20)]


def test_three_times_slower_with_queue_one_follows_the_hand_computed_schedule() -> None:
    # 10 Hz (period 100 ms), step 300 ms, queue 1, batch 1; prediction of frame f is f
    r = simulate_stream(list(range(10)), 10, recorded_step(list(range(10)), 300.0),
                        latency_ms=100.0)  # L = one period: the default for batch 1
    assert [b.frames for b in r.batches] == [(0,), (3,), (6,), (9,)]
    assert [(b.start_ms, b.end_ms) for b in r.batches] == [(0, 300), (300, 600), (600, 900),
                                                         (900, 1200)]
    answered = {f.index: f.answered_ms for f in r.frames if not f.dropped}
    assert answered == {0: 300.0, 3: 600.0, 6: 900.0, 9: 1200.0}  # ~1/3 served
    assert all(math.isnan(f.answered_ms) for f in r.frames if f.dropped)
    # each answer comes 2 periods after the deadline: strict never has one
    assert [f.strict_prediction for f in r.frames] == [-1] * 10
    # streaming: the newest prediction of a frame <= i available at its deadline (i + 1) * 100
    assert [f.streaming_prediction for f in r.frames] == [-1, -1, 0, 0, 0, 3, 3, 3, 6, 6]
    assert r.summary.dropped == 0.6 and r.summary.answered == 0.0
    assert r.summary.mean_latency_ms == 300.0


def test_streaming_is_never_below_strict() -> None:
    labels = [0] * 30
    for step_ms in (10.0, 90.0, 100.0, 150.0, 250.0, 1000.0):
        for batch, queue in ((1, 1), (2, 4), (4, 2)):
            s = simulate_stream(labels, 10, recorded_step(labels, step_ms), batch, queue).summary
            assert s.streaming >= s.strict
    # streaming rescues the frames a slow method skips (constant right prediction)
    s = simulate_stream(labels, 10, recorded_step(labels, 250.0)).summary
    assert s.strict == 0.0 and s.streaming > 0.8


def test_keep_latest_queue_drops_the_oldest_and_steps_take_the_oldest_kept() -> None:
    # 100 ms period, 350 ms step, queue 3, batch 2 (the node's FrameQueue): a full queue
    # drops its oldest frame; each step takes the two oldest kept, the rest stay queued.
    # t=0 [0] -> (0,); t=350 [1,2,3] -> (1,2); t=700 [3,4,5,6,7] keeps [5,6,7] -> (5,6);
    # t=1050 [7,8,9,10] keeps [8,9,10] -> (8,9); t=1400 [10,11] -> (10,11)
    r = simulate_stream([0] * 12, 10, recorded_step([0] * 12, 350.0), batch_size=2,
                        queue_size=3)
    assert [b.frames for b in r.batches] == [(0,), (1, 2), (5, 6), (8, 9), (10, 11)]
    assert [b.start_ms for b in r.batches] == [0.0, 350.0, 700.0, 1050.0, 1400.0]
    assert r.summary.dropped == pytest.approx(3 / 12)  # frames 3, 4, 7


def test_partial_batch_waits_at_most_batch_wait() -> None:
    r = simulate_stream([0] * 8, 10, recorded_step([0] * 8, 10.0), batch_size=4,
                        queue_size=8, batch_wait_ms=250.0)
    assert [b.frames for b in r.batches] == [(0, 1, 2), (3, 4, 5), (6, 7)]


def test_two_runs_and_a_replay_give_the_same_result() -> None:
    labels = _labels(25)
    times = [30.0, 180.0, 70.0, 260.0, 20.0]
    a = simulate_stream(labels, 20, recorded_step(labels, times), 2, 2)
    b = simulate_stream(labels, 20, recorded_step(labels, times), 2, 2)
    c = simulate_stream(labels, 20, replay_steps(a), 2, 2)
    assert a.frames == b.frames == c.frames
    assert a.batches == b.batches == c.batches
    assert a.summary == b.summary == c.summary


@pytest.mark.parametrize("kwargs, word", [
    ({"hz": 0}, "frame rate"), ({"hz": -5.0}, "frame rate"), ({"hz": math.nan}, "frame rate"),
    ({"batch_size": 0}, "batch_size"), ({"queue_size": 0}, "queue_size"),
    ({"batch_wait_ms": -1.0}, "batch_wait_ms"), ({"latency_ms": -1.0}, "latency_ms"),
    ({"latency_ms": math.inf}, "latency_ms")])
def test_bad_parameters_raise_one_line_value_errors(kwargs, word) -> None:
    args = {"hz": 10, "batch_size": 1, "queue_size": 1, "batch_wait_ms": 0.0, **kwargs}
    with pytest.raises(ValueError, match=word) as err:
        simulate_stream([0, 1], step=recorded_step([0, 1], 1.0), **args)
    assert "\n" not in str(err.value)
    bad = next(iter(kwargs.values()))
    assert repr(bad) in str(err.value)


@pytest.mark.slow
def test_cli_bench_stream_hz_writes_table_and_plot(tmp_path, capsys) -> None:
    import json

    from tta_core.cli import main as cli_main

    out = tmp_path / "tmp"
    assert cli_main(["bench", "--methods", "source,tent", "--samples-per-domain", "4",
                     "--stream-hz", "30,1000", "--no-progress", "--out", str(out)]) == 0
    for name in ("report.md", "report.json", "streaming.md", "streaming.json", "streaming.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    table = (out / "streaming.md").read_text()
    assert "| method | offline | 30 Hz | 1000 Hz |" in table and "| tent |" in table
    runs = json.loads((out / "streaming.json").read_text())["runs"]
    assert sorted((r["method"], r["hz"]) for r in runs) == [
        ("source", 30.0), ("source", 1000.0), ("tent", 30.0), ("tent", 1000.0)]
    for r in runs:
        # strict needs the frame's own answer in time; a frame answered is never dropped
        assert r["strict"] <= r["answered"] and r["answered"] + r["dropped"] <= 1.0 + 1e-9
        assert r["streaming"] >= r["strict"]
        assert r["latency_ms"] == pytest.approx(7000.0 / r["hz"])  # (2 * 4 - 1) periods
    meta = json.loads((out / "streaming.json").read_text())
    assert meta["track_length"] == 1  # the shipped i.i.d. stream by default
    at30 = {r["method"]: r for r in runs if r["hz"] == 30.0}
    for method in ("source", "tent"):
        # at 30 Hz every batch fills (fill-time wait) and every step fits: the streaming run
        # is the offline run, frame for frame
        assert at30[method]["answered"] == 1.0
        assert at30[method]["strict"] == pytest.approx(meta["offline"][method])
    assert "Streaming accuracy" in capsys.readouterr().out


def test_cli_bench_refuses_bad_stream_hz(capsys) -> None:
    from tta_core.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["bench", "--stream-hz", "30,0", "--no-progress"])
    assert "--stream-hz" in capsys.readouterr().err


# ---- temporally coherent streams (tracks) and the batch-deadline allowance L


def _tracks(n: int, k: int, classes: int = 5, seed: int = 0) -> list[int]:
    """n frames, each object (a seeded random label) seen over k consecutive frames."""
    objects = np.random.default_rng(seed).integers(0, classes, n // k + 1)
    return [int(objects[i // k]) for i in range(n)]


def _offline(labels: list[int], seed: int = 1) -> list[int]:
    """Predictions wrong on a seeded random quarter of the frames."""
    wrong = np.random.default_rng(seed).random(len(labels)) < 0.25
    return [(lab + 1) % 5 if w else lab for lab, w in zip(labels, wrong, strict=True)]


def _acc(preds: list[int], labels: list[int]) -> float:
    return sum(p == lab for p, lab in zip(preds, labels, strict=True)) / len(labels)


NODE = {"batch_size": 4, "queue_size": 32, "batch_wait_ms": 50.0}


def test_default_latency_is_batch_deadline_plus_fill_wait() -> None:
    assert default_latency_ms(100, 4) == pytest.approx(70.0)
    assert default_latency_ms(1000, 1) == pytest.approx(1.0)
    r = simulate_stream([0] * 8, 100, recorded_step([0] * 8, 1.0), **NODE)
    assert r.summary.latency_ms == pytest.approx(70.0)
    assert [f.deadline_ms for f in r.frames] == pytest.approx([10.0 * i + 70 for i in range(8)])


@pytest.mark.parametrize("hz", [100.0, 250.0, 1000.0, 4000.0])
def test_step_within_the_batch_deadline_answers_every_frame(hz: float) -> None:
    # (a) step time = len(batch) / hz (the camera deadline; rates where 3 periods fit in the
    # node's 50 ms batch wait, so batches fill), node queue and batching: every
    # frame is answered by arrival + L, so strict = streaming = the offline accuracy
    labels = _tracks(400, 8)
    preds = _offline(labels)

    def step(frames, late_ms=0.0):
        return [preds[f] for f in frames], 0.999 * len(frames) * 1000.0 / hz

    s = simulate_stream(labels, hz, step, **NODE).summary
    assert s.answered == 1.0 and s.dropped == 0.0 and s.deadline_met == 1.0
    assert s.strict == s.streaming == _acc(preds, labels) > 0.7


def test_the_schedule_tells_each_step_how_late_it_starts() -> None:
    """10 Hz (100 ms period), batches of 2, full-batch wait: batch (0, 1) starts when
    frame 1 arrives (100 ms): on time. Its 250 ms step ends at 350: frames 2 and 3 arrived
    at 200 and 300, so batch (2, 3) starts 50 ms after its newest frame; a 100 ms step
    ends at 450, after frame 4 (400): (4, 5) waits for frame 5 (500) and is on time."""
    seen = []

    def step(frames, late_ms):
        seen.append((tuple(frames), late_ms))
        return [0] * len(frames), {0: 250.0, 2: 100.0}.get(frames[0], 10.0)

    simulate_stream([0] * 6, 10.0, step, batch_size=2, queue_size=8, batch_wait_ms=1000.0)
    assert [f for f, _ in seen] == [(0, 1), (2, 3), (4, 5)]
    assert [late for _, late in seen] == pytest.approx([0.0, 50.0, 0.0])


def test_step_3x_too_slow_drops_frames_strict_falls_streaming_holds_on_long_tracks() -> None:
    # (b) step = 3 b / hz: the keep-latest queue (32) drops frames and answers come ~40
    # frames late, so strict falls to 0; streaming shows the newest earlier answer: on long
    # tracks mostly the same sign (close to offline), on short tracks another one (chance)
    hz, n = 500.0, 4000
    for k, low, high in ((1, 0.15, 0.25), (2, 0.15, 0.25), (400, 0.68, 0.75)):
        labels = _tracks(n, k)
        preds = _offline(labels)
        s = simulate_stream(labels, hz, recorded_step(preds, 3 * 4000.0 / hz), **NODE).summary
        assert s.dropped > 0.5 and s.strict == 0.0 and s.deadline_met == 0.0
        assert low < s.streaming < high, (k, s.streaming)
        assert _acc(preds, labels) == pytest.approx(0.75, abs=0.01)


def test_equal_offline_accuracy_faster_method_streams_at_least_as_well() -> None:
    # (c) the same predictions (equal offline accuracy); only the step time differs
    hz = 500.0
    labels = _tracks(4000, 64)
    preds = _offline(labels)
    budget = 4000.0 / hz
    scores = [simulate_stream(labels, hz, recorded_step(preds, f * budget), **NODE).summary
              for f in (0.25, 1.0, 1.5, 2.0, 3.0, 6.0)]
    streaming = [s.streaming for s in scores]
    strict = [s.strict for s in scores]
    assert streaming == sorted(streaming, reverse=True)
    assert strict == sorted(strict, reverse=True)
    assert streaming[0] == strict[0] == _acc(preds, labels)
    assert streaming[-1] < streaming[1] - 0.3


def test_tracked_stream_with_jittered_times_replays_exactly() -> None:
    # (d) determinism: fake jittered step times around the deadline; two runs and a replay
    labels = _tracks(600, 8)
    preds = _offline(labels, 3)
    times = [2.0 + (7 * k % 11) * 0.9 for k in range(200)]  # 2 .. 11 ms, period 2.5 ms
    runs = [simulate_stream(labels, 400, recorded_step(preds, times), **NODE)
            for _ in range(2)]
    again = simulate_stream(labels, 400, replay_steps(runs[0]), **NODE)
    assert runs[0].frames == runs[1].frames == again.frames
    assert runs[0].summary == runs[1].summary == again.summary
    assert 0.0 < runs[0].summary.strict <= runs[0].summary.streaming < 1.0


def test_tracked_stream_shares_labels_per_track_and_keeps_domains() -> None:
    from tta_core.data.streams import StreamSpec, build_stream, track_starts

    base = {"samples_per_domain": 10, "corruptions": ("fog", "contrast")}
    iid = build_stream(StreamSpec(**base))
    s = build_stream(StreamSpec(**base, track_length=4))
    assert (s.domains == iid.domains).all()  # same domain order and sizes
    starts = track_starts(StreamSpec(**base, track_length=4))
    assert starts.tolist() == [0] * 4 + [4] * 4 + [8] * 2 + [10] * 4 + [14] * 4 + [18] * 2
    assert all(s.labels[i] == s.labels[starts[i]] for i in range(len(s)))
    assert len(set(s.labels.tolist())) == 6  # 6 objects, classes rotated across domains
    assert not (s.images[1] == s.images[2]).all()  # jittered views, not copies
    with pytest.raises(ValueError, match="track_length"):
        StreamSpec(order="mixed", track_length=2).validate()


@pytest.mark.slow
def test_warm_up_leaves_the_model_untouched() -> None:
    from tta_core.eval.bench_stream import warm_up
    from tta_core.model.zoo import build_model

    model = build_model("small_resnet", num_classes=16).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    warm_up(model, torch.randn(4, 3, 32, 32) * 3 + 1)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN statistics included
    assert all(p.grad is None for p in model.parameters())


def test_score_batches_of_a_simulated_run_gives_its_outcomes() -> None:
    """Scoring a schedule's own batches (as a live node's answers would arrive) gives the
    simulation's outcomes frame by frame: one rule, reused."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 4, 200).tolist()
    preds = rng.integers(0, 4, 200).tolist()
    sim = simulate_stream(labels, 30.0, recorded_step(preds, rng.uniform(20, 400, 80).tolist()),
                          batch_size=4, queue_size=8, batch_wait_ms=60.0)
    scored = score_batches(labels, 30.0, sim.batches, batch_size=4)
    assert scored.frames == sim.frames and scored.summary == sim.summary


def test_score_batches_hand_computed_and_answers_out_of_frame_order() -> None:
    # 10 Hz, batch 1, L = 100 ms: frame f's deadline is (f + 1) * 100 ms. Frame 2's answer
    # reaches the consumer before frame 1's; frame 3 is never answered.
    batches = [StreamBatch(0, (0,), 0.0, 50.0, (0,)), StreamBatch(1, (2,), 0.0, 250.0, (2,)),
               StreamBatch(2, (1,), 0.0, 260.0, (1,))]
    r = score_batches([0, 1, 2, 3], 10.0, batches)
    assert [f.strict_prediction for f in r.frames] == [0, -1, 2, -1]
    # at frame 2's deadline (300 ms) answers for frames 0, 1, 2 exist: the newest <= i counts
    assert [f.streaming_prediction for f in r.frames] == [0, 0, 2, 2]
    assert r.summary.answered == 0.5 and r.summary.dropped == 0.25
    with pytest.raises(ValueError, match="frame 4 is outside"):
        score_batches([0, 1], 10.0, [StreamBatch(0, (4,), 0.0, 1.0, (0,))])
    with pytest.raises(ValueError, match=r"frame 0 is outside .* or answered twice"):
        score_batches([0, 1], 10.0, [StreamBatch(0, (0, 0), 0.0, 1.0, (0, 0))])
