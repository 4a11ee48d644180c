"""Length check of a serialized camera frame before rclpy deserializes it.

The C type support that deserializes sensor_msgs (rosidl_typesupport_fastrtps_c, generated
code) prints "sequence size exceeds remaining buffer" to stderr with fprintf for every
message whose sequence length runs past its bytes, before rclpy raises: one unthrottled
line per corrupted frame, which no logger setting reaches. So the perception node walks
the frame's CDR layout here first (XCDR1, what rmw_fastrtps and rmw_cyclonedds write for
these types: a 4-byte encapsulation header, then fields aligned to their size from the
start of the body; the low 2 bits of the header's options count padding bytes at the
end) and refuses, with a reason, a frame whose string or sequence lengths
do not fit its bytes. The same walk reads the fields of a frame whose lengths fit
(frame_fields: the pixel bytes as a view, so a 200 MB float frame is not copied into a
message first); only frames in another encapsulation reach the deserializer.
"""

from __future__ import annotations

#: encapsulation kinds walked here: CDR big endian, CDR little endian (others: not checked)
_CDR_KINDS = {b"\x00\x00": "big", b"\x00\x01": "little"}

#: per input kind, the fields after the std_msgs/Header (stamp, frame_id): "u32" (aligned
#: uint32), "u8", "str" (uint32 length incl. NUL, then the bytes), "seq" (uint32 count of
#: uint8, then the bytes)
LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "raw": (("height", "u32"), ("width", "u32"), ("encoding", "str"),
            ("is_bigendian", "u8"), ("step", "u32"), ("data", "seq")),
    "compressed": (("format", "str"), ("data", "seq")),
}
_HEADER = (("stamp.sec", "u32"), ("stamp.nanosec", "u32"), ("frame_id", "str"))


def frame_problem(data: bytes, kind: str) -> str:
    """'' when every length in the serialized `kind` frame ("raw": sensor_msgs/Image,
    "compressed": CompressedImage) fits its bytes (or the encapsulation is not plain CDR:
    left to the deserializer), else which field does not fit and by how much."""
    return _walk(data, kind)[0]


def frame_fields(data: bytes, kind: str) -> dict[str, int | memoryview] | None:
    """The fields of a serialized `kind` frame read from its bytes, without deserializing
    it: the integers as unsigned values, each string and sequence as a memoryview of
    `data` (no copy; a string with its NUL); None when the encapsulation is not plain CDR
    (left to the deserializer). ValueError (frame_problem's reason) when a length does
    not fit."""
    problem, fields = _walk(data, kind)
    if problem:
        raise ValueError(problem)
    return fields


def _walk(data: bytes, kind: str) -> tuple[str, dict[str, int | memoryview] | None]:
    """(what does not fit or '', the fields read; None when not plain CDR)."""
    if len(data) < 4:
        return f"no CDR encapsulation header ({len(data)} bytes)", None
    order = _CDR_KINDS.get(bytes(data[:2]))
    if order is None:
        return "", None
    body, pos, fields = memoryview(data)[4:], 0, {}
    n = len(body) - (data[3] & 0x3)  # options: the last 0-3 bytes are padding (Fast CDR)
    for name, field in (*_HEADER, *LAYOUTS[kind]):
        if field == "u8":
            if pos + 1 > n:
                return f"{name} cut off at byte {pos} of {n}", None
            fields[name] = body[pos]
            pos += 1
            continue
        pos += -pos % 4
        if pos + 4 > n:
            return f"{name} cut off at byte {pos} of {n}", None
        value = int.from_bytes(body[pos:pos + 4], order)
        pos += 4
        fields[name] = value
        if field in ("str", "seq"):
            if value > n - pos:
                return f"{name} declares {value} bytes, {n - pos} remain", None
            fields[name] = body[pos:pos + value]
            pos += value
    return "", fields
