"""rosbag2 files of a camera stream with ground truth, through `rosbags` (no rclpy).

Layout (written by `write_bag`, expected by `read_bag`):

- `/camera/image_raw`   sensor_msgs/msg/Image, rgb8, frame_id "camera", stamps at the
  camera rate;
- `/ground_truth`       tta_msgs/msg/ClassPrediction, one per image, header.stamp = the
  image's stamp, label + class_name, confidence 1 (a classification bag);
- `/ground_truth/segmentation` sensor_msgs/msg/Image, mono8 train ids (255 = ignore), one
  per image, header.stamp = the image's stamp (a segmentation bag, `task="segmentation"`:
  instead of /ground_truth);
- `/ground_truth/domain` tta_msgs/msg/DomainLabel, one per image, header.stamp = the
  image's stamp, domain = "<corruption>/<severity>" or "clean". (Bags written before
  DomainLabel existed carry it in a std_msgs/msg/Header's frame_id: still read.)

The side topics are joined to images by stamp, so a bag re-recorded by `ros2 bag record`
(where log times differ from stamps) reads the same. The metadata is what `ros2 bag record`
writes: the ROS distribution and each topic's offered QoS (the camera's sensor-data QoS, so
`ros2 bag play` publishes best-effort images; reliable ground truth).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from io import BytesIO
from pathlib import Path
from types import MappingProxyType

import numpy as np
from rosbags.interfaces import (
    Qos,
    QosDurability,
    QosHistory,
    QosLiveliness,
    QosReliability,
    QosTime,
)
from rosbags.rosbag2 import Reader, ReaderError, StoragePlugin, Writer
from rosbags.rosbag2.storage_mcap import Channel, McapWriter, write_channel, write_string
from rosbags.serde import SerdeError
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

from tta_core.errors import InputError, one_line
from tta_core.io.image_msg import image_to_rgb8

IMAGE_TOPIC = "/camera/image_raw"
GT_TOPIC = "/ground_truth"
DOMAIN_TOPIC = "/ground_truth/domain"
MASK_TOPIC = "/ground_truth/segmentation"
TASKS = ("classification", "segmentation")
IMAGE_TYPE = "sensor_msgs/msg/Image"
GT_TYPE = "tta_msgs/msg/ClassPrediction"
DOMAIN_TYPE = "tta_msgs/msg/DomainLabel"
LEGACY_DOMAIN_TYPE = "std_msgs/msg/Header"  # domain in frame_id (bags before DomainLabel)
# the ROS 2 distribution of the rclpy wheels the project pins (rclpy 9.x): rosbags writes
# its own name there, `ros2 bag info` shows the recording distro
ROS_DISTRO = "kilted"
CHECKOUT_MSG_DIR = Path(__file__).resolve().parents[2] / "msg" / "msg"
_INFINITE = QosTime(sec=9223372036, nsec=854775807)  # rosbag2's RMW_DURATION_INFINITE
_QOS = {reliability: Qos(QosHistory.KEEP_LAST, depth, reliability, QosDurability.VOLATILE,
                         _INFINITE, _INFINITE, QosLiveliness.AUTOMATIC, _INFINITE, False)
        for reliability, depth in ((QosReliability.BEST_EFFORT, 5),
                                   (QosReliability.RELIABLE, 10))}
#: offered QoS per topic: the camera's sensor-data profile, reliable ground truth
OFFERED_QOS = {IMAGE_TOPIC: _QOS[QosReliability.BEST_EFFORT],
               GT_TOPIC: _QOS[QosReliability.RELIABLE],
               MASK_TOPIC: _QOS[QosReliability.RELIABLE],
               DOMAIN_TOPIC: _QOS[QosReliability.RELIABLE]}
STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}


@dataclass
class BagFrame:
    """One image of a bag with its ground truth (label -1 / domain "" when absent; a
    segmentation bag's frames carry their train-id mask, label -1)."""

    stamp_ns: int
    image: np.ndarray  # (H, W, 3) uint8 RGB
    label: int
    domain: str
    class_name: str = ""
    mask: np.ndarray | None = None  # (H, W) uint8 train ids, 255 = ignore


@dataclass
class BagInfo:
    """What a bag holds: image count, image size, duration and ground-truth presence."""

    path: Path
    n_images: int
    duration_s: float
    topics: dict[str, str]  # topic -> message type
    has_ground_truth: bool
    task: str = "classification"  # segmentation: masks on MASK_TOPIC


def msg_dir() -> Path:
    """The tta_msgs `.msg` definitions: the source checkout's msg/msg, else those the
    tta_msgs package installed (share/tta_msgs/msg under an AMENT_PREFIX_PATH prefix)."""
    if any(CHECKOUT_MSG_DIR.glob("*.msg")):
        return CHECKOUT_MSG_DIR
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        installed = Path(prefix) / "share" / "tta_msgs" / "msg"
        if prefix and any(installed.glob("*.msg")):
            return installed
    raise FileNotFoundError(f"no tta_msgs definitions in {CHECKOUT_MSG_DIR} nor under "
                            "AMENT_PREFIX_PATH (build tta_msgs and source its workspace)")


@lru_cache(maxsize=1)
def tta_typestore() -> Typestore:
    """ROS 2 Kilted typestore with the tta_msgs types of `msg/*.msg` registered."""
    files = sorted(msg_dir().glob("*.msg"))
    store = get_typestore(Stores.ROS2_KILTED)
    types = {}
    for f in files:
        types.update(get_types_from_msg(f.read_text(), f"tta_msgs/msg/{f.stem}"))
    store.register(types)
    return store


def stamp_ns(header: object) -> int:
    """Nanoseconds of a header's builtin_interfaces/Time stamp."""
    st = header.stamp  # type: ignore[attr-defined]
    return int(st.sec) * 1_000_000_000 + int(st.nanosec)


# ----------------------------------------------------------------------------- writing


class Rosbag2McapWriter(McapWriter):
    """rosbags' MCAP storage writing what rosbag2's own MCAP plugin writes: each channel's
    metadata holds `topic_type_hash` (the type description hash, RIHS01_...) next to
    `offered_qos_profiles`, and the bag metadata embedded in the file names ROS_DISTRO as
    the recording distro (rosbags writes its own name there)."""

    def add_connection(self, connection: object, offered_qos_profiles: str) -> None:
        meta = BytesIO()
        for key, value in (("offered_qos_profiles", offered_qos_profiles),
                           ("topic_type_hash", connection.digest)):  # type: ignore[attr-defined]
            write_string(meta, key)
            write_string(meta, value)
        c = connection
        self.channels.append(Channel(c.id, c.msgtype, c.topic,  # type: ignore[attr-defined]
                                     c.ext.serialization_format,  # type: ignore[attr-defined]
                                     meta.getvalue()))
        self.channel_stats[c.id] = 0  # type: ignore[attr-defined]
        write_channel(self.chunk.bio, self.channels[-1], self.schemas)

    def close(self, version: int, metadata: str) -> None:
        super().close(version, _distro_named(metadata, ROS_DISTRO))


class Rosbag2Writer(Writer):
    """rosbags' Writer with Rosbag2McapWriter as its MCAP storage."""

    STORAGE_PLUGINS = MappingProxyType({**Writer.STORAGE_PLUGINS,
                                        StoragePlugin.MCAP: Rosbag2McapWriter})


class BagWriter:
    """Appends frames (image + ground truth: a label, or a mask with `task="segmentation"`)
    to a new bag; use as a context manager."""

    def __init__(self, path: str | Path, rate_hz: float = 30.0, start_ns: int = 10**18,
                 class_names: Sequence[str] = (), storage: str = "mcap",
                 task: str = "classification") -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        self.task = task
        if not rate_hz > 0:
            raise ValueError(f"rate_hz must be > 0, got {rate_hz!r}")
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {sorted(STORAGES)}, got {storage!r}")
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"{self.path} exists already; bags are never overwritten")
        self.rate_hz, self.start_ns, self.class_names = rate_hz, start_ns, tuple(class_names)
        self.store = tta_typestore()
        self.count = 0
        self._writer = Rosbag2Writer(self.path, version=9, storage_plugin=STORAGES[storage])

    def __enter__(self) -> BagWriter:
        self._writer.open()
        w, s = self._writer, self.store
        self._conns = {t: w.add_connection(t, m, typestore=s,
                                           offered_qos_profiles=[OFFERED_QOS[t]])
                       for t, m in ((IMAGE_TOPIC, IMAGE_TYPE), self._truth_topic(),
                                    (DOMAIN_TOPIC, DOMAIN_TYPE))}
        return self

    def __exit__(self, *exc: object) -> None:
        self._writer.close()
        if exc[0] is None:
            _set_ros_distro(self.path / "metadata.yaml", ROS_DISTRO)

    def _truth_topic(self) -> tuple[str, str]:
        return (MASK_TOPIC, IMAGE_TYPE) if self.task == "segmentation" else (GT_TOPIC,
                                                                               GT_TYPE)

    def _header(self, t_ns: int, frame_id: str) -> object:
        t = self.store.types
        stamp = t["builtin_interfaces/msg/Time"](sec=t_ns // 10**9, nanosec=t_ns % 10**9)
        return t["std_msgs/msg/Header"](stamp=stamp, frame_id=frame_id)

    def _image(self, t_ns: int, pixels: np.ndarray, encoding: str) -> object:
        h, w = pixels.shape[:2]
        channels = 1 if pixels.ndim == 2 else pixels.shape[2]
        return self.store.types[IMAGE_TYPE](
            header=self._header(t_ns, "camera"), height=h, width=w, encoding=encoding,
            is_bigendian=0, step=w * channels, data=np.ascontiguousarray(pixels).reshape(-1))

    def _truth(self, t_ns: int, label: int | np.ndarray, image: np.ndarray) -> object:
        """The ground-truth message: a ClassPrediction, or a segmentation bag's mono8 mask."""
        if self.task == "segmentation":
            mask = np.asarray(label)
            if mask.dtype != np.uint8 or mask.shape != image.shape[:2]:
                raise ValueError(f"mask must be {image.shape[:2]} uint8 (the image's size), "
                                 f"got {mask.shape} {mask.dtype}")
            return self._image(t_ns, mask, "mono8")
        label = int(label)
        name = self.class_names[label] if 0 <= label < len(self.class_names) else str(label)
        return self.store.types[GT_TYPE](
            header=self._header(t_ns, "camera"), batch_id=self.count, label=label,
            confidence=1.0, class_name=name, scores=np.zeros(0, np.float32))

    def add(self, image: np.ndarray, label: int | np.ndarray, domain: str) -> int:
        """Write one (H, W, 3) uint8 RGB frame and its ground truth (a class id, or a
        segmentation bag's (H, W) uint8 train-id mask); returns its stamp (ns)."""
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"image must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
        t = self.store.types
        t_ns = self.start_ns + round(self.count * 1e9 / self.rate_hz)
        img = self._image(t_ns, image, "rgb8")
        gt = self._truth(t_ns, label, image)
        label_msg = t[DOMAIN_TYPE](header=self._header(t_ns, "camera"), domain=domain)
        truth = self._truth_topic()[0]
        for topic, msg in ((IMAGE_TOPIC, img), (truth, gt), (DOMAIN_TOPIC, label_msg)):
            data = self.store.serialize_cdr(msg, self._conns[topic].msgtype)
            self._writer.write(self._conns[topic], t_ns, data)
        self.count += 1
        return t_ns


def _distro_named(text: str, distro: str) -> str:
    """Bag metadata YAML with `ros_distro: rosbags` (what rosbags writes) naming `distro`."""
    return re.sub(r"(?m)^(\s*ros_distro:) rosbags$", rf"\1 {distro}", text)


def _set_ros_distro(metadata: Path, distro: str) -> None:
    """Name the recording distro in metadata.yaml as `ros2 bag record` does (rosbags writes
    `ros_distro: rosbags`); an atomic replace, the rest of the file byte-identical."""
    text = metadata.read_text()
    fixed = _distro_named(text, distro)
    tmp = metadata.with_suffix(".yaml.tmp")
    tmp.write_text(fixed)
    tmp.replace(metadata)


def write_bag(path: str | Path, frames: Iterable[tuple[np.ndarray, int | np.ndarray, str]],
              rate_hz: float = 30.0, class_names: Sequence[str] = (),
              storage: str = "mcap", task: str = "classification") -> BagInfo:
    """Write (image, label or mask, domain) frames to a new bag at `path`; its info."""
    with BagWriter(path, rate_hz, class_names=class_names, storage=storage, task=task) as w:
        for image, label, domain in frames:
            w.add(image, label, domain)
    return bag_info(path)


# ----------------------------------------------------------------------------- reading


class BagError(InputError):
    """A bag that exists but cannot be read (garbage, truncated, undecodable messages)."""


# what rosbags raises on a damaged file: bad magic/metadata, undecodable or cut records
_DAMAGED = (ReaderError, SerdeError, EOFError, OverflowError, struct.error)


@contextmanager
def _readable(path: str | Path) -> Iterator[None]:
    """Turn rosbags' errors about a damaged bag into a BagError naming it."""
    try:
        yield
    except _DAMAGED as exc:
        raise BagError(f"bag {path} is not a readable rosbag2 ({type(exc).__name__}: "
                       f"{one_line(exc)})") from None


def _open(path: str | Path) -> Reader:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"bag {p} does not exist")
    return Reader(p)


def _topics(reader: Reader) -> dict[str, str]:
    return {c.topic: c.msgtype for c in reader.connections}


def _check_topic(topics: dict[str, str], topic: str, msgtype: str, path: Path) -> None:
    if topic not in topics:
        raise ValueError(f"bag {path} has no topic {topic!r} (it has {sorted(topics)})")
    if topics[topic] != msgtype:
        raise ValueError(f"bag {path}: topic {topic} is {topics[topic]}, expected {msgtype}")


def bag_info(path: str | Path) -> BagInfo:
    """Image count, duration, topics, whether both ground-truth topics are present and the
    task (segmentation when it has masks)."""
    with _readable(path), _open(path) as r:
        topics = _topics(r)
        n = sum(c.msgcount for c in r.connections if c.topic == IMAGE_TOPIC)
        task = bag_task(topics)
        truth = MASK_TOPIC if task == "segmentation" else GT_TOPIC
        gt = truth in topics and DOMAIN_TOPIC in topics
        return BagInfo(Path(path), n, r.duration / 1e9, topics, gt, task)


def bag_task(topics: dict[str, str]) -> str:
    """segmentation when the bag has ground-truth masks, else classification."""
    return "segmentation" if MASK_TOPIC in topics else "classification"


def _ground_truth(reader: Reader, store: Typestore) -> tuple[dict, dict]:
    """stamp -> (label, class_name) (or, from a segmentation bag, the (H, W) uint8 mask)
    and stamp -> domain from the side topics."""
    labels: dict[int, tuple[int, str] | np.ndarray] = {}
    domains: dict[int, str] = {}
    conns = [c for c in reader.connections
             if c.topic in (GT_TOPIC, DOMAIN_TOPIC, MASK_TOPIC)]
    if not conns:  # rosbags reads every message when given no connection
        return labels, domains
    for conn, _, raw in reader.messages(connections=conns):
        msg = store.deserialize_cdr(raw, conn.msgtype)
        if conn.topic == GT_TOPIC:
            labels[stamp_ns(msg.header)] = (int(msg.label), str(msg.class_name))
        elif conn.topic == MASK_TOPIC:
            labels[stamp_ns(msg.header)] = mask_array(msg)
        elif conn.msgtype == LEGACY_DOMAIN_TYPE:
            domains[stamp_ns(msg)] = str(msg.frame_id)
        else:
            domains[stamp_ns(msg.header)] = str(msg.domain)
    return labels, domains


def read_bag(path: str | Path, require_ground_truth: bool = True) -> Iterator[BagFrame]:
    """Images of a bag in recorded order, each joined by stamp to its label and domain.

    A segmentation bag's frames carry their mask (BagFrame.mask). Raises
    FileNotFoundError for a missing bag, BagError for a damaged one, ValueError for a
    missing or mistyped topic and, when `require_ground_truth`, for an image without
    ground truth at its stamp.
    """
    store = tta_typestore()
    with _readable(path), _open(path) as reader:
        topics = _topics(reader)
        _check_topic(topics, IMAGE_TOPIC, IMAGE_TYPE, Path(path))
        segmentation = bag_task(topics) == "segmentation"
        if require_ground_truth:
            _check_topic(topics, *((MASK_TOPIC, IMAGE_TYPE) if segmentation else
                                   (GT_TOPIC, GT_TYPE)), Path(path))
            legacy = topics.get(DOMAIN_TOPIC) == LEGACY_DOMAIN_TYPE
            _check_topic(topics, DOMAIN_TOPIC, LEGACY_DOMAIN_TYPE if legacy else DOMAIN_TYPE,
                         Path(path))
        labels, domains = _ground_truth(reader, store)
        conns = [c for c in reader.connections if c.topic == IMAGE_TOPIC]
        for conn, _, raw in reader.messages(connections=conns):
            msg = store.deserialize_cdr(raw, conn.msgtype)
            t = stamp_ns(msg.header)
            if require_ground_truth and (t not in labels or t not in domains):
                raise ValueError(f"bag {path}: image at stamp {t} ns has no ground truth")
            truth = labels.get(t, (-1, ""))
            if isinstance(truth, np.ndarray):
                yield BagFrame(t, image_to_rgb8(msg), -1, domains.get(t, ""), mask=truth)
            else:
                yield BagFrame(t, image_to_rgb8(msg), truth[0], domains.get(t, ""), truth[1])


def mask_array(msg: object) -> np.ndarray:
    """A mono8 ground-truth mask message as an (H, W) uint8 array; ValueError otherwise."""
    h, w, step = int(msg.height), int(msg.width), int(msg.step)  # type: ignore[attr-defined]
    data = np.asarray(msg.data, dtype=np.uint8)  # type: ignore[attr-defined]
    if msg.encoding != "mono8" or step < w or data.size < h * step:  # type: ignore[attr-defined]
        raise ValueError(f"ground-truth mask is {msg.encoding} {h}x{w} step {step} with "  # type: ignore[attr-defined]
                         f"{data.size} bytes, not mono8 train ids")
    return data[: h * step].reshape(h, step)[:, :w].copy()
