"""Replay over real rclpy: a tiny bag through build_nodes in-process -> one prediction per
image with the image's stamp, statuses per batch, report against ground truth."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rclpy")
pytest.importorskip("tta_msgs.msg")

from helpers import ROOT

from tta_core.data.signs import CLASS_NAMES, make_signs
from tta_core.eval.report import load_runs, summarize
from tta_core.io.bag import read_bag, write_bag

CONFIG = ROOT / "config" / "vehicle.yaml"
N = 24


@pytest.fixture(scope="module")
def tiny_bag(tmp_path_factory) -> Path:
    """24 sign images: 12 clean, then 12 with strong noise (a shifted domain)."""
    ds = make_signs(N, 32, seed=7)
    rng = np.random.default_rng(0)
    imgs = ds.images.copy()
    noisy = imgs[12:].astype(np.float32) + rng.normal(0, 60, imgs[12:].shape)
    imgs[12:] = np.clip(noisy, 0, 255).astype(np.uint8)
    doms = ["clean"] * 12 + ["gaussian_noise/5"] * 12
    path = tmp_path_factory.mktemp("bags") / "tiny"
    write_bag(path, zip(imgs, ds.labels.tolist(), doms, strict=True), rate_hz=60.0,
              class_names=CLASS_NAMES)
    return path


def _source_predictions(frames) -> np.ndarray:
    """The source model applied directly (no ROS) to the bag's images."""
    import torch

    from tta_core.io.image_msg import Preprocess, to_tensor
    from tta_core.model.source import load_source
    from tta_ros.bringup import load_params
    from tta_ros.ros_params import resolve_paths

    card_path = resolve_paths(load_params(CONFIG)["perception"], ROOT)["model_card"]
    model, card = load_source(card_path)
    pre = Preprocess.from_card(card)
    x = to_tensor([f.image.astype(np.float32) / 255 for f in frames], pre)  # float path
    with torch.no_grad():
        return model.eval()(x).argmax(1).numpy()


def test_replay_source_matches_direct_inference(tiny_bag, ros_context, tmp_path) -> None:
    from tta_ros.replay import ReplayOptions, replay

    frames = list(read_bag(tiny_bag))
    res = replay(ReplayOptions(tiny_bag, CONFIG, rate="max", method="source",
                               out=tmp_path / "r"), context=ros_context)
    assert res.n_published == N and res.n_predictions == N and not res.interrupted
    run = res.run
    assert [f.stamp_ns for f in run.frames] == [f.stamp_ns for f in frames]
    assert run.frames_dropped == 0
    preds = np.array([f.prediction for f in run.frames])
    assert np.array_equal(preds, _source_predictions(frames))
    labels = np.array([f.label for f in frames])
    s = summarize(run)
    assert s.accuracy["clean"] == pytest.approx(np.mean(preds[:12] == labels[:12]))
    assert s.accuracy["gaussian_noise/5"] == pytest.approx(np.mean(preds[12:] == labels[12:]))
    assert s.e2e is not None and s.e2e.n == N and s.e2e.p50 > 0
    assert all(f.phases_ms for f in run.frames)  # every frame's batch status arrived
    data = json.loads(res.files.json.read_text())
    assert data["summaries"][0]["method"] == "source"
    assert not (tmp_path / "r" / "partial.json").exists()


def test_replay_adashadow_statuses(tiny_bag, ros_context) -> None:
    from tta_ros.replay import ReplayOptions, replay

    res = replay(ReplayOptions(tiny_bag, CONFIG, rate="120"), context=ros_context)
    assert res.n_predictions == N and res.files is None
    batches = {f.batch_id for f in res.run.frames}
    assert res.n_statuses >= len(batches) >= 3  # batch size 8 at most
    assert res.run.method == "adashadow"
    assert all(f.phases_ms["total"] > 0 for f in res.run.frames)


def test_interrupt_writes_what_it_has(tiny_bag, ros_context, tmp_path) -> None:
    from tta_ros.replay import ReplayOptions, replay

    def stop_at_half(done: int, total: int) -> None:
        if done == total // 2:
            raise KeyboardInterrupt

    res = replay(ReplayOptions(tiny_bag, CONFIG, method="source", out=tmp_path / "i"),
                 context=ros_context, progress=stop_at_half)
    assert res.interrupted and res.n_published == N // 2
    assert 0 < len(res.run.frames) <= N // 2
    back = load_runs(res.files.json)[0]
    assert [f.stamp_ns for f in back.frames] == [f.stamp_ns for f in res.run.frames]


def test_bad_rate_is_refused(tiny_bag) -> None:
    from tta_ros.replay import ReplayOptions

    with pytest.raises(ValueError, match="'fast'"):
        ReplayOptions(tiny_bag, CONFIG, rate="fast")
    with pytest.raises(ValueError, match="'-3'"):
        ReplayOptions(tiny_bag, CONFIG, rate="-3")


def test_collector_waits_for_the_last_batch_status() -> None:
    """Perception publishes a batch's status after its predictions: the replay is settled
    only once both are in, and a status arriving wakes the waiter."""
    import threading

    from tta_msgs.msg import AdaptationStatus, ClassPrediction

    from tta_ros.replay import Collector

    col = Collector()
    for stamp, batch in ((1, 7), (2, 7), (3, 8)):
        col.published[stamp] = 0.0
        msg = ClassPrediction(batch_id=batch)
        msg.header.stamp.nanosec = stamp
        col.on_prediction(msg)
    col.on_status(AdaptationStatus(batch_id=7))
    assert col.in_flight() == 0 and not col.settled()  # batch 8's status still on its way
    late = threading.Timer(0.2, col.on_status, args=(AdaptationStatus(batch_id=8),))
    late.start()
    assert col.wait(col.settled, timeout_s=5.0) and col.settled()
    late.join()
    assert not Collector().wait(lambda: False, timeout_s=0.05)  # nothing moves: gives up


def test_replay_of_a_segmentation_bag_serves_the_segmentation_card(tmp_path) -> None:
    import argparse

    from tta_ros.commands.replay import card_overrides
    from tta_ros.launch_params import SEGMENTATION_CARD

    img = np.zeros((4, 4, 3), np.uint8)
    write_bag(tmp_path / "seg", [(img, np.zeros((4, 4), np.uint8), "clean")],
              task="segmentation")
    write_bag(tmp_path / "cls", [(img, 1, "clean")])

    def ask(bag: str, method=None, card: str = "") -> tuple[dict, str | None]:
        return card_overrides(argparse.Namespace(bag=tmp_path / bag, method=method,
                                                 model_card=card))

    over, method = ask("seg")
    assert method == "tent" and over["perception"]["model_card"] == SEGMENTATION_CARD
    assert over["scheduler"]["model_card"] == SEGMENTATION_CARD
    assert ask("seg", "cotta", "/m.json") == (
        {"perception": {"model_card": "/m.json", "method": "cotta"},
         "scheduler": {"model_card": "/m.json"}}, "cotta")
    assert ask("cls", "tent") == ({}, "tent")  # a classification bag: the config's card
