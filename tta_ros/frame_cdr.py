"""Length check of a serialized camera frame before rclpy deserializes it.

The C type support that deserializes sensor_msgs (rosidl_typesupport_fastrtps_c, generated
code) prints "sequence size exceeds remaining buffer" to stderr with fprintf for every
message whose sequence length runs past its bytes, before rclpy raises: one unthrottled
line per corrupted frame, which no logger setting reaches. So the perception node walks
the frame's CDR layout here first (XCDR1, what rmw_fastrtps and rmw_cyclonedds write for
these types: a 4-byte encapsulation header, then fields aligned to their size from the
start of the body; the low 2 bits of the header's options count padding bytes at the
end) and refuses, with a reason, a frame whose string or sequence lengths
do not fit its bytes; only frames whose lengths fit reach the deserializer.
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
    if len(data) < 4:
        return f"no CDR encapsulation header ({len(data)} bytes)"
    order = _CDR_KINDS.get(bytes(data[:2]))
    if order is None:
        return ""
    body, pos = memoryview(data)[4:], 0
    n = len(body) - (data[3] & 0x3)  # options: the last 0-3 bytes are padding (Fast CDR)
    for name, field in (*_HEADER, *LAYOUTS[kind]):
        if field == "u8":
            if pos + 1 > n:
                return f"{name} cut off at byte {pos} of {n}"
            pos += 1
            continue
        pos += -pos % 4
        if pos + 4 > n:
            return f"{name} cut off at byte {pos} of {n}"
        value = int.from_bytes(body[pos:pos + 4], order)
        pos += 4
        if field in ("str", "seq"):
            if value > n - pos:
                return f"{name} declares {value} bytes, {n - pos} remain"
            pos += value
    return ""
