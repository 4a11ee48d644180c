"""keep_freed_memory: large buffers stop being mmapped (checked with glibc's own counters)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tta_core.runtime.malloc_tuning import keep_freed_memory

PROBE = """
import ctypes, sys
import numpy as np
class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MI2
if sys.argv[1] == "1":
    from tta_core.runtime.malloc_tuning import keep_freed_memory
    print(int(keep_freed_memory()))
else:
    print(-1)
a = np.ones(8 << 20)  # 64 MiB: above glibc's mmap threshold by default
print(libc.mallinfo2().hblkhd >> 20)
"""


def _mmapped_mib(tuned: bool, env: dict | None = None) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if tuned else "0"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc mallopt only")
def test_keep_freed_memory_serves_large_buffers_from_the_heap() -> None:
    import os

    assert _mmapped_mib(False)[1] >= 64  # the default: a fresh mmap per large buffer
    assert _mmapped_mib(True) == (1, 0)  # applied, and the buffer came from the heap
    off = _mmapped_mib(True, {**os.environ, "TTA_KEEP_FREED_MEMORY": "0"})
    assert off[0] == 0 and off[1] >= 64


def test_keep_freed_memory_rejects_a_bad_threshold() -> None:
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="threshold_bytes"):
            keep_freed_memory(bad)


RELEASE_PROBE = """
import ctypes
import numpy as np
from tta_core.runtime.malloc_tuning import keep_freed_memory, return_freed_memory
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20
keep_freed_memory()
a = np.ones(32 << 20)  # 256 MiB, from the heap (kept when freed)
before = rss_mib()
del a
kept = rss_mib()
print(before - kept, int(return_freed_memory()), kept - rss_mib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc_trim only")
def test_return_freed_memory_hands_kept_pages_back() -> None:
    """What keep_freed_memory keeps after a free (a node's model) goes back on request."""
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True,
                         text=True, check=True).stdout.split()
    dropped_on_free, returned, dropped_on_return = map(int, out)
    assert dropped_on_free < 64  # kept in the heap
    assert returned == 1 and dropped_on_return >= 192
