"""Several cameras, one computer, over DDS (issue #22, #31): three fleet planners, measured.

benchmarks/field/bench_fleet.py simulates the processor sharing; here it is real. For N = 2 and
N = 4 cameras (bench_fleet.CAMERAS: rates, domains) the script starts, each in its own OS
process (so they really share the machine's cores):

- N perception nodes `/cam1/perception` .. `/camN/perception` (method `elastic` on the
  gated card, retraining (`--lr`, 0: serve only) with `--retrain-steps` per retraining
  (their fleet reports' T); one torch thread each; `deadline_mode: camera`;
  batch_timeout_s = the camera's batch fill time, as
  tta_core.eval.bench_stream.stream_batch_wait_ms);
- one scheduler `/fleet_scheduler` in fleet mode over those namespaces, `fleet_t_max_s`
  = `--t-max`;

and in this process one publisher per camera (its own domain and rate, frames stamped
with `w<window>:<index>` in header.frame_id) and the consumer of every camera's
predictions (receive time on this process's monotonic clock, the publishers' clock).

Phases. Warm-up: frames flow at every rate with an unlimited capacity (every camera at
its full size) until every node reports a forward time and an accuracy estimate per size
in its fleet report (with `--lr` > 0 and past domains, T, A and Ã too) (tta_msgs/FleetReport;
one camera at a time: each node times its
sizes at its first full batch, which on a machine busy with the other cameras gave
non-monotone times), then
`--warm` seconds of every camera. Capacity: from those reports (the loads the nodes
themselves predict, averaged over the `--warm` seconds), `--capacity` x the least
capacity at which the equal split is feasible (N x the largest load of one camera at its
smallest size), as bench_fleet: the
split must shrink the fast camera, the plan can move the slow cameras' slack to it. It
is fixed for every round. Rounds: the arms alternate (paper, confidence, equal_split,
paper, ...; `--rounds` each), switched by setting the scheduler's `fleet_policy` /
`fleet_objective` at run time (the perception processes stay up): `paper` plans Eq. 8-11
with the T, A, Ã the nodes report (A, Ã: Eq. 5-7 on the calibration file's past domains,
bench_fleet.past_domains; the scheduler falls back to confidence while a report lacks
them, and the JSON records which objective each window was planned with), `confidence`
the sum of the proxies, `equal_split` 1/N each; each round streams `--settle` seconds
(not scored: the plan settles, sizes are applied), then the scored window of `--seconds`
(the SAME frames of each camera in every round), then a tail of frames until the last
window frame's deadline has passed (the load stays on). Scoring:
tta_core.eval.streaming.score_batches (the rule of the simulated benchmarks: frame i
arrives at i / hz, deadline arrival + (2b - 1) / hz; strict: its own answer by then;
streaming: the newest answer for a frame <= i available by then; never answered =
wrong). Sizes: the perception nodes' `served` (the size their last batch ran at, from
their fleet reports) and the scheduler's choice (its fleet status on /diagnostics),
sampled during each window. CPU: each perception process's CPU seconds per second in the
window. `--seeds`: one fleet start per seed and N (the cameras' streams; the same frames
for every arm).

Retraining: the nodes adapt (elastic: IM loss on the selected filters) on every batch
whose forward and update fit its deadline, whatever the arm; the plan's retraining share
(Eq. 10) is not a share of the processor here (the OS shares the cores between the
processes): the arms differ in the sizes they choose, which is what is measured.

    python benchmarks/field/bench_fleet_dds.py --cameras '' --out runs/fleet_dds/cal/result.json
    timeout 700 python benchmarks/field/bench_fleet_dds.py --cameras 2 --seeds 0,1 \\
        --calibration runs/fleet_dds/cal/fleet_calibration.json --results docs/results/fleet_dds

Without `--calibration` the confidence -> accuracy calibration and the past domains are
fitted first, as bench_fleet does (bench_fleet.offline; written next to the JSON);
`--calibration ''` uses the confidence itself and no past domains (the paper arm then
plans with confidence). Output: a table per N, JSON (and a PNG when matplotlib is there)
under runs/bench_fleet_dds/, and with `--results` the results page.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from tta_core.eval.bench_stream import stream_batch_wait_ms
from tta_core.eval.streaming import StreamBatch, StreamResult, score_batches

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness  # noqa: E402
from bench_fleet import CAMERAS, camera_stream, offline, write_calibration  # noqa: E402
from fleet_dds_driver import SCHEDULER, Driver  # noqa: E402

GATED = ROOT / "checkpoints" / "small_resnet_signs32_elastic.json"
PLAIN = ROOT / "checkpoints" / "small_resnet_signs32.json"  # the scheduler's own model card
ARMS = ("paper", "confidence", "equal_split")
ARM_PARAMS = {"paper": {"fleet_policy": "plan", "fleet_objective": "paper"},
              "confidence": {"fleet_policy": "plan", "fleet_objective": "confidence"},
              "equal_split": {"fleet_policy": "equal_split"}}


@dataclass
class Cam:
    """One camera: namespace, rate, domain, its settle frames and its scored window."""

    ns: str
    name: str
    hz: float
    domain: str
    settle: np.ndarray  # (S, H, W, 3) uint8, cycled outside the windows
    window: np.ndarray  # (M, H, W, 3) uint8, the same frames in every window
    labels: np.ndarray  # (M,)


@dataclass
class Round:
    """One arm's scored window: per camera the streaming result and what was sampled."""

    arm: str
    index: int
    results: dict[str, StreamResult]
    served: dict[str, list[float]]
    chosen: dict[str, list[float]]
    forward: dict[str, list[list[float]]]  # the node's predicted forward per size, sampled
    cpu: dict[str, float]
    late_ms: float  # the publishers' 99th-percentile lateness behind their schedule
    sent: dict[str, int] = field(default_factory=dict)
    objective: list[str] = field(default_factory=list)  # what each plan maximised


def cameras(card, n: int, args: argparse.Namespace) -> list[Cam]:
    """bench_fleet's N cameras at `--rate-scale` x their rates, each with its own stream
    (seed + camera index, as bench_fleet): `--prefix` settle frames, then the window."""
    out = []
    for i, c in enumerate(CAMERAS[n]):
        hz = c.hz * args.rate_scale
        m = round(hz * args.seconds)
        s = camera_stream(card, c.corruption, c.severity, args.prefix + m, args.track,
                          args.seed + i)
        out.append(Cam(f"/cam{i + 1}", c.name, hz, f"{c.corruption}/{c.severity}",
                       s.images[:args.prefix], s.images[args.prefix:],
                       np.asarray(s.labels[args.prefix:])))
    return out


def params_file(path: Path, cams: list[Cam], args: argparse.Namespace, cal: str) -> Path:
    """The ROS params file of the N perception nodes and the scheduler."""
    doc = {}
    for c in cams:
        doc[f"{c.ns}/perception"] = {"ros__parameters": {
            "model_card": str(GATED), "method": "elastic", "method.lr": args.lr,
            "batch_size": args.batch, "num_threads": 1, "queue_size": 32,
            "batch_timeout_s": stream_batch_wait_ms(c.hz, args.batch) / 1000.0,
            "method.camera_hz": c.hz, "method.deadline_mode": "camera",
            "plan_source": "inline", "reset_patience": 100000, "fleet_calibration": cal,
            "method.warmup_runs": args.warmup_runs,
            "method.retrain_steps": args.retrain_steps}}
    doc[SCHEDULER] = {"ros__parameters": {
        "model_card": str(PLAIN), "fleet_namespaces": [c.ns for c in cams],
        "fleet_capacity": 1024.0, "fleet_period_s": args.period, "fleet_policy": "plan",
        "fleet_t_max_s": args.t_max}}
    path.write_text(yaml.safe_dump(doc))
    return path


def _die_with_parent() -> None:
    """Child side of Popen: SIGTERM when the benchmark dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@contextmanager
def processes(cams: list[Cam], params: Path, env: dict, logs: Path) -> Iterator[dict]:
    """Start the N perception processes and the scheduler (each its own process group);
    on exit (normal, error, Ctrl-C, SIGTERM) stop every group: SIGINT (the nodes shut
    down cleanly), SIGKILL after 10 s."""
    specs = {c.ns: ("tta_ros.nodes.perception", ["-r", f"__ns:={c.ns}"]) for c in cams}
    specs[SCHEDULER] = ("tta_ros.nodes.scheduler", ["-r", f"__node:={SCHEDULER[1:]}"])
    procs: dict[str, subprocess.Popen] = {}
    try:
        for key, (module, remaps) in specs.items():
            log = open(logs / f"{key.strip('/').replace('/', '_')}.log", "w")
            procs[key] = subprocess.Popen(
                [sys.executable, "-m", module, "--ros-args", *remaps, "--params-file",
                 str(params)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
            log.close()
        yield procs
    finally:
        stop_all(procs)


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGINT to every live process group, then SIGKILL whatever is left after 10 s."""
    for p in procs.values():
        if p.poll() is None:
            _killpg(p, signal.SIGINT)
    end = time.monotonic() + 10.0
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(p, signal.SIGKILL)
            p.wait(timeout=5.0)


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def check_alive(procs: dict[str, subprocess.Popen], logs: Path) -> None:
    """RuntimeError naming a node process that exited, with its log's last line."""
    for key, p in procs.items():
        if p.poll() is not None:
            log = logs / f"{key.strip('/').replace('/', '_')}.log"
            tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
            raise RuntimeError(f"{key} exited with {p.returncode}: {' '.join(tail)}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (/proc; 0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def to_batches(rows: list[tuple[int, float, int, int]], steps: dict[int, float]
               ) -> list[StreamBatch]:
    """Received answers (frame, ms since frame 0's arrival, label, node batch id) as the
    node's batches: a batch's answers are available when its last one arrived; its start
    is that minus the step time the node reported (AdaptationStatus total_ms), if known."""
    by_batch: dict[int, list[tuple[int, float, int]]] = defaultdict(list)
    for f, ms, label, bid in rows:
        by_batch[bid].append((f, ms, label))
    out = []
    for bid, got in sorted(by_batch.items(), key=lambda kv: max(r[1] for r in kv[1])):
        got.sort()
        end = max(r[1] for r in got)
        out.append(StreamBatch(len(out), tuple(r[0] for r in got),
                               end - steps.get(bid, 0.0), end, tuple(r[2] for r in got)))
    return out


def run_round(drv: Driver, procs: dict, cams: list[Cam], arm: str, index: int,
              args: argparse.Namespace) -> Round:
    """One arm's round: policy, settle, scored window, tail; scored per camera."""
    drv.set_scheduler(**ARM_PARAMS[arm])
    drv.stream(cams, args.settle, None)
    pids = {**{key: p.pid for key, p in procs.items()}, "driver": os.getpid()}
    cpu0, clock = {ns: cpu_seconds(pid) for ns, pid in pids.items()}, harness.Stopwatch()
    clock.start()
    drv.recording = index
    t0, late = drv.stream(cams, args.seconds, index)
    drv.recording = None
    wall = clock.lap_s()
    cpu = {ns: (cpu_seconds(pid) - cpu0[ns]) / wall for ns, pid in pids.items()}
    tail = max((2 * args.batch - 1) / c.hz for c in cams) + 0.5
    drv.stream(cams, tail, None)
    results = {}
    for c in cams:
        rows = [(f, (t - t0) * 1e3, lab, bid) for f, t, lab, bid in drv.answers[c.ns, index]]
        results[c.ns] = score_batches(c.labels.tolist(), c.hz,
                                      to_batches(rows, drv.steps[c.ns]), args.batch)
    return Round(arm, index, results, {c.ns: drv.served[c.ns, index] for c in cams},
                 {c.ns: drv.chosen[c.ns, index] for c in cams},
                 {c.ns: drv.forward[c.ns, index] for c in cams}, cpu,
                 float(np.percentile(late, 99)) if late else 0.0,
                 {c.ns: len(c.window) for c in cams}, list(drv.objective[index]))


def mean_apps(drv: Driver, cams: list[Cam], seconds: float, paper: bool) -> tuple:
    """Every camera streaming for `seconds`: the nodes' reports sampled once a second,
    each size's forward time averaged (one report is a snapshot of a load EMA that
    moves by ~10-20 % between batches on a shared machine). (confidence apps, paper apps
    or None); the other values are the last report's."""
    from dataclasses import replace

    snaps = []
    for _ in range(max(1, round(seconds))):
        drv.stream(cams, 1.0, None)
        if (apps := drv.apps(cams)) is None:
            raise RuntimeError(f"a fleet report went missing: {drv.waiting}")
        snaps.append(apps)
    fwd = [[float(np.mean([s[i].options[j].forward_ms for s in snaps]))
            for j in range(len(a.options))] for i, a in enumerate(snaps[-1])]

    def averaged(apps: list | None) -> list | None:
        return None if apps is None else [replace(a, options=[
            replace(o, forward_ms=fwd[i][j]) for j, o in enumerate(a.options)])
            for i, a in enumerate(apps)]
    return averaged(snaps[-1]), averaged(drv.apps(cams, paper=True) if paper else None)


def choose_capacity(drv: Driver, cams: list[Cam], args: argparse.Namespace,
                    paper: bool) -> dict:
    """Warm up at an unlimited capacity until every node reports (`paper`: with the
    paper objective's T, A, Ã too), then the capacity (module docstring) from the loads
    the nodes predict; set on the scheduler."""
    from tta_core.elasticdnn.fleet import Objective, equal_split, plan_fleet

    drv.set_scheduler(fleet_policy="plan", fleet_capacity=1024.0)
    end = time.monotonic() + (args.ready_timeout or math.inf)
    for c in cams:  # one camera at a time: each node times its sizes on a quiet machine
        while drv.apps([c]) is None or (paper and drv.apps([c], paper=True) is None):
            if time.monotonic() > end:  # drv.stream raises when a node process exited
                raise RuntimeError(f"no fleet report from every node within "
                                   f"{args.ready_timeout:g} s: {drv.waiting}")
            drv.stream([c], 0.5, None)
        print(f"N={len(cams)} {c.ns} reports", file=sys.stderr, flush=True)
    apps, paper_apps = mean_apps(drv, cams, args.warm, paper)
    split_min = len(apps) * max(a.load(min(a.options, key=lambda o: o.keep)) for a in apps)
    capacity = args.fixed_capacity or args.capacity * split_min
    drv.set_scheduler(fleet_capacity=capacity)
    return {"capacity": capacity, "split_min": split_min,
            "full_load": sum(a.load(max(a.options, key=lambda o: o.keep)) for a in apps),
            "apps": {a.name: {"hz": a.hz, "deadline_ms": a.deadline_ms,
                              "options": [vars(o) for o in a.options]} for a in apps},
            "paper_apps": None if paper_apps is None else {
                a.name: [vars(o) for o in a.options] for a in paper_apps},
            "offline": {"paper": None if paper_apps is None else dict(plan_fleet(
                paper_apps, capacity, Objective("paper", args.t_max))),
                "confidence": dict(plan_fleet(apps, capacity)),
                "equal_split": dict(equal_split(apps, capacity))}}


def _mode(values: list[float]) -> float:
    return Counter(values).most_common(1)[0][0] if values else math.nan


def _spread(reports: list[list[float]]) -> dict[str, list[float]]:
    """Per size (largest first): mean and coefficient of variation of the forward times
    a node reported during the windows (what the scheduler planned with)."""
    if not reports:
        return {"mean": [], "cv": []}
    a = np.asarray(reports, dtype=float)
    mean = a.mean(axis=0)
    return {"mean": [round(float(v), 3) for v in mean],
            "cv": [round(float(v), 3) for v in a.std(axis=0) / mean]}


def summarise(rounds: list[Round], cams: list[Cam]) -> dict:
    """Per arm: per camera (mean over its rounds) and the mean over cameras."""
    out: dict[str, dict] = {}
    for arm in ARMS:
        mine = [r for r in rounds if r.arm == arm]
        per = {}
        for c in cams:
            s = [r.results[c.ns].summary for r in mine]
            served = [v for r in mine for v in r.served[c.ns]]
            chosen = [v for r in mine for v in r.chosen[c.ns]]
            per[c.ns] = {
                "camera": c.name, "hz": c.hz, "domain": c.domain,
                "streaming": float(np.mean([x.streaming for x in s])),
                "strict": float(np.mean([x.strict for x in s])),
                "answered": float(np.mean([x.answered for x in s])),
                "dropped": float(np.mean([x.dropped for x in s])),
                "per_round_streaming": [x.streaming for x in s],
                "served": _mode(served), "chosen": _mode(chosen),
                "served_agrees": (sum(v == _mode(chosen) for v in served) / len(served)
                                  if served else math.nan),
                "cpu": float(np.mean([r.cpu[c.ns] for r in mine])),
                "forward_ms_reported": _spread([f for r in mine for f in r.forward[c.ns]])}
        out[arm] = {"cameras": per, "rounds": len(mine),
                    "objective": dict(Counter(o for r in mine for o in r.objective)),
                    "mean_streaming": float(np.mean([p["streaming"] for p in per.values()])),
                    "mean_strict": float(np.mean([p["strict"] for p in per.values()])),
                    "late_ms_p99": max(r.late_ms for r in mine),
                    "cpu_total": float(np.mean([sum(r.cpu.values()) for r in mine])),
                    "cpu_driver": float(np.mean([r.cpu["driver"] for r in mine]))}
    return out


def table(n: int, summary: dict, cap: dict) -> str:
    """Markdown table of one scenario."""
    lines = [f"\nN = {n}: capacity {cap['capacity']:.4g} (split feasible from "
             f"{cap['split_min']:.4g}; all full size {cap['full_load']:.4g}), "
             "offline " + ", ".join(f"{k} {v}" for k, v in cap["offline"].items()),
             "| arm | camera | size chosen / served (agree) | streaming % | strict % | "
             "answered in time % | dropped % | cpu |", "|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        for ns, p in s["cameras"].items():
            lines.append(f"| {arm} | {ns} {p['camera']} {p['hz']:g} Hz {p['domain']} | "
                         f"{p['chosen']:g} / {p['served']:g} ({100 * p['served_agrees']:.0f}%)"
                         f" | {100 * p['streaming']:.1f} | {100 * p['strict']:.1f} | "
                         f"{100 * p['answered']:.1f} | {100 * p['dropped']:.1f} | "
                         f"{p['cpu']:.2f} |")
        used = "/".join(f"{k} {v}" for k, v in s["objective"].items())
        lines.append(f"| **{arm}** | mean | {used} | **{100 * s['mean_streaming']:.1f}** | "
                     f"{100 * s['mean_strict']:.1f} | | | all {s['cpu_total']:.2f} "
                     f"(driver {s['cpu_driver']:.2f}) |")
    return "\n".join(lines)


def scenario(n: int, card, args: argparse.Namespace, cal: str, run_dir: Path) -> dict:
    """Start the fleet of N, choose the capacity, run the alternating rounds, stop it."""
    cams = cameras(card, n, args)
    logs = run_dir / f"logs_n{n}"
    logs.mkdir(parents=True, exist_ok=True)
    domain = random.SystemRandom().randint(101, 232)
    env = {**os.environ, "ROS_DOMAIN_ID": str(domain), "OMP_NUM_THREADS": "1",
           "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    params = params_file(logs / "params.yaml", cams, args, cal)
    load0 = os.getloadavg()[0]
    with processes(cams, params, env, logs) as procs, Driver(domain, cams) as drv:
        drv.alive = lambda: check_alive(procs, logs)
        cap = choose_capacity(drv, cams, args, args.lr > 0 and has_past(cal))
        rounds = []
        for r in range(args.rounds):
            for arm in ARMS:
                with harness.Stopwatch() as sw:
                    rounds.append(run_round(drv, procs, cams, arm, len(rounds), args))
                res = rounds[-1].results
                print(f"N={n} seed {args.seed} round {r + 1}/{args.rounds} {arm:11s} "
                      f"{sw.s:5.1f} s: streaming " + " ".join(
                          f"{ns} {100 * x.summary.streaming:.1f}%" for ns, x in res.items()),
                      file=sys.stderr, flush=True)
        pids = [p.pid for p in procs.values()]
    summary = summarise(rounds, cams)
    print(table(n, summary, cap), flush=True)
    return {"seed": args.seed,
            "cameras": [{"ns": c.ns, "name": c.name, "hz": c.hz, "domain": c.domain,
                         "window_frames": len(c.window)} for c in cams],
            "ros_domain_id": domain, "capacity": cap, "summary": summary,
            "loadavg": [load0, os.getloadavg()[0]],
            "mean_streaming": {arm: summary[arm]["mean_streaming"] for arm in ARMS},
            "rounds": [{"arm": r.arm, "index": r.index, "late_ms_p99": r.late_ms,
                        "cpu": r.cpu, "served": r.served, "chosen": r.chosen,
                        "forward_ms": r.forward, "objective": r.objective,
                        "streams": {ns: vars(x.summary) for ns, x in r.results.items()}}
                       for r in rounds], "pids": pids}


def has_past(cal: str) -> bool:
    """Whether a fleet_calibration file has past domains (the Eq. 5-7 estimates)."""
    return bool(cal) and bool(json.loads(Path(cal).read_text()).get("past"))


def calibration_file(card, args: argparse.Namespace, run_dir: Path) -> str:
    """The perception nodes' fleet_calibration: `--calibration` as given, or fitted here
    on bench_fleet's labelled calibration domains, with those as the past domains of the
    Eq. 5-7 estimates (bench_fleet.offline, its defaults: prefix 64, BatchNorm on batch
    statistics, retraining `--retrain-steps` steps at lr `--past-lr`)."""
    if args.calibration is not None:
        return str(Path(args.calibration).resolve()) if args.calibration else ""
    import torch

    from tta_core.elasticdnn.gates import load_gated
    from tta_core.elasticdnn.serving import DEFAULT_SIZES

    torch.set_num_threads(1)
    ns = argparse.Namespace(sizes=DEFAULT_SIZES, batch=args.batch, prefix=64, bn="batch",
                            calibration_frames=args.calibration_frames, offline_cache="",
                            retrain_steps=args.retrain_steps, retrain_lr=args.past_lr)
    cal, prior, past = offline(load_gated(str(GATED)), card, ns)
    path = run_dir / "fleet_calibration.json"
    write_calibration(path, cal, prior, past, DEFAULT_SIZES)
    return str(path)


def plot(out: dict, path: Path) -> None:
    """Mean streaming accuracy per arm and N: bars the mean over seeds, dots each seed's
    (when matplotlib is there)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    w = len(ARMS) + 1
    for k, runs in enumerate(out["scenarios"].values()):
        for j, arm in enumerate(ARMS):
            vals = [100 * r["mean_streaming"][arm] for r in runs]
            xs = [w * k + j + 0.15 * (i - (len(vals) - 1) / 2) for i in range(len(vals))]
            ax.scatter(xs, vals, color=f"C{j}", label=arm if k == 0 else None)
            ax.bar(w * k + j, float(np.mean(vals)), color=f"C{j}", alpha=0.3)
    ax.set_xticks([w * k + (len(ARMS) - 1) / 2 for k in range(len(out["scenarios"]))],
                  [f"{n} cameras" for n in out["scenarios"]])
    ax.set_ylabel("mean streaming accuracy %")
    ax.set_title("fleet planners over DDS (bars: mean, dots: seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cameras", default="2,4")
    ap.add_argument("--rate-scale", type=float, default=20.0,
                    help="camera rates = bench_fleet's (30/10 Hz; 30/15/15/10 Hz) x this")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup-runs", type=int, default=20, help="perception warmup_runs: "
                    "forwards per size its warm-up times (the fastest counts)")
    ap.add_argument("--lr", type=float, default=1.25e-3, help="elastic lr (0: serve only; "
                    "then no node reports a retraining time and the paper arm plans with "
                    "confidence)")
    ap.add_argument("--retrain-steps", type=int, default=20, help="elastic retrain_steps: "
                    "update steps per retraining (the reports' T), and the past domains' "
                    "retraining when the calibration is fitted here")
    ap.add_argument("--past-lr", type=float, default=0.01, help="past domains' retraining "
                    "lr when fitted here (bench_fleet --retrain-lr)")
    ap.add_argument("--t-max", type=float, default=20.0, help="scheduler fleet_t_max_s: the "
                    "paper objective's retraining window, seconds")
    ap.add_argument("--capacity", type=float, default=1.1, help="x the least capacity at "
                    "which the equal split is feasible")
    ap.add_argument("--fixed-capacity", type=float, default=0.0, help="this fleet_capacity "
                    "instead (processor-seconds per second; 0: chosen as --capacity says)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per arm")
    ap.add_argument("--seconds", type=float, default=20.0, help="scored window per round")
    ap.add_argument("--settle", type=float, default=6.0, help="unscored seconds per round")
    ap.add_argument("--warm", type=float, default=8.0, help="warm-up after every node "
                    "reported, before the capacity is chosen")
    ap.add_argument("--ready-timeout", type=float, default=90.0, help="seconds to wait "
                    "for every node's first fleet report (0: as long as the nodes live)")
    ap.add_argument("--period", type=float, default=0.5, help="scheduler fleet_period_s")
    ap.add_argument("--prefix", type=int, default=64, help="settle frames per camera")
    ap.add_argument("--track", type=int, default=1)
    ap.add_argument("--calibration", default=None, help="fleet_calibration file ('': the "
                    "confidence itself; default: fitted here)")
    ap.add_argument("--calibration-frames", type=int, default=128)
    ap.add_argument("--seeds", default="0", help="comma-separated camera stream seeds (one "
                    "fleet start per seed and N)")
    ap.add_argument("--out", default="", help="JSON path (default runs/bench_fleet_dds/...)")
    ap.add_argument("--results", default="", help="also write <this>.json and <this>.md "
                    "(results.save)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tta_core.model.source import load_card

    card = load_card(str(GATED))
    out_path = Path(args.out) if args.out else (
        ROOT / "runs" / "bench_fleet_dds" / time.strftime("%Y%m%d-%H%M%S") / "result.json")
    run_dir = out_path.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout`, kill: the finally blocks run
    cal = calibration_file(card, args, run_dir)
    out = {"args": dict(vars(args)), "calibration": cal, "past_domains": has_past(cal),
           "model_card": str(GATED), "cpus": os.cpu_count(), "scenarios": {}}
    for seed in (int(v) for v in args.seeds.split(",")):
        args.seed = seed
        for n in (int(v) for v in args.cameras.split(",") if v):  # '': calibration only
            out["scenarios"].setdefault(str(n), []).append(
                scenario(n, card, args, cal, run_dir))
            out_path.write_text(json.dumps(out, indent=1, default=float))
    if out["scenarios"]:
        plot(out, out_path.with_suffix(".png"))
        print(markdown(out), flush=True)
    if args.results:
        harness.save(Path(args.results).name, out, options=args, out=Path(args.results).parent)
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


def markdown(out: dict) -> str:
    """Per N and seed: mean streaming accuracy per arm (mean over rounds and cameras), the
    sizes each arm chose per camera, what the paper arm planned with; then the means."""
    a = out["args"]
    lines = [f"Fleet planners over DDS (`benchmarks/field/bench_fleet_dds.py`): {a['rounds']} "
             f"round(s) per arm of {a['seconds']:g} s, the same frames in every round; "
             f"camera rates x {a['rate_scale']:g}, batch {a['batch']}, elastic lr "
             f"{a['lr']:g}, retrain_steps {a['retrain_steps']}, t_max {a['t_max']:g} s, "
             f"capacity {a['capacity']:g} x the least the equal split needs; past domains "
             f"for Eq. 5-7: {'yes' if out['past_domains'] else 'none'}. Mean streaming "
             f"accuracy over the cameras, %.", "",
             "| N | seed | " + " | ".join(ARMS) + " | paper planned with | sizes chosen "
             "(paper / confidence / equal_split) |", "|---|---|" + "---|" * (len(ARMS) + 2)]
    for n, runs in out["scenarios"].items():
        for r in runs:
            sm = r["summary"]
            sizes = " / ".join(str([sm[arm]["cameras"][c["ns"]]["chosen"]
                                    for c in r["cameras"]]) for arm in ARMS)
            used = ", ".join(f"{k} {v}" for k, v in sm["paper"]["objective"].items())
            lines.append(f"| {n} | {r['seed']} | " + " | ".join(
                f"{100 * r['mean_streaming'][arm]:.1f}" for arm in ARMS)
                + f" | {used} | {sizes} |")
        lines.append(f"| {n} | **mean** | " + " | ".join(
            f"**{100 * float(np.mean([r['mean_streaming'][arm] for r in runs])):.1f}**"
            for arm in ARMS) + " | | |")
    lines += ["", "Per round (the arms alternate), mean streaming accuracy over the cameras, "
              "%; answered in time: the frames whose own answer met the deadline, mean over "
              "cameras and rounds; load: the machine's 1-minute load average before / after "
              "the run (2 cores, shared with other work).", "",
              "| N | seed | arm | rounds | answered in time % | load |",
              "|---|---|---|---|---|---|"]
    for n, runs in out["scenarios"].items():
        for r in runs:
            load = "/".join(f"{v:.1f}" for v in r.get("loadavg", []))
            for arm in ARMS:
                rounds = [100 * float(np.mean([s["streaming"] for s in x["streams"].values()]))
                          for x in r["rounds"] if x["arm"] == arm]
                answered = 100 * float(np.mean([c["answered"] for c in
                                                r["summary"][arm]["cameras"].values()]))
                lines.append(f"| {n} | {r['seed']} | {arm} | "
                             f"{', '.join(f'{v:.1f}' for v in rounds)} | {answered:.1f} | "
                             f"{load} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
