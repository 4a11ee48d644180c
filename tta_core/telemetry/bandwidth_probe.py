"""BandwidthProbe: DRAM copy bandwidth, the memory-contention signal where no PMU exists.

Where perf_event gives no LLC hit rate (a VM, a locked-down kernel), memory contention is
read as the drop of this probe's bandwidth relative to the same probe at calibration time:
pi2 = b_off / b_now (an expansion model, e.g. tta_core.adashadow.expansion). The probe
copies a buffer 4x the last-level cache (>= 32 MiB, <= 256 MiB; two such buffers are held)
in 1 MiB chunks, some 5-50 ms a call, so a monitor runs it at most every second or so.
"""

from __future__ import annotations

import time

import numpy as np

from tta_core.telemetry.caches import cache_sizes


class BandwidthProbe:
    """Copy bandwidth (GB/s) of a buffer 4x the LLC (>= 32 MiB), timed per 1 MiB chunk.

    Chunks slower than `outlier` x the median are dropped as preemptions (a descheduled
    probe is time-sharing, which pi1 models, not memory contention); the rest are averaged
    (total bytes / total time), so a competitor that thrashes memory only part of the time
    lowers the result in proportion, where a median would ignore it below 50 %.
    """

    CHUNK = 1 << 20

    def __init__(self, nbytes: int | None = None, outlier: float = 4.0) -> None:
        if nbytes is None:
            nbytes = min(max(4 * cache_sizes()[1], 32 << 20), 256 << 20)
        if nbytes < self.CHUNK:
            raise ValueError(f"probe buffer must be >= {self.CHUNK} bytes, got {nbytes}")
        if not outlier > 1:
            raise ValueError(f"outlier factor must be > 1, got {outlier}")
        self.src = np.ones(nbytes // 8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the pages in: the first measure is not special
        self.step = self.CHUNK // 8
        self.outlier = outlier

    @property
    def nbytes(self) -> int:
        """Size of the probed buffer in bytes."""
        return int(self.src.nbytes)

    def measure(self) -> float:
        """One pass over the buffer: copy bandwidth in GB/s (read + write bytes / s)."""
        times = []
        for i in range(0, self.src.size - self.step + 1, self.step):
            s, d = self.src[i:i + self.step], self.dst[i:i + self.step]
            t0 = time.perf_counter()
            np.copyto(d, s)
            times.append(time.perf_counter() - t0)
        arr = np.asarray(times)
        kept = arr[arr <= self.outlier * np.median(arr)]
        return float(2 * self.CHUNK * kept.size / max(kept.sum(), 1e-12) / 1e9)
