"""psutil source: CPU load per core, memory, and the number of competing processes.

Competing-process rule: a process competes when, over the last window of at least
`proc_interval_s` seconds, it used >= `share_threshold` of one core (user + system time /
wall time). The CPU share is used as the "runnable" test because a process's instantaneous
state flickers between R and S many times per window. Excluded: the pids in `own_pids`
(default: this process) and all their descendants, so our own workers never count
(`exclude_children=False` keeps only the pids themselves out: for a benchmark whose
deliberately started competitors must count). Processes named in `exclude_names` (their
comm, or the basename of an argument of their command line, e.g. "perception_node" when ROS
launch runs each node in its own process) are ours too and never count.
The process table is rescanned at most every `proc_interval_s`; in between the last count is
returned, which keeps a 10 Hz sampler cheap.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import psutil

from tta_core.telemetry.sample import NAN, SourceStatus


def descendants_of(roots: Collection[int], parents: Mapping[int, int]) -> set[int]:
    """All pids whose ancestor chain (via `parents`, pid -> ppid) reaches one of `roots`.

    The roots themselves are included. Cycles and missing parents end the walk.
    """
    roots = set(roots)
    out = set(roots)
    for pid in parents:
        chain: list[int] = []
        cur = pid
        while cur in parents and cur not in out and cur not in chain and len(chain) < 4096:
            chain.append(cur)
            cur = parents[cur]
        if cur in out:
            out.update(chain)
    return out


def competing_pids(
    shares: Mapping[int, float],
    parents: Mapping[int, int],
    own_pids: Collection[int],
    threshold: float,
    exclude_children: bool = True,
) -> list[int]:
    """Pids with CPU share (cores) >= threshold, excluding `own_pids` (and, by default,
    their descendants)."""
    if not threshold > 0:
        raise ValueError(f"share threshold must be > 0, got {threshold!r}")
    excluded = descendants_of(own_pids, parents) if exclude_children else set(own_pids)
    return sorted(p for p, s in shares.items() if s >= threshold and p not in excluded)


class PsutilSource:
    """CPU %, per-core %, memory and competing processes from psutil."""

    name = "psutil"

    def __init__(
        self,
        own_pids: Iterable[int] | None = None,
        share_threshold: float = 0.2,
        proc_interval_s: float = 1.0,
        exclude_children: bool = True,
        exclude_names: Iterable[str] = (),
    ) -> None:
        if not share_threshold > 0:
            raise ValueError(f"share_threshold must be > 0, got {share_threshold!r}")
        if not proc_interval_s > 0:
            raise ValueError(f"proc_interval_s must be > 0, got {proc_interval_s!r}")
        self.own_pids = frozenset(own_pids if own_pids is not None else (os.getpid(),))
        self.share_threshold = float(share_threshold)
        self.proc_interval_s = float(proc_interval_s)
        self.exclude_children = exclude_children
        self.exclude_names = frozenset(n for n in exclude_names if n)
        self.last_competing: list[int] = []
        self.last_shares: dict[int, float] = {}
        self._count = NAN
        self._error = ""
        psutil.cpu_percent(percpu=True)  # prime: the first interval=None call returns 0.0
        self._prev_t = time.monotonic()
        self._prev_times, _ = self._scan()

    @staticmethod
    def _scan() -> tuple[dict[int, float], dict[int, int]]:
        """CPU seconds and parent pid of every visible process (one stat read each)."""
        times: dict[int, float] = {}
        parents: dict[int, int] = {}
        for proc in psutil.process_iter():  # psutil caches the Process objects
            try:
                with proc.oneshot():
                    ct = proc.cpu_times()
                    parents[proc.pid] = proc.ppid()
                times[proc.pid] = ct.user + ct.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return times, parents

    def _refresh_competing(self, now: float) -> None:
        times, parents = self._scan()
        dt = now - self._prev_t
        shares = {
            pid: (t - self._prev_times[pid]) / dt
            for pid, t in times.items()
            if pid in self._prev_times
        }
        self.last_shares = shares
        competing = competing_pids(
            shares, parents, self.own_pids, self.share_threshold, self.exclude_children
        )
        self.last_competing = [p for p in competing if not self._named_ours(p)]
        self._count = float(len(self.last_competing))
        self._prev_t, self._prev_times = now, times

    def _named_ours(self, pid: int) -> bool:
        """True when the process's comm or a command-line basename is in exclude_names."""
        if not self.exclude_names:
            return False
        try:
            proc = psutil.Process(pid)
            names = {proc.name(), *(os.path.basename(a) for a in proc.cmdline())}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False
        return not names.isdisjoint(self.exclude_names)

    def read(self) -> dict[str, Any]:
        """Current values; competing_processes is NaN until the first full window."""
        per_core = [float(x) for x in psutil.cpu_percent(percpu=True)]
        mem = psutil.virtual_memory()
        now = time.monotonic()
        if now - self._prev_t >= self.proc_interval_s:
            self._refresh_competing(now)
        return {
            "cpu_percent": sum(per_core) / len(per_core) if per_core else NAN,
            "cpu_percent_per_core": per_core,
            "mem_used_mb": (mem.total - mem.available) / 2**20,
            "mem_total_mb": mem.total / 2**20,
            "competing_processes": self._count,
        }

    def describe(self) -> SourceStatus:
        return SourceStatus(
            self.name,
            True,
            f"ok: psutil {psutil.__version__}, competing = share >= "
            f"{self.share_threshold:g} core over >= {self.proc_interval_s:g} s, "
            f"excluding pids {sorted(self.own_pids)}"
            f"{' and descendants' if self.exclude_children else ''}"
            + (f" and processes named {', '.join(sorted(self.exclude_names))}"
               if self.exclude_names else ""),
            self._error,
        )

    def close(self) -> None:
        pass
