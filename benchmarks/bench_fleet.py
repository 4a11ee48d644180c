"""Several cameras, one computer (issue #22): fleet plan vs equal split, streaming accuracy.

N camera pipelines share one processor. Each serves a surrogate of the gated master
(tta_core.elasticdnn.surrogate, cut for its domain from the highest-entropy frame of its first
`--prefix` frames) at one of `--sizes`. Per pipeline and size the script measures the batch
forward time (interleaved over all pipelines and sizes, the fastest of `--reps`) and the
label-free accuracy proxy (mean max-softmax confidence of the prefix frames at that size,
mapped to accuracy by a ConfidenceCalibration fitted on a separate labelled calibration
stream: the "source data" calibration; tta_core.elasticdnn.fleet). From those, `plan_fleet`
and `equal_split` choose the sizes within `capacity` = `--capacity` x the least capacity
at which the equal split is feasible (N x the largest load of one pipeline at its smallest
size): the baseline keeps up.

Both allocations are then scored in the same run on the frames after the prefix with the
streaming rule (tta_core.eval.streaming: keep-latest queue, latest available answer, tracks
of `--track` frames): the pipelines run concurrently, each on a share of the processor
proportional to its load under the allocation (processor sharing: a batch takes forward_ms
/ share), so a pipeline whose load exceeds its share falls behind and drops frames. The
predictions are the surrogates' real predictions on the frames; only the concurrency is
simulated (the DDS part, sizes reaching namespaced perception nodes, is
test/ros/test_ros_fleet.py). Also printed: the oracle allocation (plan_fleet on the measured
accuracies, which need labels) and each size's proxy vs measured accuracy.

    nice -n 19 python benchmarks/bench_fleet.py --gated-card CARD [--seed 0] [--capacity 1.1]

(README "Several cameras on one computer": CARD from `tta train-elastic` with its defaults.)

Without --gated-card the master is `make_gated` on the source model with untrained gates
(identity at sparsity 0; filters ranked by the untrained gates' saliency), and the JSON
says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tta_core.data.streams import StreamSpec, build_stream
from tta_core.elasticdnn.fleet import (
    App,
    AppOption,
    ConfidenceCalibration,
    FleetPlan,
    equal_split,
    mean_confidence,
    plan_fleet,
)
from tta_core.elasticdnn.gates import GatedModel, load_gated, make_gated
from tta_core.elasticdnn.surrogate import extract_surrogate, highest_entropy_sample
from tta_core.eval.bench import images_to_input
from tta_core.eval.streaming import recorded_step, simulate_stream
from tta_core.model.source import load_source

ROOT = Path(__file__).resolve().parent.parent
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"


@dataclass(frozen=True)
class Camera:
    """One pipeline: frame rate and the domain it sees (corruption/severity)."""

    name: str
    hz: float
    corruption: str
    severity: int


CAMERAS = {
    2: (Camera("front", 30.0, "gaussian_noise", 5), Camera("rear", 10.0, "brightness", 1)),
    4: (Camera("front", 30.0, "gaussian_noise", 5), Camera("left", 15.0, "fog", 3),
        Camera("right", 15.0, "brightness", 1), Camera("rear", 10.0, "contrast", 5)),
}
CALIBRATION = (("brightness", 1), ("brightness", 5), ("gaussian_noise", 3),
               ("gaussian_noise", 5), ("fog", 3), ("contrast", 5), ("motion_blur", 3),
               ("jpeg_compression", 5), ("snow", 3), ("pixelate", 5))


def camera_stream(card, corruption: str, severity: int, n: int, track: int, seed: int):
    """One domain's stream of n frames (uint8 images, labels): what a camera sees."""
    spec = StreamSpec(order="continual", corruptions=(corruption,), severity=severity,
                      samples_per_domain=n, image_size=card.image_size, seed=seed,
                      num_classes=card.num_classes, track_length=track)
    return build_stream(spec)


def frames(card, corruption: str, severity: int, n: int, track: int, seed: int):
    """(inputs, labels) of one domain's stream of n frames."""
    s = camera_stream(card, corruption, severity, n, track, seed)
    return images_to_input(s.images, card), s.labels


def batch_norm_stats(model: nn.Module) -> nn.Module:
    """`model` in eval mode, its BatchNorms normalising with each batch's statistics
    (momentum 0: the running statistics stay as they are)."""
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()
            m.momentum = 0.0
    return model


def surrogates(master: GatedModel, x: torch.Tensor, sizes, bn: str) -> dict[float, nn.Module]:
    """The surrogate per size for the domain of x (cut from x's highest-entropy frame);
    size 1.0 is (a copy of) the master itself, its gates computed per frame, as the elastic
    method serves it. bn "batch": BatchNorms use the batch's statistics."""
    sample = highest_entropy_sample(master.eval(), x)
    out = {k: copy.deepcopy(master) if k >= 1.0 else extract_surrogate(master, sample, k).model
           for k in sizes}
    return {k: batch_norm_stats(m) if bn == "batch" else m.eval() for k, m in out.items()}


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch: int) -> tuple[np.ndarray, list[float]]:
    """Predictions per frame and mean confidence per batch."""
    preds, conf = [], []
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch])
        preds.append(logits.argmax(1).numpy())
        conf.append(mean_confidence(logits))
    return np.concatenate(preds), conf


@torch.no_grad()
def forward_times(models: dict[tuple[str, float], nn.Module], x: torch.Tensor,
                  reps: int) -> dict[tuple[str, float], float]:
    """Fastest batch forward (ms) of every model over `reps` interleaved rounds (the
    fastest, as the elastic method's warm-up times sizes: on a shared machine the median
    carries other processes' preemptions, which made a smaller size look slower)."""
    times: dict[tuple[str, float], list[float]] = {k: [] for k in models}
    for m in models.values():
        m(x)  # warm-up
    for _ in range(reps):
        for k, m in models.items():
            t0 = time.perf_counter()
            m(x)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: min(v) for k, v in times.items()}


def calibrate(master: GatedModel, card, sizes, batch: int, n: int, bn: str
              ) -> tuple[ConfidenceCalibration, dict[float, float]]:
    """Fit the confidence -> accuracy map on labelled calibration domains (pooled sizes),
    and the prior: each size's accuracy on the mildest one (the first)."""
    conf, acc, prior = [], [], {}
    for j, (c, s) in enumerate(CALIBRATION):
        x, y = frames(card, c, s, n, 1, seed=1000 + j)
        for k, model in surrogates(master, x[:batch * 4], sizes, bn).items():
            preds, cs = predict(model, x, batch)
            conf += cs
            acc += [float((preds[i:i + batch] == y[i:i + batch]).mean())
                    for i in range(0, len(x), batch)]
            if j == 0:
                prior[k] = float((preds == y).mean())
    return ConfidenceCalibration.fit(conf, acc), prior


@dataclass
class Measured:
    """Per camera and size: forward ms, proxy and measured accuracy, eval predictions."""

    cams: tuple[Camera, ...]
    sizes: tuple[float, ...]
    fwd: dict[tuple[str, float], float]
    proxy: dict[tuple[str, float], float]
    actual: dict[tuple[str, float], float]
    preds: dict[tuple[str, float], np.ndarray]
    labels: dict[str, np.ndarray]


def measure(master: GatedModel, card, cams, sizes, cal: ConfidenceCalibration,
            args: argparse.Namespace) -> Measured:
    """Surrogates per camera from its prefix; proxy on the prefix, truth on the rest."""
    models, proxy, actual, preds, labels = {}, {}, {}, {}, {}
    for i, cam in enumerate(cams):
        x, y = frames(card, cam.corruption, cam.severity, args.prefix + args.frames,
                      args.track, seed=args.seed + i)
        head, tail = x[:args.prefix], x[args.prefix:]
        labels[cam.name] = y[args.prefix:]
        for k, model in surrogates(master, head, sizes, args.bn).items():
            models[cam.name, k] = model
            proxy[cam.name, k] = cal(float(np.mean(predict(model, head, args.batch)[1])))
            preds[cam.name, k] = predict(model, tail, args.batch)[0]
            actual[cam.name, k] = float((preds[cam.name, k] == labels[cam.name]).mean())
    fwd = forward_times(models, x[:args.batch], args.reps)
    return Measured(tuple(cams), tuple(sizes), fwd, proxy, actual, preds, labels)


def apps(m: Measured, accuracy: dict[tuple[str, float], float], batch: int) -> list[App]:
    """The fleet instance: each camera's batch deadline is its batch's frame time."""
    return [App(c.name, c.hz, batch * 1000.0 / c.hz,
                [AppOption(k, m.fwd[c.name, k], accuracy[c.name, k]) for k in m.sizes],
                batch_size=batch) for c in m.cams]


def stream_scores(m: Measured, plan: FleetPlan, fleet: list[App], capacity: float,
                  batch: int) -> dict[str, dict[str, float]]:
    """Streaming accuracy of every camera under `plan`, run concurrently: each camera's
    share of the processor is capacity x its load / the total load, a batch takes
    forward_ms / share (never less than forward_ms)."""
    from tta_core.eval.bench import stream_batch_wait_ms

    loads = {a.name: a.load(next(o for o in a.options if o.keep == plan[a.name]))
             for a in fleet}
    total = sum(loads.values())
    out = {}
    for c in m.cams:
        k = plan[c.name]
        share = min(1.0, capacity * loads[c.name] / total)
        step_ms = m.fwd[c.name, k] / share
        res = simulate_stream(m.labels[c.name].tolist(), c.hz,
                              recorded_step(m.preds[c.name, k].tolist(), step_ms),
                              batch_size=batch, queue_size=32,
                              batch_wait_ms=stream_batch_wait_ms(c.hz, batch))
        out[c.name] = {"keep": k, "share": share, "step_ms": step_ms,
                       "streaming": res.summary.streaming, "strict": res.summary.strict,
                       "dropped": res.summary.dropped}
    return out


def scenario(master: GatedModel, card, n: int, cal: ConfidenceCalibration,
             args: argparse.Namespace) -> dict:
    """Measure, plan (proxy), split, oracle (measured accuracies); stream all three."""
    m = measure(master, card, CAMERAS[n], args.sizes, cal, args)
    fleet = apps(m, m.proxy, args.batch)
    # the least capacity at which the equal split is feasible (the fastest camera's smallest
    # size fits its 1/N share), times --capacity: the baseline keeps up, with little room
    split_min = len(fleet) * max(a.load(a.options[-1]) for a in fleet)  # sizes: largest first
    capacity = args.capacity * split_min
    plans = {"plan": plan_fleet(fleet, capacity), "equal_split": equal_split(fleet, capacity),
             "oracle": plan_fleet(apps(m, m.actual, args.batch), capacity)}
    scores = {name: stream_scores(m, p, fleet, capacity, args.batch) for name, p in plans.items()}
    mean = {name: statistics.mean(s["streaming"] for s in sc.values())
            for name, sc in scores.items()}
    return {
        "cameras": [vars(c) for c in m.cams], "capacity": capacity,
        "capacity_factor": args.capacity,
        "full_size_load": sum(a.load(a.options[0]) for a in fleet),
        "per_size": {c.name: {str(k): {"forward_ms": round(m.fwd[c.name, k], 4),
                                       "proxy": round(m.proxy[c.name, k], 4),
                                       "accuracy": round(m.actual[c.name, k], 4)}
                              for k in m.sizes} for c in m.cams},
        "allocations": {name: {"sizes": dict(p), "feasible": p.feasible, "reason": p.reason,
                               "load": p.load, "proxy_sum": p.accuracy}
                        for name, p in plans.items()},
        "streams": scores, "mean_streaming": mean,
        "plan_minus_split": mean["plan"] - mean["equal_split"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-card", default=str(CARD))
    ap.add_argument("--gated-card", default="", help="gated master (tta train-elastic)")
    ap.add_argument("--cameras", default="2,4")
    ap.add_argument("--sizes", default="1,0.7,0.5,0.3")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=64, help="frames the proxy sees")
    ap.add_argument("--frames", type=int, default=512, help="scored frames per camera")
    ap.add_argument("--track", type=int, default=1, help="frames per object (> 1: "
                    "batch BN statistics then see few objects per batch)")
    ap.add_argument("--capacity", type=float, default=1.1,
                    help="capacity as a multiple of the least one at which the equal split "
                    "is feasible (N x the largest load of a camera at its smallest size)")
    ap.add_argument("--calibration-frames", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bn", choices=("batch", "running"), default="batch",
                    help="BatchNorm statistics the served models use (batch: the batch's own, "
                    "as the elastic method serves surrogates; the sandwich-trained master's "
                    "running statistics do not fit its sparse sub-networks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--calibration-out", default="", help="write the calibration (and the "
                    "prior) as a fleet_calibration file for the perception node")
    args = ap.parse_args(argv)
    args.sizes = tuple(sorted((float(s) for s in args.sizes.split(",")), reverse=True))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.gated_card:
        master, gates = load_gated(args.gated_card), f"trained ({args.gated_card})"
        card = load_source(args.gated_card)[1]
    else:
        source, card = load_source(args.model_card)
        master, gates = make_gated(source).eval(), "untrained (make_gated on the source)"
    cal, prior = calibrate(master, card, args.sizes, args.batch, args.calibration_frames,
                           args.bn)
    if args.calibration_out:  # the perception node's fleet_calibration file
        Path(args.calibration_out).write_text(json.dumps(
            {**cal.to_dict(), "prior": {str(k): v for k, v in prior.items()}}, indent=1))
    out = {"gates": gates, "model": card.name or card.arch, "threads": args.threads,
           "bn": args.bn,
           "args": {k: v for k, v in vars(args).items() if k != "out"},
           "calibration": {**cal.to_dict(), "prior": prior},
           "scenarios": {n: scenario(master, card, int(n), cal, args)
                         for n in args.cameras.split(",")}}
    text = json.dumps(out, indent=1, default=float)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if all(math.isfinite(s["plan_minus_split"]) for s in out["scenarios"].values()) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
