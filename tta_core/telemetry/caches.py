"""CPU data cache sizes from sysfs: the buffer sizes of the bandwidth probe and of the
offline calibration (a buffer must fit in L2, or be much larger than the last level).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_L2 = 512 << 10
DEFAULT_LLC = 32 << 20


def cache_sizes() -> tuple[int, int]:
    """(L2, last-level) data cache sizes in bytes from sysfs; defaults 512 KiB / 32 MiB."""
    sizes: dict[int, int] = {}
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((idx / "level").read_text())
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            txt = (idx / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(txt[-1], 1)
            sizes[level] = int(txt.rstrip("KM")) * mult
        except (OSError, ValueError):
            continue
    return sizes.get(2, DEFAULT_L2), max(sizes.values(), default=DEFAULT_LLC)
