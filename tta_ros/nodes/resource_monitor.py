"""resource_monitor node: publishes `telemetry` (ResourceTelemetry) and `/diagnostics`.

All sampling is tta_core.telemetry's (psutil, sysfs thermal/cpufreq, NVML, jtop, perf);
this node only turns its ResourceSample into messages. With the `calibration` parameter (the
JSON written by `tta calibrate`) the sampler also fills pi_1 / pi_2 (compute / memory
expansion of the latency predictor) with tta_core.adashadow.expansion (`expansion_model`: "share" or
"paper"; `bandwidth_probe` feeds pi_2 where no LLC counters exist); without it they are NaN.
Unknown values stay NaN; the uint32 `competing_processes` field carries UNKNOWN_COUNT
(2**32 - 1) when the count is unknown.
/diagnostics carries one DiagnosticStatus per subsystem (cpu, memory, thermal, gpu, cache):
OK / WARN / ERROR against the thresholds below; a subsystem this machine has no source for
is OK with a message ("no GPU source", "no thermal zone", "no LLC counters"), and STALE only
when a source it had stopped updating (diagnostic aggregators read STALE that way); plus
"sources" and "expansion" (model, pi_2 source, reference; OK "no calibration" without one).
A managed (lifecycle) node (tta_ros.lifecycle): configure loads the calibration and opens
the samplers, it samples and publishes only while active, cleanup closes the samplers.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.context import Context
from rclpy.parameter import Parameter
from tta_msgs.msg import ResourceTelemetry

from tta_core.adashadow.calibration import Calibration, load_calibration
from tta_core.adashadow.expansion import MODELS, Expansion, ExpansionModel
from tta_core.telemetry import (
    BandwidthProbe,
    JtopSource,
    NvmlSource,
    PerfSource,
    PsutilSource,
    ResourceSample,
    SysfsSource,
    TelemetrySampler,
)
from tta_ros import ros_params
from tta_ros.diagnostics import (
    ERROR,
    HARDWARE_ID,
    OK,
    STALE,
    WARN,
    DiagnosticsPublisher,
    status,
)
from tta_ros.lifecycle import ManagedNode
from tta_ros.ros_params import ParamSpec, check_initial, declare_all, validate, values

UNKNOWN_COUNT = 2**32 - 1

PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("rate_hz", 10.0, "telemetry publish rate [Hz]", 0.1, 100.0, read_only=True),
    ParamSpec("diagnostics_rate_hz", 1.0, "/diagnostics publish rate [Hz]", 0.1, 10.0,
              read_only=True),
    ParamSpec("sysfs_root", "/sys", "root of the sysfs tree (a fake tree in tests)",
              read_only=True),
    ParamSpec("enable_perf", True, "read LLC hit rate from perf_event when permitted",
              read_only=True),
    ParamSpec("enable_nvml", True, "query NVML for a desktop GPU", read_only=True),
    ParamSpec("enable_jtop", True, "query jtop on a Jetson", read_only=True),
    ParamSpec("gpu_index", 0, "NVML GPU index", 0, 64, read_only=True),
    ParamSpec("process_scan_s", 2.0, "rescan the process table (competing processes) at most "
              "this often [s]; the scan dominates the node's CPU cost", 0.2, 60.0,
              read_only=True),
    ParamSpec("own_processes", "perception_node,scheduler_node", "comma-separated process "
              "names that are ours and never count as competitors (ROS launch runs each node "
              "in its own process; the monitor's own pid is always excluded)", read_only=True),
    ParamSpec("calibration", "", "predictor calibration JSON from `tta calibrate` (fills "
              "compute/memory expansion); empty = none, expansions are NaN", read_only=True),
    ParamSpec("expansion_model", "share", "runtime expansion model of pi1/pi2: share (round-"
              "robin sharing stretches compute and memory) or paper (AdaShadow's linear f(n))",
              choices=MODELS, read_only=True),
    ParamSpec("torch_threads", 0, "torch threads of the adapting (perception) process, the "
              "share model's T; 0 = the calibration's thread count (`tta calibrate --threads`)",
              0, 256, read_only=True),
    ParamSpec("bandwidth_probe", False, "measure DRAM copy bandwidth (at most every "
              "process_scan_s, two buffers of 4x the LLC, up to 2x256 MiB) for pi2 where no LLC "
              "counters exist; needs a calibration with probe_bw_offline_gbs", read_only=True),
    ParamSpec("frame_id", "", "header.frame_id of telemetry"),
    ParamSpec("cpu_warn_percent", 90.0, "mean CPU load above which cpu is WARN", 0.0, 100.0),
    ParamSpec("mem_warn_percent", 90.0, "memory use above which memory is WARN", 0.0, 100.0),
    ParamSpec("temp_warn_c", 80.0, "temperature above which thermal is WARN", 0.0, 150.0),
    ParamSpec("temp_error_c", 95.0, "temperature above which thermal is ERROR", 0.0, 150.0),
    ParamSpec("cache_warn_hit_rate", 0.5, "LLC hit rate below which cache is WARN", 0.0, 1.0),
    HARDWARE_ID,
)

_FIELDS = ("source", "cpu_percent", "gpu_percent", "cpu_temp_c", "gpu_temp_c", "cpu_freq_mhz",
           "cpu_freq_max_mhz", "gpu_freq_mhz", "gpu_freq_max_mhz", "cache_hit_rate",
           "mem_used_mb", "mem_total_mb", "gpu_mem_used_mb", "power_w", "compute_expansion",
           "memory_expansion")


def sample_to_msg(sample: ResourceSample) -> ResourceTelemetry:
    """ResourceSample -> ResourceTelemetry (stamp from the sample's wall-clock time)."""
    msg = ResourceTelemetry()
    for name in _FIELDS:
        value = getattr(sample, name)
        setattr(msg, name, value if name == "source" else float(value))
    msg.cpu_percent_per_core = [float(v) for v in sample.cpu_percent_per_core]
    n = sample.competing_processes
    msg.competing_processes = int(n) if math.isfinite(n) else UNKNOWN_COUNT
    sec = math.floor(sample.stamp)
    msg.header.stamp.sec = int(sec)
    msg.header.stamp.nanosec = int((sample.stamp - sec) * 1e9)
    return msg


def _status(name: str, level: int, message: str, vals: dict) -> DiagnosticStatus:
    return status(name, level, message,
                  {k: v if isinstance(v, str) else float(v) for k, v in vals.items()})


def _known(*xs: float) -> bool:
    return any(math.isfinite(x) for x in xs)


# subsystem -> what the status says when the machine has no source for it
ABSENT = {"cpu": "no CPU load source", "memory": "no memory source",
          "thermal": "no thermal zone", "gpu": "no GPU source", "cache": "no LLC counters"}


def _level(name: str, known: bool, seen: set[str], measured: int) -> tuple[int, str]:
    """(level, message) of a subsystem without a value: OK naming the absent source when it
    never had one, STALE when it had one that stopped updating. `measured`: its level
    when known (message '' then: the caller writes the reading)."""
    if known:
        seen.add(name)
        return measured, ""
    if name in seen:
        return STALE, f"{ABSENT[name].removeprefix('no ')} stopped updating"
    return OK, ABSENT[name]


def subsystem_statuses(s: ResourceSample, th: dict[str, float],
                       seen: set[str] | None = None) -> list[DiagnosticStatus]:
    """One status per subsystem: cpu, memory, thermal, gpu, cache. A subsystem without a
    value is OK with a message when the machine has no source for it, STALE when it had
    one (`seen`: the subsystems measured before, updated here) that stopped updating."""
    seen = set() if seen is None else seen
    out = []
    cpu = s.cpu_percent
    lvl, msg = _level("cpu", _known(cpu), seen,
                      WARN if _known(cpu) and cpu > th["cpu_warn_percent"] else OK)
    out.append(_status("cpu", lvl, msg or f"load {cpu:.0f} %", {
        "cpu_percent": cpu, "cores": float(len(s.cpu_percent_per_core)),
        "cpu_freq_mhz": s.cpu_freq_mhz, "cpu_freq_max_mhz": s.cpu_freq_max_mhz,
        "competing_processes": s.competing_processes, "compute_expansion": s.compute_expansion}))
    mem_pct = 100.0 * s.mem_used_mb / s.mem_total_mb if s.mem_total_mb > 0 else math.nan
    lvl, msg = _level("memory", _known(mem_pct), seen,
                      WARN if _known(mem_pct) and mem_pct > th["mem_warn_percent"] else OK)
    out.append(_status("memory", lvl, msg or f"{mem_pct:.0f} % used",
                       {"mem_used_mb": s.mem_used_mb, "mem_total_mb": s.mem_total_mb}))
    temps = [t for t in (s.cpu_temp_c, s.gpu_temp_c) if math.isfinite(t)]
    hot = max(temps) if temps else math.nan
    lvl, msg = _level("thermal", bool(temps), seen, ERROR if hot > th["temp_error_c"]
                      else WARN if hot > th["temp_warn_c"] else OK)
    out.append(_status("thermal", lvl, msg or f"max {hot:.1f} C",
                       {"cpu_temp_c": s.cpu_temp_c, "gpu_temp_c": s.gpu_temp_c}))
    gpu_known = _known(s.gpu_percent, s.gpu_freq_mhz, s.gpu_mem_used_mb, s.gpu_temp_c)
    lvl, msg = _level("gpu", gpu_known, seen, OK)
    out.append(_status("gpu", lvl, msg or "ok", {
        "gpu_percent": s.gpu_percent, "gpu_freq_mhz": s.gpu_freq_mhz,
        "gpu_freq_max_mhz": s.gpu_freq_max_mhz, "gpu_mem_used_mb": s.gpu_mem_used_mb,
        "power_w": s.power_w}))
    hit = s.cache_hit_rate
    lvl, msg = _level("cache", _known(hit), seen,
                      WARN if _known(hit) and hit < th["cache_warn_hit_rate"] else OK)
    out.append(_status("cache", lvl, msg or f"hit {hit:.2f}",
                       {"cache_hit_rate": hit, "memory_expansion": s.memory_expansion}))
    return out


def probe_note(enabled: bool, cal: Calibration | None) -> str:
    """Why an enabled bandwidth probe is not run ('' when it is run or not enabled)."""
    if not enabled:
        return ""
    if cal is None:
        return "bandwidth_probe ignored: no calibration (nothing to compare with)"
    if not math.isfinite(cal.probe_bw_offline_gbs):
        return ("bandwidth_probe ignored: the calibration has no probe_bw_offline_gbs "
                "(re-run `tta calibrate`)")
    return ""


def expansion_status(sampler: TelemetrySampler, note: str = "") -> DiagnosticStatus:
    """pi1/pi2 provenance: model, pi2 source, sharing factor and the offline reference.

    OK without a calibration (nothing to compute: an absent optional source, not a stale
    one), WARN on an expansion/probe error or an ignored probe.
    """
    model = sampler.expansion
    if not isinstance(model, ExpansionModel):  # None: the node had no calibration
        msg = "no calibration: pi1/pi2 not computed" + (f"; {note}" if note else "")
        return _status("expansion", WARN if note else OK, msg, {"model": "none"})
    errors = [f"{k}: {v}" for k, v in sampler.errors.items() if k in ("expansion", "probe")]
    ex = sampler.last_expansion if isinstance(sampler.last_expansion, Expansion) else None
    ref = model.reference
    vals: dict[str, float | str] = {
        "model": model.model, "threads": float(model.threads), "cores": float(model.cores),
        "pi2_source": ex.pi2_source if ex else "", "share": ex.share if ex else math.nan,
        "pi2_mem": ex.pi2_mem if ex else math.nan, "competing": ex.competing if ex else math.nan,
        "probe_bw_gbs": ex.probe_bw_gbs if ex else math.nan,
        "n_off": ref.competing if ref else math.nan,
        "probe_bw_offline_gbs": ref.probe_bw_gbs if ref else math.nan}
    msg = (f"{model.model}: pi1 {ex.pi1:.3f}, pi2 {ex.pi2:.3f} (pi2 from {ex.pi2_source})"
           if ex else f"{model.model}: no sample yet")
    problems = errors + ([note] if note else [])
    return _status("expansion", WARN if problems else OK, "; ".join([msg, *problems]), vals)


class ResourceMonitorNode(ManagedNode):
    """Samples resources at `rate_hz`; publishes telemetry and per-subsystem diagnostics."""

    def __init__(self, node_name: str = "resource_monitor", *, context: Context | None = None,
                 parameter_overrides: Sequence[Parameter] | None = None,
                 cli_args: Sequence[str] | None = None) -> None:
        self.sampler: TelemetrySampler | None = None
        super().__init__(node_name, context=context, parameter_overrides=parameter_overrides,
                         cli_args=list(cli_args) if cli_args else None,
                         automatically_declare_parameters_from_overrides=True)  # start_values
        declare_all(self, PARAMS)
        self.params = values(self, PARAMS)
        check_initial(PARAMS, self.params)
        ros_params.report_unknown(self)  # the other nodes' parameters unknown here: typos only
        self.add_on_set_parameters_callback(lambda ps: validate(PARAMS, ps))
        self.add_post_set_parameters_callback(
            lambda ps: self.params.update({p.name: p.value for p in ps}))

    def _configure(self) -> None:
        """Read the parameters, load the calibration, open the samplers (NVML, jtop,
        perf), create the publishers and the sampling and diagnostics timers."""
        self.params = values(self, PARAMS)
        self.calibration = self._calibration(self.params["calibration"])
        self.expansion = None if self.calibration is None else ExpansionModel(
            model=self.params["expansion_model"], calibration=self.calibration,
            threads=self.params["torch_threads"])
        self.probe_note = probe_note(self.params["bandwidth_probe"], self.calibration)
        probe = BandwidthProbe() if self.params["bandwidth_probe"] and not self.probe_note \
            else None
        self.sampler = TelemetrySampler(sources=self._sources(), expansion=self.expansion,
                                        probe=probe,
                                        probe_interval_s=self.params["process_scan_s"])
        self.last_sample: ResourceSample | None = None
        self.seen: set[str] = set()  # subsystems measured so far (STALE once they stop)
        self.samples_published = 0
        self.pub_telemetry = self.create_lifecycle_publisher(ResourceTelemetry, "telemetry", 10)
        self.diag = DiagnosticsPublisher(self)
        self.create_timer(1.0 / self.params["rate_hz"], self._on_sample)
        self.create_timer(1.0 / self.params["diagnostics_rate_hz"], self._on_diagnostics)

    def _cleanup(self) -> None:
        """Close the samplers (NVML, perf counters, jtop)."""
        if self.sampler is not None:
            self.sampler.close()
        self.sampler = self.last_sample = None

    @staticmethod
    def _calibration(path: str) -> Calibration | None:
        """load_calibration(path), None for ''; a bad file raises ValueError naming it."""
        if not path:
            return None
        try:
            return load_calibration(path)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"calibration={path!r} cannot be loaded: {exc}") from exc

    def _sources(self) -> list:
        p = self.params
        srcs: list = [PsutilSource(own_pids=(os.getpid(),), proc_interval_s=p["process_scan_s"],
                                   exclude_names=p["own_processes"].replace(" ", "").split(",")),
                      SysfsSource(p["sysfs_root"])]
        if p["enable_nvml"]:
            srcs.append(NvmlSource(p["gpu_index"]))
        if p["enable_jtop"]:
            srcs.append(JtopSource())
        if p["enable_perf"]:
            srcs.append(PerfSource(None))
        return srcs

    def _on_sample(self) -> None:
        sample = self.sampler.sample()
        self.last_sample = sample
        msg = sample_to_msg(sample)
        msg.header.frame_id = self.params["frame_id"]
        self.pub_telemetry.publish(msg)
        self.samples_published += 1

    def _on_diagnostics(self) -> None:
        if self.last_sample is None:
            return
        th = {k: self.params[k] for k in
              ("cpu_warn_percent", "mem_warn_percent", "temp_warn_c", "temp_error_c",
               "cache_warn_hit_rate")}
        self.diag.publish([*subsystem_statuses(self.last_sample, th, self.seen),
                           self._sources_status(),
                           expansion_status(self.sampler, self.probe_note)])

    def _sources_status(self) -> DiagnosticStatus:
        sts = self.sampler.describe()
        errors = [f"{s.name}: {s.last_error}" for s in sts if s.last_error]
        vals = {s.name: s.detail for s in sts}
        return _status("sources", WARN if errors else OK, "; ".join(errors) or
                       (self.last_sample.source if self.last_sample else ""), vals)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: `resource_monitor_node [--ros-args ...]`."""
    from tta_ros.bringup import node_main

    return node_main(ResourceMonitorNode, argv)


if __name__ == "__main__":
    sys.exit(main())
