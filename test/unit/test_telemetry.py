"""Telemetry sources on fabricated input (fake sysfs tree, recorded jtop dict) and live psutil
with busy processes started by the test; perf_event either measures or says why not."""

from __future__ import annotations

import errno
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tta_core.telemetry import (
    PerfSource,
    PsutilSource,
    ResourceSample,
    SysfsSource,
    TelemetrySampler,
    cache_hit_rate,
    competing_pids,
    merge_readings,
    parse_jtop,
)
from tta_core.telemetry.perf_source import (
    PERF_COUNT_SW_TASK_CLOCK,
    PERF_TYPE_SOFTWARE,
    PerfUnavailable,
    _paranoid,
    explain_errno,
    open_counter,
    read_counter,
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def fake_sys(tmp_path: Path) -> Path:
    zones = [("CPU-therm", 45500), ("GPU-therm", 41000), ("x86_pkg_temp", 52250),
             ("acpitz", 99000), ("gpu-thermal", 43500)]
    for i, (kind, milli_c) in enumerate(zones):
        _write(tmp_path / f"class/thermal/thermal_zone{i}/type", kind)
        _write(tmp_path / f"class/thermal/thermal_zone{i}/temp", str(milli_c))
    for i, (cur, mx) in enumerate([(1200000, 2201600), (1400000, 2201600),
                                   (1500000, 1907200), (1900000, 1907200)]):
        _write(tmp_path / f"devices/system/cpu/cpu{i}/cpufreq/scaling_cur_freq", str(cur))
        _write(tmp_path / f"devices/system/cpu/cpu{i}/cpufreq/cpuinfo_max_freq", str(mx))
    _write(tmp_path / "devices/system/cpu/cpufreq/policy0/scaling_cur_freq", "1")  # not a cpu
    _write(tmp_path / "class/devfreq/17000000.gv11b/cur_freq", "1300500000")
    _write(tmp_path / "class/devfreq/17000000.gv11b/max_freq", "1377000000")
    _write(tmp_path / "class/devfreq/3d00000.host1x/cur_freq", "408000000")
    return tmp_path


def test_sysfs_fake_tree_exact_values(fake_sys: Path) -> None:
    src = SysfsSource(fake_sys)
    got = src.read()
    assert got["cpu_temp_c"] == 52.25  # max of CPU-like zones; acpitz (99 C) is not a CPU
    assert got["gpu_temp_c"] == 43.5
    assert got["cpu_freq_mhz"] == pytest.approx((1200 + 1400 + 1500 + 1900) / 4)
    assert got["cpu_freq_max_mhz"] == pytest.approx(2201.6)
    assert got["gpu_freq_mhz"] == pytest.approx(1300.5)
    assert got["gpu_freq_max_mhz"] == pytest.approx(1377.0)
    assert src.describe().available
    # values are re-read on every sample (throttling shows up at once)
    _write(fake_sys / "devices/system/cpu/cpu3/cpufreq/scaling_cur_freq", "700000")
    _write(fake_sys / "class/thermal/thermal_zone2/temp", "60000")
    got = src.read()
    assert got["cpu_freq_mhz"] == pytest.approx((1200 + 1400 + 1500 + 700) / 4)
    assert got["cpu_temp_c"] == 60.0


def test_sysfs_missing_tree_is_nan_and_explained(tmp_path: Path) -> None:
    src = SysfsSource(tmp_path / "nothing")
    got = src.read()
    assert all(math.isnan(v) for v in got.values())
    st = src.describe()
    assert not st.available and st.detail.startswith("unavailable: ")
    sample = TelemetrySampler(sources=[src]).sample()
    assert sample.source == "" and math.isnan(sample.cpu_temp_c)


# A jtop 4.x `jetson.stats` dict as printed on a Jetson AGX Orin (values recorded by hand in
# the documented format), with the `jetson.cpu`, `jetson.gpu`, `jetson.memory` structures.
ORIN_STATS = {
    "time": "2024-05-02 10:11:12.123456", "uptime": "3 days, 2:01:00",
    "CPU1": 35, "CPU2": 12, "CPU3": 7, "CPU4": "OFF", "CPU5": 50, "CPU6": 10,
    "CPU7": "OFF", "CPU8": "OFF", "CPU9": 2, "CPU10": 4, "CPU11": 3, "CPU12": 1,
    "RAM": 0.2553, "SWAP": 0.0, "EMC": 7, "GPU": 61.7, "APE": "OFF", "NVDEC": "OFF",
    "NVENC": "OFF", "NVJPG": "OFF", "Fan pwmfan0": 23.5,
    "Temp CPU": 48.656, "Temp CV0": -256, "Temp GPU": 46.25, "Temp SOC0": 45.1,
    "Temp tj": 48.656, "Power CPU": 1202, "Power GPU": 3210, "Power TOT": 11236,
    "jetson_clocks": "OFF", "nvp model": "MAXN",
}
ORIN_CPU = {"total": {"user": 8.0, "nice": 0.0, "system": 2.0, "idle": 90.0},
            "cpu": [{"online": i not in (3, 6, 7), "governor": "schedutil",
                     "freq": {"min": 115200, "max": 2201600, "cur": 1000000 + 100000 * i},
                     "model": "ARMv8 Processor rev 1 (v8l)"} for i in range(12)]}
ORIN_GPU = {"ga10b": {"type": "integrated",
                      "status": {"railgate": False, "3d_scaling": True, "load": 61.7},
                      "freq": {"governor": "nvhost_podgov", "cur": 1300500, "max": 1300500,
                               "min": 306000}}}
ORIN_MEMORY = {"RAM": {"tot": 31_457_280, "used": 8_031_232, "free": 20_000_000,
                       "shared": 1_048_576, "buffers": 1000, "cached": 3_000_000}}


def test_jtop_recorded_stats_dict() -> None:
    got = parse_jtop(ORIN_STATS, cpu=ORIN_CPU, gpu=ORIN_GPU, memory=ORIN_MEMORY)
    per_core = got["cpu_percent_per_core"]
    assert len(per_core) == 12  # CPU10..12 sorted numerically, not as strings
    assert per_core[9] == 4 and per_core[0] == 35
    assert [math.isnan(v) for v in per_core] == [i in (3, 6, 7) for i in range(12)]
    assert got["cpu_percent"] == pytest.approx((35 + 12 + 7 + 50 + 10 + 2 + 4 + 3 + 1) / 9)
    assert got["gpu_percent"] == 61.7
    assert got["cpu_temp_c"] == 48.656 and got["gpu_temp_c"] == 46.25
    assert got["power_w"] == pytest.approx(11.236)
    online = [i for i in range(12) if i not in (3, 6, 7)]
    assert got["cpu_freq_mhz"] == pytest.approx(sum(1000 + 100 * i for i in online) / 9)
    assert got["cpu_freq_max_mhz"] == pytest.approx(2201.6)
    assert got["gpu_freq_mhz"] == pytest.approx(1300.5)
    assert got["mem_total_mb"] == pytest.approx(30720.0)
    assert got["mem_used_mb"] == pytest.approx(8_031_232 / 1024)
    assert got["gpu_mem_used_mb"] == pytest.approx(1024.0)


def test_jtop_stats_only_lowercase_sensors_and_offline() -> None:
    stats = {"CPU1": 20, "CPU2": "OFF", "GPU": 0.0, "RAM": 0.5, "Temp cpu": 51.5,
             "Temp gpu": -256, "Power TOT": 5000}
    got = parse_jtop(stats)
    assert got["cpu_temp_c"] == 51.5
    assert math.isnan(got["gpu_temp_c"])  # -256 = offline sensor
    assert got["gpu_percent"] == 0.0  # a real idle GPU is 0, not unknown
    assert math.isnan(got["cpu_freq_mhz"]) and math.isnan(got["mem_used_mb"])
    assert got["cpu_percent"] == 20.0
    with pytest.raises(ValueError, match="mapping"):
        parse_jtop([1, 2])  # type: ignore[arg-type]


def test_competing_rule_excludes_own_tree() -> None:
    shares = {10: 0.9, 11: 0.95, 12: 0.5, 20: 0.8, 21: 0.05, 30: 0.3}
    parents = {10: 1, 11: 10, 12: 11, 20: 1, 21: 20, 30: 20}
    assert competing_pids(shares, parents, own_pids={10}, threshold=0.2) == [20, 30]
    assert competing_pids(shares, parents, own_pids=set(), threshold=0.6) == [10, 11, 20]
    assert competing_pids(shares, parents, {10}, 0.2, exclude_children=False) == [11, 12, 20, 30]
    with pytest.raises(ValueError, match="threshold"):
        competing_pids(shares, parents, {10}, 0.0)


def _busy(n: int) -> list[subprocess.Popen]:
    code = "import time\nt=time.time()+30\nwhile time.time()<t: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


@pytest.mark.slow
def test_psutil_counts_busy_processes_then_drops_them() -> None:
    procs = _busy(2)
    try:
        time.sleep(0.2)
        src = PsutilSource(own_pids=(), proc_interval_s=0.5)
        mine = PsutilSource(own_pids=(os.getpid(),), proc_interval_s=0.5)
        bench = PsutilSource(own_pids=(os.getpid(),), proc_interval_s=0.5,
                             exclude_children=False)
        time.sleep(0.7)
        during = src.read()
        mine.read()
        bench.read()
        busy = {p.pid for p in procs}
        assert busy <= set(src.last_competing), (src.last_shares, busy)
        assert during["competing_processes"] >= 2
        assert not busy & set(mine.last_competing)  # our children never compete with us
        assert busy <= set(bench.last_competing) and os.getpid() not in bench.last_competing
        assert len(during["cpu_percent_per_core"]) == os.cpu_count()
        assert 0 < during["mem_used_mb"] < during["mem_total_mb"]
        before = set(src.last_competing)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    time.sleep(0.6)
    after = src.read()
    assert not busy & set(src.last_competing)
    survivors = set(src.last_competing) & before
    assert len(survivors) <= len(before) - 2
    assert after["competing_processes"] == len(src.last_competing)


def test_psutil_never_counts_processes_named_as_ours(tmp_path) -> None:
    code = "import time\nt=time.time()+30\nwhile time.time()<t: pass\n"
    scripts = [tmp_path / "perception_node", tmp_path / "mapping_node"]
    for path in scripts:
        path.write_text(code)
    procs = [subprocess.Popen([sys.executable, str(path)]) for path in scripts]
    try:
        time.sleep(0.2)
        src = PsutilSource(own_pids=(), proc_interval_s=0.5,
                           exclude_names=("perception_node", "scheduler_node"))
        time.sleep(0.7)
        src.read()
        ours, other = procs[0].pid, procs[1].pid
        assert other in src.last_competing, src.last_shares
        assert ours not in src.last_competing
        assert "perception_node" in src.describe().detail
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_cache_hit_rate_formula() -> None:
    assert cache_hit_rate(1000, 250) == 0.75
    assert cache_hit_rate(1000, 0) == 1.0
    assert cache_hit_rate(100, 130) == 0.0  # multiplexing skew is clipped
    assert math.isnan(cache_hit_rate(0, 0))
    with pytest.raises(ValueError):
        cache_hit_rate(-1, 0)


def test_perf_errno_reasons() -> None:
    r = explain_errno(errno.EACCES, "2")
    assert "perf_event_paranoid=2" in r and r.endswith("(EACCES)")
    assert explain_errno(errno.ENOENT, "2").endswith("(ENOENT)")


def test_perf_llc_rate_or_clear_reason() -> None:
    src = PerfSource(pid=os.getpid())
    try:
        st = src.describe()
        if st.available:
            buf = bytearray(64 << 20)
            for i in range(0, len(buf), 4096):
                buf[i] = 1
            rate = src.read()["cache_hit_rate"]
            # clipped to [0, 1] by construction: what can fail is no references counted (NaN)
            assert math.isfinite(rate), rate
        else:
            _assert_perf_refusal(st.detail)
            assert src.read() == {}
    finally:
        src.close()


# what perf_event_open(2) answers when it refuses the per-process LLC counters PerfSource
# opens: no PMU for the event (ENOENT, EOPNOTSUPP, ENODEV), perf_event_paranoid or a seccomp
# filter (EACCES, EPERM, ENOSYS), an event config the PMU rejects (EINVAL). Named as
# explain_errno names them (errno.errorcode: EOPNOTSUPP is "ENOTSUP" on Linux, same number)
_PERF_REFUSALS = tuple(errno.errorcode[e] for e in (
    errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV, errno.EACCES, errno.EPERM, errno.ENOSYS,
    errno.EINVAL))
_REFUSAL = re.compile(r"unavailable: (?P<why>.+) \((?P<name>" + "|".join(_PERF_REFUSALS)
                      + r")\)")


def _assert_perf_refusal(detail: str) -> None:
    """One of the refusals above, with the reason explain_errno gives for that errno."""
    m = _REFUSAL.fullmatch(detail)
    assert m, detail
    assert detail == "unavailable: " + explain_errno(getattr(errno, m["name"]), _paranoid())


@pytest.mark.parametrize("name", _PERF_REFUSALS)
def test_perf_refusal_reported_with_its_errno(name: str, monkeypatch) -> None:
    """The kernel's refusal, faked at the syscall: PerfSource reports the errno's reason."""
    import ctypes

    class _Libc:
        def syscall(self, *_args) -> int:
            return -1

    monkeypatch.setattr(ctypes, "CDLL", lambda *_a, **_k: _Libc())
    monkeypatch.setattr(ctypes, "get_errno", lambda: getattr(errno, name))
    src = PerfSource(pid=os.getpid())
    assert not src.describe().available and src.read() == {}
    _assert_perf_refusal(src.describe().detail)
    assert src.describe().detail.endswith(f"({name})")
    # any other errno is not what this source can be refused with here
    assert not _REFUSAL.fullmatch(src.describe().detail.replace(name, "EBUSY"))


def test_perf_syscall_plumbing_with_software_counter() -> None:
    """The ctypes attr layout is right if a task-clock counter sees our busy time."""
    try:
        fd = open_counter(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK, 0, -1)
    except PerfUnavailable as exc:
        pytest.skip(f"perf_event_open refused entirely here: {exc}")
    try:
        c0, t0, w0 = read_counter(fd), time.thread_time_ns(), time.perf_counter_ns()
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
        d_count, d_cpu = read_counter(fd) - c0, time.thread_time_ns() - t0
        d_wall = time.perf_counter_ns() - w0
        # task-clock ns: about our CPU time (VM steal makes it noisy), never above wall time
        assert 0.5 * d_cpu < d_count <= 1.05 * d_wall + 1e6, (d_count, d_cpu, d_wall)
    finally:
        os.close(fd)


class _Broken:
    name = "broken"

    def read(self) -> dict:
        raise OSError("sensor vanished")

    def describe(self):
        from tta_core.telemetry import SourceStatus
        return SourceStatus(self.name, True, "ok")

    def close(self) -> None:
        pass


def test_merge_priority_source_list_and_no_exception(fake_sys: Path) -> None:
    merged = merge_readings([("a", {"cpu_temp_c": float("nan"), "mem_used_mb": 5.0}),
                             ("b", {"cpu_temp_c": 40.0, "mem_used_mb": 7.0}),
                             ("c", {"gpu_temp_c": float("nan")})])
    assert (merged.source, merged.cpu_temp_c, merged.mem_used_mb) == ("a+b", 40.0, 5.0)
    assert math.isnan(merged.power_w)
    with pytest.raises(ValueError, match="bogus"):
        merge_readings([("a", {"bogus": 1.0})])
    sampler = TelemetrySampler(sources=[_Broken(), SysfsSource(fake_sys)])
    s = sampler.sample()
    assert isinstance(s, ResourceSample) and s.source == "sysfs" and s.cpu_temp_c == 52.25
    assert "sensor vanished" in sampler.describe()[0].last_error


def test_default_sampler_runs_here() -> None:
    with TelemetrySampler() as sampler:
        s = sampler.sample()
        names = {d.name for d in sampler.describe()}
    assert names == {"psutil", "sysfs", "nvml", "jtop", "perf"}
    assert s.source.split("+")[0] == "psutil"
    assert math.isfinite(s.cpu_percent) and math.isfinite(s.mem_total_mb)


class _Fixed:
    """A fabricated source reporting fixed readings (a device this machine does not have)."""

    name = "fixed"

    def __init__(self, values: dict) -> None:
        self.values = values

    def read(self) -> dict:
        return dict(self.values)

    def describe(self):
        from tta_core.telemetry import SourceStatus
        return SourceStatus(self.name, True, "ok")

    def close(self) -> None:
        pass


def test_sampler_fills_pi1_pi2_from_calibration() -> None:
    from tta_core.adashadow.expansion import ExpansionModel
    from tta_core.adashadow.predictor import Calibration

    cal = Calibration(f_slope=0.5, f_intercept=0.0, b_ratio=3.0, freq_offline_mhz=2000.0)
    src = _Fixed({"cpu_freq_mhz": 1000.0, "competing_processes": 2.0, "cache_hit_rate": 0.5})
    paper = ExpansionModel("paper", cal)
    s = TelemetrySampler(sources=[src], expansion=paper).sample()
    assert s.compute_expansion == pytest.approx(2000 / 1000 * (1 + 0.5 * 2))  # 4.0
    assert s.memory_expansion == pytest.approx(0.5 + 0.5 * 3.0)  # 2.0
    # share, 1 thread on 2 cores: s(2) = 3/2 scales the freq ratio 2 and the hit-rate pi2 2
    share = ExpansionModel("share", cal, threads=1, cores=2)
    sampler = TelemetrySampler(sources=[src], expansion=share)
    s = sampler.sample()
    assert (s.compute_expansion, s.memory_expansion) == (pytest.approx(3.0), pytest.approx(3.0))
    assert sampler.last_expansion.pi2_source == "perf" and sampler.last_expansion.share == 1.5
    # the default ("share") model on a calibration
    sampler = TelemetrySampler(sources=[src], expansion=ExpansionModel(calibration=cal))
    assert sampler.expansion.model == "share" and sampler.expansion.calibration is cal
    assert math.isfinite(sampler.sample().compute_expansion)
    s = TelemetrySampler(sources=[src]).sample()  # no calibration: unknown, not 1 or 0
    assert math.isnan(s.compute_expansion) and math.isnan(s.memory_expansion)
    # nothing measured: the offline times stand (factor 1), never NaN
    s = TelemetrySampler(sources=[_Fixed({})], expansion=share).sample()
    assert (s.compute_expansion, s.memory_expansion) == (1.0, 1.0)


class _Probe:
    """A fabricated BandwidthProbe: returns the next of the given bandwidths."""

    def __init__(self, *bws: float) -> None:
        self.bws, self.calls = list(bws), 0

    def measure(self) -> float:
        self.calls += 1
        bw = self.bws.pop(0)
        if isinstance(bw, Exception):
            raise bw
        return bw


def test_sampler_probe_feeds_pi2_only_without_hit_rate() -> None:
    from tta_core.adashadow.expansion import ExpansionModel
    from tta_core.adashadow.predictor import Calibration

    cal = Calibration(probe_bw_offline_gbs=30.0)
    model = ExpansionModel("share", cal, threads=2, cores=2)  # n = 0: s = 1, pi2 = b_off/b_now
    idle = _Fixed({"competing_processes": 0.0})
    probe = _Probe(10.0, 20.0, 5.0)
    sampler = TelemetrySampler(sources=[idle], expansion=model, probe=probe,
                               probe_interval_s=0.0, probe_window=2)
    assert sampler.sample().memory_expansion == pytest.approx(30 / 10)
    assert sampler.sample().memory_expansion == pytest.approx(30 / 15)  # mean of 10, 20
    assert sampler.last_expansion.pi2_source == "probe"
    assert sampler.last_expansion.probe_bw_gbs == 15.0
    assert sampler.sample().memory_expansion == pytest.approx(30 / 12.5)  # window: 20, 5
    # a measured hit rate wins: the probe is not even run
    hit = _Fixed({"competing_processes": 0.0, "cache_hit_rate": 0.9})
    probe = _Probe(10.0)
    sampler = TelemetrySampler(sources=[hit], expansion=model, probe=probe,
                               probe_interval_s=0.0)
    assert sampler.sample().memory_expansion == 1.0 and probe.calls == 0
    assert sampler.last_expansion.pi2_source == "perf"
    # rate limited (one run per interval), and a failing probe only falls back to pi2 = 1
    probe = _Probe(MemoryError("no room"), 10.0)
    sampler = TelemetrySampler(sources=[idle], expansion=model, probe=probe,
                               probe_interval_s=3600.0)
    s1, s2 = sampler.sample(), sampler.sample()
    assert (s1.memory_expansion, s2.memory_expansion, probe.calls) == (1.0, 1.0, 1)
    assert "MemoryError" in sampler.errors["probe"]
    with pytest.raises(ValueError, match="probe_window"):
        TelemetrySampler(sources=[idle], probe_window=0)


def test_bandwidth_probe_measures_a_positive_bandwidth() -> None:
    from tta_core.telemetry import BandwidthProbe, cache_sizes

    probe = BandwidthProbe(nbytes=4 << 20)
    assert probe.nbytes == 4 << 20
    bws = [probe.measure() for _ in range(3)]
    assert all(math.isfinite(b) and b > 0.1 for b in bws), bws
    l2, llc = cache_sizes()
    assert 0 < l2 <= llc
    with pytest.raises(ValueError, match="probe buffer"):
        BandwidthProbe(nbytes=1000)


def test_cache_sizes_read_the_data_caches_from_sysfs(tmp_path: Path, monkeypatch) -> None:
    """A fake cpu0 cache directory: L2 and the largest level's data cache, instruction
    caches and unreadable entries skipped; none at all gives the defaults."""
    from tta_core.telemetry import caches

    entries = {"index0": ("1", "Data", "48K"), "index1": ("1", "Instruction", "64K"),
               "index2": ("2", "Unified", "2048K"), "index3": ("3", "Unified", "32M"),
               "index4": ("4", "Instruction", "512M"), "index5": ("5", "Data", "big")}
    for name, (level, kind, size) in entries.items():
        (tmp_path / name).mkdir()
        for field, text in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / name / field).write_text(text + "\n")
    real = Path
    monkeypatch.setattr(caches, "Path", lambda p: tmp_path if "cache" in str(p) else real(p))
    assert caches.cache_sizes() == (2048 << 10, 32 << 20)
    monkeypatch.setattr(caches, "Path", lambda p: tmp_path / "none")
    assert caches.cache_sizes() == (caches.DEFAULT_L2, caches.DEFAULT_LLC)
