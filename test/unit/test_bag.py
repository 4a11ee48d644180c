"""Bags written by tta_core.io.bag read back bit-identical, joined by stamp; clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from helpers import ROOT
from rosbags.rosbag2 import Reader, StoragePlugin, Writer

from tta_core.data.streams import domain_name
from tta_core.io import bag
from tta_core.io.bag import (
    DOMAIN_TOPIC,
    DOMAIN_TYPE,
    GT_TOPIC,
    IMAGE_TOPIC,
    LEGACY_DOMAIN_TYPE,
    ROS_DISTRO,
    BagWriter,
    bag_info,
    read_bag,
    tta_typestore,
    write_bag,
)
from tta_core.io.image_msg import image_to_rgb8

NAMES = ("a", "b", "c", "d", "e")


def _frames(n: int = 10, seed: int = 0) -> list[tuple[np.ndarray, int, str]]:
    rng = np.random.default_rng(seed)
    doms = [domain_name(None, 0)] * 4 + [domain_name("fog", 5)] * 3 + [domain_name("snow", 3)] * 3
    return [(rng.integers(0, 256, (8 + i % 3, 12, 3), dtype=np.uint8), int(rng.integers(5)),
             doms[i]) for i in range(n)]


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_roundtrip_bit_identical(tmp_path, storage: str) -> None:
    frames = _frames()
    info = write_bag(tmp_path / "b", frames, rate_hz=20.0, class_names=NAMES, storage=storage)
    assert info.n_images == 10 and info.has_ground_truth
    assert info.duration_s == pytest.approx(9 / 20)
    back = list(read_bag(tmp_path / "b"))
    assert len(back) == len(frames)
    for (img, label, dom), got in zip(frames, back, strict=True):
        assert got.image.dtype == np.uint8 and np.array_equal(got.image, img)
        assert (got.label, got.domain, got.class_name) == (label, dom, NAMES[label])
    stamps = np.array([f.stamp_ns for f in back])
    assert np.all(np.diff(stamps) == 50_000_000)  # 20 Hz camera rate
    assert [f.domain for f in back[3:5]] == ["clean", "fog/5"]


@pytest.mark.parametrize("domain_type", [DOMAIN_TYPE, LEGACY_DOMAIN_TYPE])
def test_join_is_by_stamp_not_order(tmp_path, domain_type: str) -> None:
    """Ground truth written in reverse order, with log times unrelated to stamps; the domain
    as a DomainLabel or (bags written before it existed) in a Header's frame_id."""
    store = tta_typestore()
    t = store.types
    rng = np.random.default_rng(1)
    imgs = [rng.integers(0, 256, (4, 4, 3), dtype=np.uint8) for _ in range(3)]
    stamps = [5_000_000_000 + k * 100_000_000 for k in range(3)]

    def header(ns: int, fid: str) -> object:
        return t["std_msgs/msg/Header"](
            stamp=t["builtin_interfaces/msg/Time"](sec=ns // 10**9, nanosec=ns % 10**9),
            frame_id=fid)

    with Writer(tmp_path / "j", version=9, storage_plugin=StoragePlugin.MCAP) as w:
        ci = w.add_connection(IMAGE_TOPIC, "sensor_msgs/msg/Image", typestore=store)
        cg = w.add_connection(GT_TOPIC, "tta_msgs/msg/ClassPrediction", typestore=store)
        cd = w.add_connection(DOMAIN_TOPIC, domain_type, typestore=store)
        for k in (2, 1, 0):
            gt = t["tta_msgs/msg/ClassPrediction"](header=header(stamps[k], "camera"),
                                                   batch_id=0, label=10 + k, confidence=1.0,
                                                   class_name="x", scores=np.zeros(0, np.float32))
            w.write(cg, 1000 + k, store.serialize_cdr(gt, cg.msgtype))
            label = (header(stamps[k], f"d{k}") if domain_type == LEGACY_DOMAIN_TYPE else
                     t[DOMAIN_TYPE](header=header(stamps[k], "camera"), domain=f"d{k}"))
            w.write(cd, 2000 + k, store.serialize_cdr(label, cd.msgtype))
        for k in range(3):
            img = t["sensor_msgs/msg/Image"](header=header(stamps[k], "camera"), height=4,
                                             width=4, encoding="rgb8", is_bigendian=0, step=12,
                                             data=imgs[k].reshape(-1))
            w.write(ci, 3000 + k, store.serialize_cdr(img, ci.msgtype))
    back = list(read_bag(tmp_path / "j"))
    assert [(f.label, f.domain, f.stamp_ns) for f in back] == [
        (10 + k, f"d{k}", stamps[k]) for k in range(3)]
    assert all(np.array_equal(f.image, imgs[k]) for k, f in enumerate(back))


def test_metadata_is_what_ros2_bag_record_writes(tmp_path) -> None:
    """Distro name, the domain label's own type, offered QoS a `ros2 bag play` can use."""
    write_bag(tmp_path / "m", _frames(3), class_names=NAMES)
    meta = yaml.safe_load((tmp_path / "m" / "metadata.yaml").read_text())
    info = meta["rosbag2_bagfile_information"]
    assert info["ros_distro"] == ROS_DISTRO == "kilted"
    topics = {t["topic_metadata"]["name"]: t["topic_metadata"]
              for t in info["topics_with_message_count"]}
    assert topics[DOMAIN_TOPIC]["type"] == "tta_msgs/msg/DomainLabel"
    qos = {name: t["offered_qos_profiles"] for name, t in topics.items()}
    assert [q["reliability"] for q in qos[IMAGE_TOPIC]] == ["best_effort"]
    assert [(q["reliability"], q["history"], q["depth"]) for q in qos[GT_TOPIC]] == [
        ("reliable", "keep_last", 10)]
    assert qos[DOMAIN_TOPIC] == qos[GT_TOPIC]
    with Reader(tmp_path / "m") as r:  # what the reader makes of it, not just the YAML
        assert r.ros_distro == "kilted"
        (conn,) = [c for c in r.connections if c.topic == IMAGE_TOPIC]
        assert conn.ext.offered_qos_profiles[0].depth == 5


def _mcap_channels(path) -> dict[str, dict[str, str]]:
    """topic -> channel metadata (MCAP map<string, string>) of an MCAP file's summary."""
    from io import BytesIO

    from rosbags.rosbag2.storage_mcap import McapReader, read_string

    reader = McapReader(path)
    reader.open()
    try:
        out = {}
        for ch in reader.channels.values():
            bio, meta = BytesIO(ch.metadata), {}
            while bio.tell() < len(ch.metadata):
                key = read_string(bio)
                meta[key] = read_string(bio)
            out[ch.topic] = meta
        return out
    finally:
        reader.close()


@pytest.mark.parametrize("folder", ["tmp", "sample"])
def test_mcap_channels_and_embedded_metadata_as_rosbag2_writes_them(tmp_path, folder) -> None:
    """Each MCAP channel carries `topic_type_hash` (the topic's RIHS01 type description
    hash, as in metadata.yaml) next to its QoS, and the bag metadata embedded in the file
    names the same distro as metadata.yaml: in a new bag and in the shipped sample."""
    path = tmp_path / "m" if folder == "tmp" else ROOT / "bags" / "signs32_sample"
    if folder == "tmp":
        write_bag(path, _frames(3), class_names=NAMES)
    info = yaml.safe_load((path / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    hashes = {t["topic_metadata"]["name"]: t["topic_metadata"]["type_description_hash"]
              for t in info["topics_with_message_count"]}
    channels = _mcap_channels(path / info["relative_file_paths"][0])
    assert {t: m["topic_type_hash"] for t, m in channels.items()} == hashes
    assert all(h.startswith("RIHS01_") and len(h) == 71 for h in hashes.values())
    assert all(set(m) == {"offered_qos_profiles", "topic_type_hash"} for m in channels.values())
    data = (path / info["relative_file_paths"][0]).read_bytes()
    assert info["ros_distro"] == ROS_DISTRO
    assert data.count(f"ros_distro: {ROS_DISTRO}".encode()) == 1
    assert b"ros_distro: rosbags" not in data


def test_message_definitions_found_in_an_installed_workspace(tmp_path, monkeypatch) -> None:
    """Without a checkout's msg/ (a non-symlink install), the definitions tta_msgs installed
    under an AMENT_PREFIX_PATH prefix are used; with neither, the error says what to do."""
    installed = tmp_path / "prefix" / "share" / "tta_msgs" / "msg"
    installed.mkdir(parents=True)
    (installed / "DomainLabel.msg").write_text("string domain\n")
    monkeypatch.setattr(bag, "CHECKOUT_MSG_DIR", tmp_path / "no_checkout")
    monkeypatch.setenv("AMENT_PREFIX_PATH", f"{tmp_path / 'other'}:{tmp_path / 'prefix'}")
    assert bag.msg_dir() == installed
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(tmp_path / "other"))
    with pytest.raises(FileNotFoundError, match="source its workspace"):
        bag.msg_dir()


def test_missing_bag_and_missing_topic(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_bag(tmp_path / "nope"))
    store = tta_typestore()
    with Writer(tmp_path / "imgs", version=9, storage_plugin=StoragePlugin.MCAP) as w:
        w.add_connection(IMAGE_TOPIC, "sensor_msgs/msg/Image", typestore=store)
    with pytest.raises(ValueError, match="no topic '/ground_truth'"):
        list(read_bag(tmp_path / "imgs"))
    assert list(read_bag(tmp_path / "imgs", require_ground_truth=False)) == []
    assert not bag_info(tmp_path / "imgs").has_ground_truth
    with Writer(tmp_path / "none", version=9, storage_plugin=StoragePlugin.MCAP) as w:
        w.add_connection(GT_TOPIC, "tta_msgs/msg/ClassPrediction", typestore=store)
    with pytest.raises(ValueError, match="no topic '/camera/image_raw'"):
        list(read_bag(tmp_path / "none"))


def test_writer_refuses_bad_input(tmp_path) -> None:
    write_bag(tmp_path / "b", _frames(2))
    with pytest.raises(FileExistsError):
        write_bag(tmp_path / "b", _frames(2))
    with pytest.raises(ValueError, match="storage"):
        BagWriter(tmp_path / "c", storage="rosbag1")
    with pytest.raises(ValueError, match="rate_hz"):
        BagWriter(tmp_path / "c", rate_hz=0)
    with BagWriter(tmp_path / "c") as w, pytest.raises(ValueError, match="uint8"):
        w.add(np.zeros((4, 4, 3), np.float32), 0, "clean")


def test_bag_images_decode_honouring_step_and_order() -> None:
    t = tta_typestore().types
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    padded = np.zeros((2, 12), np.uint8)  # 3 padding bytes per row
    padded[:, :9] = rgb[..., ::-1].reshape(2, 9)  # stored as bgr8
    msg = t["sensor_msgs/msg/Image"](header=t["std_msgs/msg/Header"](
        stamp=t["builtin_interfaces/msg/Time"](sec=0, nanosec=0), frame_id=""),
        height=2, width=3, encoding="bgr8", is_bigendian=0, step=12, data=padded.reshape(-1))
    assert np.array_equal(image_to_rgb8(msg), rgb)
    msg.encoding = "nv21"
    with pytest.raises(ValueError, match="nv21"):
        image_to_rgb8(msg)


def test_parse_domains() -> None:
    from tta_core.cli.commands.make_bag import parse_domains

    assert parse_domains("clean,fog/5, snow/3") == [(None, 0), ("fog", 5), ("snow", 3)]
    for bad in ("fog", "fog/9", "/3", "fog/x"):
        with pytest.raises(ValueError, match=bad.replace("/", ".")):
            parse_domains(bad)
