"""Several cameras, one computer (issue #22, #31): three fleet planners, streaming accuracy.

N camera pipelines share one processor. Each serves a surrogate of the gated master
(tta_core.elasticdnn.surrogate, cut for its domain from the highest-entropy frame of its first
`--prefix` frames) at one of `--sizes`, and retrains it on the new domain during a retraining
window of `--t-max` seconds (ElasticDNN §III-C2): `--retrain-steps` SGD steps of the IM loss
(tta_core.elasticdnn.filter_update.im_loss) on the BatchNorm affine parameters over the
prefix, timed with the whole retraining resource (one thread): T per size. Per pipeline
and size the script measures the batch forward time (interleaved, the fastest of `--reps`),
the label-free accuracy proxy (mean max-softmax confidence of the prefix frames mapped to
accuracy by a ConfidenceCalibration fitted on labelled calibration domains), and the
predictions on the window's frames before and after retraining.

Planners, all within `capacity` = `--capacity` x the least capacity at which the equal
split is feasible (N x the largest load of one pipeline at its smallest size):

- `paper`: plan_fleet with Objective("paper", t_max): Eq. 8-11 with A and Ã per size from
  Eq. 5-7 (tta_core.elasticdnn.accuracy_estimate): initial A the proxy, initial Ã the proxy
  plus the past domains' weighted retraining gain; calibrated with the accuracies before
  and after retraining monitored on the labelled calibration domains (the past domains;
  `--history other` leaves out those of the camera's own corruption, `all` keeps them),
  weighted by the distance between mean penultimate features; T measured;
- `confidence`: plan_fleet on the proxy alone (the default objective);
- `equal_split`: each app 1/N of the capacity (the paper's "Uniform");
- `oracle` (context, needs labels): the paper objective on the measured accuracies.

Scoring, the same frames for every planner: each camera's `--t-max` seconds of frames with
the streaming rule (tta_core.eval.streaming: keep-latest queue, latest available answer),
run concurrently: serving shares of the processor proportional to each load under the
allocation (processor sharing: a batch takes forward_ms / share); retraining on its own
resource, split by Eq. 10 (lambda_i = s_i / sum s) whatever planner chose the sizes, so
camera i answers with the model before retraining for frames arriving before T / lambda_i
and with the retrained one after. Only the concurrency is simulated; the predictions are
the surrogates' real ones.

    nice -n 19 python benchmarks/field/bench_fleet.py --gated-card CARD --seeds 0,1,2 \
        --results docs/results/fleet_scheduler

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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch
from torch import nn

from tta_core.data.streams import StreamSpec, build_stream
from tta_core.elasticdnn.accuracy_estimate import AccuracyHistory
from tta_core.elasticdnn.filter_update import im_loss
from tta_core.elasticdnn.fleet import (
    App,
    AppOption,
    ConfidenceCalibration,
    FleetPlan,
    Objective,
    equal_split,
    mean_confidence,
    plan_fleet,
    retrain_shares,
)
from tta_core.elasticdnn.gates import GatedModel, load_gated, make_gated
from tta_core.elasticdnn.surrogate import extract_surrogate, highest_entropy_sample
from tta_core.eval.bench_inputs import images_to_input
from tta_core.eval.streaming import recorded_step, simulate_stream
from tta_core.model.source import load_source

ROOT = Path(__file__).resolve().parents[2]
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
    times = harness.round_robin({k: (lambda m=m: m(x)) for k, m in models.items()}, reps)
    return {k: min(t.ms) for k, t in times.items()}


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


def retrain(model: nn.Module, x: torch.Tensor, steps: int, lr: float, batch: int) -> float:
    """Retrain `model` in place on x (IM loss, BatchNorm affine parameters, SGD); returns
    T, its time in seconds with one thread: steps x the median step (the median: one step
    preempted by another process must not make a size look slow)."""
    bn = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    params = [p for m in bn for p in (m.weight, m.bias) if p is not None]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    def step(i: int) -> None:
        loss = im_loss(model(x[i:i + batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()

    starts = [(s * batch) % max(1, len(x) - batch + 1) for s in range(steps)]
    times = harness.round_robin({"step": step}, warmup=0, inputs=starts) if steps else {}
    for p in model.parameters():
        p.requires_grad_(False)
    return steps * times["step"].median / 1e3 if times else 0.0


@torch.no_grad()
def representation(master: GatedModel, x: torch.Tensor) -> np.ndarray:
    """The domain's representation: the master's mean penultimate feature vector on x
    (the input of its last Linear layer), eval mode, full size."""
    head = [m for n, m in master.named_modules() if isinstance(m, nn.Linear)
            and not n.startswith("gates")][-1]
    feats: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, inp, out: feats.append(inp[0]))
    try:
        with master.sparsity_set_to(0.0):
            master.eval()(x)
    finally:
        hook.remove()
    return torch.cat(feats).mean(0).numpy()


@dataclass
class Past:
    """A labelled past domain: corruption, representation, accuracy per size before and
    after retraining (sizes in `sizes` order)."""

    corruption: str
    rep: np.ndarray
    before: np.ndarray
    after: np.ndarray


def past_domains(master: GatedModel, card, args: argparse.Namespace) -> list[Past]:
    """The calibration domains as ElasticDNN's past domains: per size the accuracy on the
    frames after the prefix, before and after retraining on the prefix (labels: offline)."""
    out = []
    for j, (c, sev) in enumerate(CALIBRATION):
        x, y = frames(card, c, sev, args.prefix + args.calibration_frames, 1, seed=1000 + j)
        head, tail, yt = x[:args.prefix], x[args.prefix:], y[args.prefix:]
        before, after = [], []
        for _, model in surrogates(master, head, args.sizes, args.bn).items():
            before.append(float((predict(model, tail, args.batch)[0] == yt).mean()))
            retrain(model, head, args.retrain_steps, args.retrain_lr, args.batch)
            after.append(float((predict(batch_norm_stats(model) if args.bn == "batch"
                                        else model.eval(), tail, args.batch)[0] == yt).mean()))
        out.append(Past(c, representation(master, head), np.array(before), np.array(after)))
    return out


def history_for(cam: Camera, past: list[Past], mode: str) -> AccuracyHistory:
    """The past domains a camera's estimate may use (`--history`)."""
    h = AccuracyHistory()
    for d in past:
        if mode == "all" or d.corruption != cam.corruption:
            h.record(d.rep, d.before, d.after)
    return h


@dataclass
class Measured:
    """Per camera and size: forward ms, proxy, Eq. 6-7 estimates, measured accuracies
    before / after retraining, retraining time, window predictions before / after."""

    cams: tuple[Camera, ...]
    sizes: tuple[float, ...]
    fwd: dict[tuple[str, float], float]
    proxy: dict[tuple[str, float], float]
    est: dict[tuple[str, float], tuple[float, float]]  # (A, Ã) of Eq. 6-7
    actual: dict[tuple[str, float], tuple[float, float]]  # measured before, after
    retrain_s: dict[tuple[str, float], float]
    preds: dict[tuple[str, float], tuple[np.ndarray, np.ndarray]]
    labels: dict[str, np.ndarray]


def _camera(master: GatedModel, card, i: int, cam: Camera, cal: ConfidenceCalibration,
            past: list[Past], args: argparse.Namespace, m: Measured) -> dict:
    """One camera's surrogates: proxy on the prefix, truth on the window, retrained."""
    n = round(args.t_max * cam.hz)
    x, y = frames(card, cam.corruption, cam.severity, args.prefix + n, args.track,
                  seed=args.seed + i)
    head, tail = x[:args.prefix], x[args.prefix:]
    m.labels[cam.name] = y[args.prefix:]
    models = {}
    for k, model in surrogates(master, head, args.sizes, args.bn).items():
        models[cam.name, k] = model
        m.proxy[cam.name, k] = cal(float(np.mean(predict(model, head, args.batch)[1])))
        before = predict(model, tail, args.batch)[0]
        served = copy.deepcopy(model)
        m.retrain_s[cam.name, k] = retrain(served, head, args.retrain_steps, args.retrain_lr,
                                           args.batch)
        served = batch_norm_stats(served) if args.bn == "batch" else served.eval()
        after = predict(served, tail, args.batch)[0]
        m.preds[cam.name, k] = (before, after)
        m.actual[cam.name, k] = (float((before == m.labels[cam.name]).mean()),
                                 float((after == m.labels[cam.name]).mean()))
    rep = representation(master, head)
    hist = history_for(cam, past, args.history)
    a0 = np.array([m.proxy[cam.name, k] for k in args.sizes])
    est_b, est_a = hist.label_free(rep, a0)
    for j, k in enumerate(args.sizes):
        m.est[cam.name, k] = (float(est_b[j]), float(est_a[j]))
    return models


def measure(master: GatedModel, card, cams, cal: ConfidenceCalibration, past: list[Past],
            args: argparse.Namespace) -> Measured:
    """Every camera's measurements (`_camera`), then the forward times, interleaved."""
    m = Measured(tuple(cams), tuple(args.sizes), {}, {}, {}, {}, {}, {}, {})
    models = {}
    for i, cam in enumerate(cams):
        models.update(_camera(master, card, i, cam, cal, past, args, m))
    x = frames(card, cams[0].corruption, cams[0].severity, args.batch, 1, seed=args.seed)[0]
    m.fwd = forward_times(models, x, args.reps)
    return m


def apps(m: Measured, accuracy: dict[tuple[str, float], tuple[float, float]],
         batch: int) -> list[App]:
    """The fleet instance: each camera's batch deadline is its batch's frame time; per
    size (A, Ã) from `accuracy` and T measured."""
    return [App(c.name, c.hz, batch * 1000.0 / c.hz,
                [AppOption(k, m.fwd[c.name, k], *accuracy[c.name, k], m.retrain_s[c.name, k])
                 for k in m.sizes], batch_size=batch) for c in m.cams]


def stream_scores(m: Measured, plan: FleetPlan, fleet: list[App], capacity: float,
                  args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Streaming accuracy of every camera under `plan`, run concurrently: serving share
    capacity x its load / the total load (a batch takes forward_ms / share, never less
    than forward_ms); retraining share lambda_i of Eq. 10, retrained from T / lambda_i."""
    from tta_core.eval.bench_stream import stream_batch_wait_ms

    loads = {a.name: a.load(next(o for o in a.options if o.keep == plan[a.name]))
             for a in fleet}
    total = sum(loads.values())
    lam = dict(zip(plan, retrain_shares([plan[c] for c in plan]), strict=True))
    out = {}
    for c in m.cams:
        k = plan[c.name]
        share = min(1.0, capacity * loads[c.name] / total)
        step_ms = m.fwd[c.name, k] / share
        tau = m.retrain_s[c.name, k] / lam[c.name]
        before, after = m.preds[c.name, k]
        preds = np.where(np.arange(len(before)) / c.hz < tau, before, after)
        res = simulate_stream(m.labels[c.name].tolist(), c.hz,
                              recorded_step(preds.tolist(), step_ms),
                              batch_size=args.batch, queue_size=32,
                              batch_wait_ms=stream_batch_wait_ms(c.hz, args.batch))
        out[c.name] = {"keep": k, "share": share, "step_ms": step_ms, "retrain_share":
                       lam[c.name], "retrained_at_s": tau,
                       "streaming": res.summary.streaming, "strict": res.summary.strict,
                       "dropped": res.summary.dropped}
    return out


PLANNERS = ("paper", "confidence", "equal_split", "oracle")


def scenario(master: GatedModel, card, n: int, cal: ConfidenceCalibration, past: list[Past],
             args: argparse.Namespace) -> dict:
    """Measure, plan with every planner, stream them all on the same frames."""
    m = measure(master, card, CAMERAS[n], cal, past, args)
    proxy = {key: (v, v) for key, v in m.proxy.items()}
    fleet = apps(m, proxy, args.batch)
    split_min = len(fleet) * max(a.load(a.options[-1]) for a in fleet)  # sizes: largest first
    capacity = args.capacity * split_min
    paper = Objective("paper", args.t_max)
    plans = {"paper": plan_fleet(apps(m, m.est, args.batch), capacity, paper),
             "confidence": plan_fleet(fleet, capacity),
             "equal_split": equal_split(fleet, capacity),
             "oracle": plan_fleet(apps(m, m.actual, args.batch), capacity, paper)}
    scores = {name: stream_scores(m, p, fleet, capacity, args) for name, p in plans.items()}
    mean = {name: statistics.mean(s["streaming"] for s in sc.values())
            for name, sc in scores.items()}
    return {
        "seed": args.seed, "cameras": [vars(c) for c in m.cams], "capacity": capacity,
        "per_size": {c.name: {str(k): {
            "forward_ms": round(m.fwd[c.name, k], 4), "proxy": round(m.proxy[c.name, k], 4),
            "estimate_before_after": [round(v, 4) for v in m.est[c.name, k]],
            "accuracy_before_after": [round(v, 4) for v in m.actual[c.name, k]],
            "retrain_s": round(m.retrain_s[c.name, k], 4)} for k in m.sizes}
            for c in m.cams},
        "allocations": {name: {"sizes": dict(p), "feasible": p.feasible, "reason": p.reason,
                               "load": p.load, "objective": p.accuracy}
                        for name, p in plans.items()},
        "streams": scores, "mean_streaming": mean}


def markdown(out: dict) -> str:
    """Per N and seed: mean streaming accuracy per planner, then the mean over seeds."""
    lines = [f"Fleet planners, simulated processor sharing (`benchmarks/field/bench_fleet.py`, "
             f"{out['gates']}, t_max {out['args']['t_max']:g} s, history "
             f"{out['args']['history']}). Mean streaming accuracy over the cameras, %.", "",
             "| N | seed | " + " | ".join(PLANNERS) + " | paper sizes | confidence sizes |",
             "|---|---|" + "---|" * (len(PLANNERS) + 2)]
    for n, runs in out["scenarios"].items():
        for r in runs:
            a = r["allocations"]
            lines.append(f"| {n} | {r['seed']} | " + " | ".join(
                f"{100 * r['mean_streaming'][p]:.1f}" for p in PLANNERS) +
                f" | {list(a['paper']['sizes'].values())} | "
                f"{list(a['confidence']['sizes'].values())} |")
        lines.append(f"| {n} | **mean** | " + " | ".join(
            f"**{100 * statistics.mean(r['mean_streaming'][p] for r in runs):.1f}**"
            for p in PLANNERS) + " | | |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-card", default=str(CARD))
    ap.add_argument("--gated-card", default="", help="gated master (tta train-elastic)")
    ap.add_argument("--cameras", default="2,4")
    ap.add_argument("--sizes", default="1,0.7,0.5,0.3")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=64, help="frames the proxy sees")
    ap.add_argument("--t-max", type=float, default=20.0, help="retraining window, seconds: "
                    "also the scored frames per camera (t_max x its rate)")
    ap.add_argument("--retrain-steps", type=int, default=20)
    ap.add_argument("--retrain-lr", type=float, default=0.01)
    ap.add_argument("--history", choices=("other", "all"), default="other",
                    help="past domains of Eq. 5-7: other = leave out the camera's own "
                    "corruption (a new domain), all = keep it (a recurring one)")
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
    ap.add_argument("--seeds", default="0", help="comma-separated camera stream seeds")
    ap.add_argument("--out", default="", help="JSON path")
    ap.add_argument("--results", default="", help="write <this>.json and <this>.md")
    ap.add_argument("--calibration-out", default="", help="write the calibration (and the "
                    "prior) as a fleet_calibration file for the perception node")
    ap.add_argument("--offline-cache", default="", help="JSON of the calibration and the "
                    "past domains: read when it exists, else written")
    ap.add_argument("--merge", nargs="+", default=[], help="merge these runs' JSON (no run)")
    args = ap.parse_args(argv)
    args.sizes = tuple(sorted((float(s) for s in args.sizes.split(",")), reverse=True))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.gated_card:
        master, gates = load_gated(args.gated_card), f"trained ({args.gated_card})"
        card = load_source(args.gated_card)[1]
    else:
        source, card = load_source(args.model_card)
        master, gates = make_gated(source).eval(), "untrained (make_gated on the source)"
    if args.merge:
        return _write(merge(args.merge), args)
    cal, prior, past = offline(master, card, args)
    if args.calibration_out:  # the perception node's fleet_calibration file
        write_calibration(Path(args.calibration_out), cal, prior, past, args.sizes)
    out = {"gates": gates, "model": card.name or card.arch, "threads": args.threads,
           "bn": args.bn, "args": {k: v for k, v in vars(args).items() if k != "out"},
           "calibration": {**cal.to_dict(), "prior": prior},
           "past_domains": [{"corruption": d.corruption, "before": d.before.tolist(),
                             "after": d.after.tolist()} for d in past],
           "scenarios": {n: [] for n in args.cameras.split(",")}}
    for seed in (int(v) for v in args.seeds.split(",")):
        args.seed = seed
        for n in out["scenarios"]:
            out["scenarios"][n].append(scenario(master, card, int(n), cal, past, args))
            print(f"N={n} seed {seed}: " + " ".join(
                f"{p} {100 * v:.1f}" for p, v in out["scenarios"][n][-1]["mean_streaming"]
                .items()), file=sys.stderr, flush=True)
    return _write(out, args)


def offline(master: GatedModel, card, args: argparse.Namespace
            ) -> tuple[ConfidenceCalibration, dict[float, float], list[Past]]:
    """The calibration, prior and past domains; from / to `--offline-cache` when given
    (they depend on the master, sizes, batch and retraining settings, not the seed)."""
    path = Path(args.offline_cache) if args.offline_cache else None
    if path is not None and path.exists():
        d = json.loads(path.read_text())
        return (ConfidenceCalibration.from_dict(d["calibration"]),
                {float(k): v for k, v in d["prior"].items()},
                [Past(p["corruption"], np.array(p["rep"]), np.array(p["before"]),
                      np.array(p["after"])) for p in d["past"]])
    cal, prior = calibrate(master, card, args.sizes, args.batch, args.calibration_frames,
                           args.bn)
    past = past_domains(master, card, args)
    if path is not None:
        path.write_text(json.dumps({
            "calibration": cal.to_dict(), "prior": {str(k): v for k, v in prior.items()},
            "past": [{"corruption": p.corruption, "rep": p.rep.tolist(),
                      "before": p.before.tolist(), "after": p.after.tolist()}
                     for p in past]}))
    return cal, prior, past


def write_calibration(path: Path, cal: ConfidenceCalibration, prior: dict[float, float],
                      past: list[Past], sizes) -> None:
    """A perception node's fleet_calibration file: the confidence -> accuracy map, the
    prior, and the past domains for its Eq. 5-7 estimates (AccuracyHistory.from_records)."""
    hist = AccuracyHistory()
    for d in past:
        hist.record(d.rep, d.before, d.after)
    path.write_text(json.dumps({**cal.to_dict(), "prior": {str(k): v for k, v in prior.items()},
                                "past": hist.to_records(sizes)}, indent=1))


def merge(paths: list[str]) -> dict:
    """Several runs' JSON (e.g. one per seed) as one: the first's settings, every
    scenario's runs in the given order."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(runs[0])
    out["scenarios"] = {n: [r for run in runs for r in run["scenarios"].get(n, [])]
                        for n in runs[0]["scenarios"]}
    out["merged"] = list(paths)
    return out


def _write(out: dict, args: argparse.Namespace) -> int:
    """JSON to stdout (and --out), JSON + markdown to --results."""
    text = json.dumps(out, indent=1, default=float)
    if args.out:
        Path(args.out).write_text(text)
    if args.results:
        harness.save(Path(args.results).name, out, options=args, out=Path(args.results).parent)
    print(text)
    print(markdown(out))
    ok = all(math.isfinite(v) for runs in out["scenarios"].values() for r in runs
             for v in r["mean_streaming"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
