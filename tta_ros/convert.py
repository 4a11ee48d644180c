"""tta_core results <-> tta_msgs messages, shared by the nodes (no algorithm, no node)."""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from builtin_interfaces.msg import Time
from rclpy.node import Node
from rclpy.serialization import deserialize_message
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header
from tta_msgs.msg import AdaptationStatus, ClassPrediction, LayerImportance, LayerPlan

from tta_core.adashadow.planning import Plan, PlanOutcome
from tta_core.api import StepResult
from tta_core.io.image_msg import (
    FrameLimits,
    Preprocess,
    as_bytes,
    check_size,
    compressed_codec,
    decode_compressed,
    decode_image,
    jpeg_header,
    png_header,
    to_tensor,
)
from tta_ros.frame_cdr import LAYOUTS, frame_fields
from tta_ros.frame_reduce import reduced_compressed, reduced_image

#: a forward slower than this (ms) is not a measurement but a forged or broken message
MAX_FORWARD_MS = 1e5


def _short(value: object, limit: int = 40) -> str:
    """repr of `value`, cut to `limit` characters with its full length (untrusted text)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _finite_nonneg(name: str, values: object) -> np.ndarray:
    """`values` as float64, or ValueError naming the first that is not finite and >= 0."""
    arr = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        if arr.ndim == 0:
            raise ValueError(f"{name} = {float(arr)!r} is not finite and >= 0")
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{i}] = {arr[i]!r} is not finite and >= 0")
    return arr


def check_plan(msg: LayerPlan, model_name: str, unit_names: list[str],
               trainable: np.ndarray) -> Plan:
    """The Plan a LayerPlan describes, after checking it fits this model: model name, unit
    names and array lengths, finite non-negative numbers, a consistent first unit, and only
    trainable units selected. ValueError naming the first bad field otherwise."""
    n = len(unit_names)
    if msg.model_name != model_name:
        raise ValueError(f"model_name {_short(msg.model_name)} is not this model's "
                         f"{model_name!r}")
    if list(msg.unit_names) != unit_names:
        raise ValueError(f"unit_names ({len(msg.unit_names)}) do not match this model's "
                         f"{n} units")
    for field, allowed in (("update", (n,)), ("importance", (0, n)),
                           ("predicted_unit_ms", (0, n))):
        if len(getattr(msg, field)) not in allowed:
            raise ValueError(f"{field} has {len(getattr(msg, field))} entries for {n} units")
    for field in ("sigma", "budget_ms", "predicted_total_ms", "solve_ms", "importance",
                  "predicted_unit_ms"):
        _finite_nonneg(field, getattr(msg, field))
    update = np.asarray(msg.update, dtype=bool)
    first = int(np.argmax(update)) if update.any() else n
    if msg.first_updated_index != first:
        raise ValueError(f"first_updated_index {msg.first_updated_index} is not the first "
                         f"updated unit ({first})")
    bad = update & ~np.asarray(trainable, dtype=bool)
    if bad.any():
        raise ValueError(f"update selects units that are not trainable here: "
                         f"{[unit_names[i] for i in np.flatnonzero(bad)[:3]]}")
    return msg_to_plan(msg)


def check_importance(msg: LayerImportance, model_name: str, unit_names: list[str]
                     ) -> np.ndarray:
    """The importance array of a LayerImportance after checking it: this model, its units,
    finite non-negative importance, a plausible forward time, batch_size >= 1."""
    if msg.model_name != model_name:
        raise ValueError(f"model_name {_short(msg.model_name)} is not the card's "
                         f"{model_name!r}")
    if list(msg.unit_names) != unit_names or len(msg.importance) != len(unit_names):
        raise ValueError(f"importance has {len(msg.importance)} values for "
                         f"{len(msg.unit_names)} units that do not match the card's "
                         f"{len(unit_names)} units")
    if not (math.isfinite(msg.forward_ms) and 0 <= msg.forward_ms <= MAX_FORWARD_MS):
        raise ValueError(f"forward_ms = {msg.forward_ms!r} is not a time in [0, "
                         f"{MAX_FORWARD_MS:g}] ms")
    if msg.batch_size < 1:
        raise ValueError(f"batch_size = {msg.batch_size} is not >= 1")
    return _finite_nonneg("importance", msg.importance)


def msg_to_plan(msg: LayerPlan) -> Plan:
    """LayerPlan -> Plan (full_ms recovered from budget / sigma)."""
    update = np.asarray(msg.update, dtype=bool)
    full = msg.budget_ms / msg.sigma if msg.sigma > 0 else math.nan
    imp = np.nan_to_num(np.asarray(msg.importance, dtype=np.float64))
    return Plan(update=update, first_updated=int(msg.first_updated_index),
                        objective=float(imp[update].sum()) if imp.size == update.size else 0.0,
                        predicted_total_ms=float(msg.predicted_total_ms),
                        budget_ms=float(msg.budget_ms), full_ms=float(full),
                        solve_ms=float(msg.solve_ms))


def plan_to_msg(outcome: PlanOutcome, imp: LayerImportance, plan_id: int,
                sigma: float) -> LayerPlan:
    """A planning service's outcome -> the LayerPlan answering `imp`."""
    plan, unit_ms = outcome.plan, outcome.unit_ms
    msg = LayerPlan(plan_id=plan_id, based_on_batch_id=imp.batch_id, model_name=imp.model_name,
                    unit_names=list(imp.unit_names),
                    update=[bool(u) for u in plan.update],
                    importance=[float(a) for a in imp.importance],
                    predicted_unit_ms=[float(t) for t in unit_ms],
                    first_updated_index=int(plan.first_updated), sigma=float(sigma),
                    budget_ms=float(plan.budget_ms),
                    predicted_total_ms=float(plan.predicted_total_ms),
                    solve_ms=float(plan.solve_ms))
    msg.header = imp.header
    return msg


@dataclass(frozen=True)
class FrameInput:
    """One way camera frames come in: message type, topic suffix, decoders (whole, and
    reduced for a model of a given input side: tta_ros.frame_reduce)."""

    msg_type: type
    suffix: str  # appended to the resolved base topic (image_transport: image/compressed)
    decode: Callable[[Any, FrameLimits], np.ndarray]
    reduce: Callable[[Any, FrameLimits, int], np.ndarray]


#: the perception node's `input` parameter -> how its frames come in
FRAME_INPUTS = {"raw": FrameInput(Image, "", decode_image, reduced_image),
                "compressed": FrameInput(CompressedImage, "/compressed", decode_compressed,
                                         reduced_compressed)}


def frame_topic(node: Node, kind: str, base: str = "image") -> str:
    """The topic of `kind` frames: `base` resolved by `node` (namespace, remaps), plus the
    transport's suffix, as image_transport names them (remapping `image` moves both)."""
    return node.resolve_topic_name(base) + FRAME_INPUTS[kind].suffix


def peek_image_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a serialized sensor_msgs/Image read from its CDR bytes without
    deserializing it (a 2,000,000 x 1 frame is refused before 6 MB become a message), or
    None when the bytes are too short to say. Layout after the 4-byte encapsulation
    header: stamp (2 x 4 bytes), frame_id (uint32 length incl. NUL, chars, padding to 4),
    height, width (uint32, byte order from the encapsulation header)."""
    if len(data) < 16:
        return None
    order = "little" if data[1] == 1 else "big"
    body = memoryview(data)[4:]
    n = int.from_bytes(body[8:12], order)
    pos = 12 + n
    pos += -pos % 4
    if pos + 8 > len(body):
        return None
    return int.from_bytes(body[pos:pos + 4], order), int.from_bytes(body[pos + 4:pos + 8],
                                                                      order)


def _text(view: memoryview) -> str:
    """A CDR string as rclpy reads it: up to its first NUL, UTF-8 (bad bytes replaced)."""
    raw = bytes(view)
    return raw[:raw.index(0)].decode("utf-8", "replace") if 0 in raw else raw.decode(
        "utf-8", "replace")


def read_frame(data: bytes, kind: str) -> Any:
    """The message of one serialized frame of input `kind` with its pixel bytes a view of
    `data` (no copy): the fields read from the CDR bytes (tta_ros.frame_cdr) into an
    object with the message's fields and a std_msgs Header; rclpy's deserializer for an
    encapsulation other than plain CDR. ValueError in one line when it does not
    deserialize."""
    spec = FRAME_INPUTS[kind]
    try:
        fields = frame_fields(data, kind)
        if fields is None:
            return deserialize_message(data, spec.msg_type)
    except Exception as exc:
        why = exc if isinstance(exc, ValueError) else type(exc).__name__
        raise ValueError(f"{len(data)} bytes do not deserialize as "
                         f"{spec.msg_type.__name__} ({why})") from None
    sec = fields["stamp.sec"]
    header = Header(stamp=Time(sec=sec - (sec >> 31 << 32), nanosec=fields["stamp.nanosec"]),
                    frame_id=_text(fields["frame_id"]))
    values = {name: _text(fields[name]) if field == "str" else fields[name]
              for name, field in LAYOUTS[kind]}
    return SimpleNamespace(header=header, **values)


def decode_frame(data: bytes, kind: str, limits: FrameLimits, side: int | None = None
                 ) -> tuple[Any, np.ndarray]:
    """One serialized frame of input `kind` ("raw": sensor_msgs/Image, "compressed":
    sensor_msgs/CompressedImage) -> (message, HxWx3 RGB array); with `side`, the frame
    reduced for a model of that input side (tta_ros.frame_reduce: only the pixels that
    count are read). ValueError in one line when it does not deserialize or decode
    (tta_core.io.image_msg says why). A raw frame over the size limits is refused from
    its bytes, before anything is read, and so is a frame whose lengths do not fit its
    bytes (tta_ros.frame_cdr: the C deserializer would print a line to stderr for each);
    the others are read from their bytes without a copy (read_frame)."""
    spec = FRAME_INPUTS[kind]
    size = peek_image_size(data) if kind == "raw" else None
    if size is not None:
        check_size(*size, limits)
    msg = read_frame(data, kind)
    pix = spec.decode(msg, limits) if side is None else spec.reduce(msg, limits, side)
    return msg, pix


def frame_tensor(data: bytes, kind: str, limits: FrameLimits, pre: Preprocess
                 ) -> tuple[Header, torch.Tensor]:
    """One serialized frame -> (its header, 1x3xHxW model input): decode_frame reduced
    for the card's longer side, then to_tensor (a batch of these is to_tensor of the
    batch)."""
    msg, pix = decode_frame(data, kind, limits, pre.side)
    return msg.header, to_tensor([pix], pre)


def frame_input(data: bytes, kind: str, limits: FrameLimits, pre: Preprocess,
                keep_pixels: bool = False
                ) -> tuple[Header, torch.Tensor, tuple[int, int], np.ndarray | None]:
    """frame_tensor plus the frame's (height, width) and, with `keep_pixels`, its decoded
    RGB (reduced as for the model: what a segmentation overlay at the frame's size is
    blended on)."""
    msg, pix = decode_frame(data, kind, limits, pre.side)
    return msg.header, to_tensor([pix], pre), frame_size(msg, pix), pix if keep_pixels else None


def frame_size(msg: Any, pix: np.ndarray) -> tuple[int, int]:
    """A decoded frame's (height, width) as sent: a raw frame's fields, a compressed one's
    JPEG/PNG header (the decode may have been reduced)."""
    if hasattr(msg, "height"):
        return int(msg.height), int(msg.width)
    buf = as_bytes(msg.data)
    head = (png_header if compressed_codec(msg.format) == "png" else jpeg_header)(buf)
    return (head.height, head.width) if head is not None else tuple(pix.shape[:2])


def prediction_msgs(headers: list[Header], probs: np.ndarray, batch_id: int,
                    class_names: list[str], with_scores: bool) -> list[ClassPrediction]:
    """One ClassPrediction per image (header = the image's); label -1 and NaN confidence
    for a row that is not finite."""
    label, finite = probs.argmax(axis=1), np.isfinite(probs).all(axis=1)
    out = []
    for i, header in enumerate(headers):
        ok = bool(finite[i])
        lab = int(label[i]) if ok else -1
        pred = ClassPrediction(batch_id=batch_id, label=lab,
                               confidence=float(probs[i, lab]) if ok else math.nan,
                               class_name=class_names[lab] if 0 <= lab < len(class_names)
                               else "",
                               scores=probs[i].tolist() if with_scores else [])
        pred.header = header
        out.append(pred)
    return out


def peak_memory_mb(device: torch.device) -> float:
    """CUDA peak allocated on a GPU, else the process's peak RSS (MB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def status_msg(header: Header, batch_id: int, res: StepResult, *, method: str, mode: str,
               plan_id: int, reset: bool, frames_dropped: int,
               peak_mb: float, deadline_ms: float = math.nan) -> AdaptationStatus:
    """The AdaptationStatus of one batch (`deadline_ms`: its deadline, NaN in sigma*T mode)."""
    t = res.times
    msg = AdaptationStatus(
        batch_id=batch_id, method=method, mode=mode, adapted=bool(res.adapted),
        units_updated=int(res.units_updated), plan_id=plan_id,
        forward_ms=float(t.forward_ms), plan_ms=float(t.plan_ms),
        backward_ms=float(t.backward_ms), reforward_ms=float(t.reforward_ms),
        total_ms=float(t.total_ms), predicted_total_ms=float(res.predicted_total_ms),
        budget_ms=float(res.budget_ms), deadline_ms=float(deadline_ms), loss=float(res.loss),
        mean_entropy=float(res.mean_entropy), peak_memory_mb=float(peak_mb),
        frames_dropped=frames_dropped, reset=reset, domain=res.domain)
    msg.header = header
    return msg


def importance_msg(header: Header, batch_id: int, model_name: str, unit_names: list[str],
                   res: StepResult, batch_size: int) -> LayerImportance | None:
    """The LayerImportance of one batch, None when the method assesses no units."""
    imp = np.asarray(res.importance, dtype=np.float64)
    if imp.shape != (len(unit_names),):
        return None
    msg = LayerImportance(batch_id=batch_id, model_name=model_name, unit_names=unit_names,
                          importance=imp.tolist(), forward_ms=float(res.times.forward_ms),
                          batch_size=batch_size)
    msg.header = header
    return msg
