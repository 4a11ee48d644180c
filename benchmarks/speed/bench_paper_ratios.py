"""AdaShadow's latency against inference and Tent, the paper's comparison, in its default
configuration: one interleaved run per model over source (inference), bn_adapt, Tent twice,
adashadow and adashadow in parallel mode, every method stepping the same batch in turn (the
order rotated per batch), so load on the machine hits all of them alike. Methods that learn
their fixed costs first (AdaShadow's `warm_up`) do so on a noise batch before the stream,
as the perception node does at start.

Two Tents: "tent (with reforward)" (`reforward=True`: forward, backward and a reforward of
the updated model for the prediction, the Tent AdaShadow's paper measures against, so the
paper's ratio `x_tent` is to it) and "tent (original)" (tta's `tent` at its defaults: the
paper's Tent, predicting from the pre-update forward; `x_tent_original`).
Prints per method the median wall time per batch, its ratio to inference (source) and to
each Tent (of the medians with a 95 % bootstrap interval over the rounds, and the median of
the per-round ratios), the median phase times and the units updated; writes
`<out>/paper_ratios.json` and `.md` (README's latency figures come from it). Default:
torchvision ResNet-50 224 px batch 4 and ResNet-18 224 px batch 8, 2 threads, random
weights, σ = 0.33 (AdaShadow's default). The parallel mode's time is its answer (forward
and plan); its background update is waited for after the timing, before the next method
steps, as a camera's idle time between frames would absorb it (it would otherwise run
beside the next method's step and slow that one).

    python benchmarks/speed/bench_paper_ratios.py                      # the README's run
    python benchmarks/speed/bench_paper_ratios.py --device cuda        # on a GPU
    python benchmarks/speed/bench_paper_ratios.py --models resnet18:64:4 --batches 3 --warmup 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import results
import torch
from scipy import stats
from tqdm import tqdm

from tta_core.api import WarmsUp
from tta_core.model.zoo import build_model
from tta_core.registry import build_method
from tta_core.runtime.gc_pauses import frozen_heap
from tta_core.runtime.malloc_tuning import keep_freed_memory

PHASES = ("forward_ms", "plan_ms", "backward_ms", "reforward_ms")
TENT_REFORWARD, TENT_ORIGINAL = "tent (with reforward)", "tent (original)"
# ratio key: the label it divides by (x_tent: AdaShadow's paper's Tent, with the reforward)
REFERENCES = {"x_inference": "source", "x_tent": TENT_REFORWARD,
              "x_tent_original": TENT_ORIGINAL}
METHODS = {  # label: (registered method, settings)
    "source": ("source", {}),
    "bn_adapt": ("bn_adapt", {}),
    TENT_REFORWARD: ("tent", {"reforward": True}),
    TENT_ORIGINAL: ("tent", {}),
    "adashadow": ("adashadow", {}),
    "adashadow parallel": ("adashadow", {"mode": "parallel"}),
    # robust BN in RoTTA's order (move, then normalise: two reads of each layer input)
    "adashadow bn_lag=False": ("adashadow", {"bn_lag": False}),
}


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model: torchvision architecture, image size, batch size."""

    arch: str
    image_size: int
    batch_size: int

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """`arch:size:batch`, e.g. resnet50:224:4."""
        parts = text.split(":")
        try:
            arch, size, batch = parts[0], int(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"--models entry {text!r}: expected arch:size:batch, "
                             "e.g. resnet50:224:4") from None
        if size < 8 or batch < 1:
            raise ValueError(f"--models entry {text!r}: size must be >= 8, batch >= 1")
        return cls(arch, size, batch)


def _build(spec: ModelSpec, device: torch.device, sigma: float | None) -> dict:
    """Every method on its own copy of the same randomly initialised model, all in the
    memory format the first one's "auto" choice measured (timed per method, a noisy
    machine could give methods different formats: a ratio of formats, not of methods)."""
    shape = (3, spec.image_size, spec.image_size)
    methods: dict = {}
    fmt = "auto"
    for label, (name, settings) in METHODS.items():
        torch.manual_seed(0)
        model = build_model(spec.arch, 10).to(device)
        extra = {"sigma": sigma} if sigma is not None and name == "adashadow" else {}
        methods[label] = build_method(name, model, input_shape=shape, arch=spec.arch,
                                      memory_format=fmt, **settings, **extra)
        fmt = methods[label].format.format
    return methods


def _stream(spec: ModelSpec, n: int, device: torch.device) -> list[torch.Tensor]:
    """A drifting stream (brightness/contrast change per batch: importance is non-zero)."""
    gen = torch.Generator().manual_seed(0)
    shape = (spec.batch_size, 3, spec.image_size, spec.image_size)
    return [(torch.randn(shape, generator=gen) * (1 + 0.3 * (i % 3)) + 0.2 * i).to(device)
            for i in range(n)]


def run_model(spec: ModelSpec, batches: int, warmup: int, device: torch.device,
              sigma: float | None = None) -> dict:
    """Round-robin over the methods per batch; per-method walls, phases and units."""
    methods = _build(spec, device, sigma)
    noise = torch.randn((spec.batch_size, 3, spec.image_size, spec.image_size), device=device)
    for method in methods.values():
        if isinstance(method, WarmsUp):  # its fixed costs learnt, as a node does at start
            method.warm_up(noise)
    rec = {label: {"walls_ms": [], "units": [], "no_room": "", **{k: [] for k in PHASES}}
           for label in methods}
    results = {label: [] for label in methods}
    xs = _stream(spec, batches + warmup, device)
    with frozen_heap():  # as the node serves: full collections skip the start-up objects
        _interleave(methods, xs, warmup, device, rec, results,
                    f"{spec.arch} {spec.image_size}px b{spec.batch_size}")
    for label, method in methods.items():
        method.close()  # parallel mode: the last update is finished and its times filled
        for res in results[label]:
            for k in PHASES:
                rec[label][k].append(float(getattr(res.times, k)))
    return _summary(spec, rec, next(iter(methods.values())).format.format)


def _interleave(methods: dict, xs: list[torch.Tensor], warmup: int, device: torch.device,
                rec: dict, results: dict, desc: str) -> None:
    """Every method steps each batch in turn, walls and results recorded after `warmup`.
    The order rotates per batch: no method always follows the same one (Tent frees
    hundreds of MiB, a parallel update ends: what runs next would always pay)."""

    def note(label: str, res, counted: bool) -> None:
        methods[label].finish()  # parallel mode: its update ends before the next method runs
        if counted:
            rec[label]["units"].append(int(res.units_updated))
            if res.planning is not None and res.planning.no_room:
                rec[label]["no_room"] = res.planning.no_room  # the last batch's reason
            results[label].append(res)

    times = harness.round_robin(
        {label: m.step for label, m in methods.items()}, warmup=warmup, inputs=xs,
        rotate=True, device=device, on_result=note,
        progress=lambda rounds: tqdm(rounds, desc=desc, file=sys.stderr, leave=False))
    for label, t in times.items():
        rec[label]["walls_ms"] = t.ms


def _median(v: list[float]) -> float:
    return round(statistics.median(v), 3) if v else float("nan")


def ratio_interval(walls: list[float], ref: list[float], level: float = 0.95
                   ) -> tuple[float, float]:
    """Percentile bootstrap interval of median(walls) / median(ref), rounds resampled in
    pairs (a round's two times share its load): how far the ratio of one run can be from
    the machine's, on a machine whose load changes under the run. NaN below 3 rounds."""
    if len(walls) < 3:
        return math.nan, math.nan
    res = stats.bootstrap((np.asarray(walls), np.asarray(ref)), _ratio_of_medians,
                          paired=True, vectorized=True, confidence_level=level,
                          n_resamples=2000, method="percentile", rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _ratio_of_medians(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(a, axis=axis) / np.median(b, axis=axis)


def _summary(spec: ModelSpec, rec: dict, fmt: str) -> dict:
    """Medians, ratios to source and each Tent (of medians with their 95 % bootstrap interval,
    and per round), phases, units."""
    med = {label: statistics.median(r["walls_ms"]) for label, r in rec.items()}
    out = {}
    for label, r in rec.items():
        out[label] = {"median_ms": round(med[label], 3)}
        for key, ref in REFERENCES.items():
            per_round = statistics.median(a / b for a, b in zip(
                r["walls_ms"], rec[ref]["walls_ms"], strict=True))
            ci = (ratio_interval(r["walls_ms"], rec[ref]["walls_ms"]) if ref != label
                  else (math.nan, math.nan))  # NaN (null in the JSON): its own reference
            out[label] |= {key: round(med[label] / med[ref], 4),
                           f"{key}_ci95": [round(v, 4) for v in ci],
                           f"{key}_per_round": round(per_round, 4)}
        out[label] |= {
            "phases_median_ms": {k: _median(r[k]) for k in PHASES},
            "units_updated_median": statistics.median(r["units"]),
            "adapted_share": round(sum(u > 0 for u in r["units"]) / len(r["units"]), 3),
            "no_room": r["no_room"],
            "walls_ms": [round(w, 3) for w in r["walls_ms"]],
        }
    return {"arch": spec.arch, "image_size": spec.image_size, "batch_size": spec.batch_size,
            "memory_format": fmt, "methods": out}


def to_markdown(report: dict) -> str:
    """One table per model, from the report JSON."""
    intervals = any("x_inference_ci95" in m for run in report["runs"]
                    for m in run["methods"].values())
    lines = [f"Latency per batch, {report['device']}, {report['threads']} threads, "
             f"{report['batches']} measured batches (median), one interleaved run per model, "
             "each method warmed up as a node starts it (`warm_up`)." + (
                 " Ratios are of medians, with their 95 % bootstrap interval over the rounds "
                 "in brackets: the spread one run has on a machine whose load changes under "
                 "it." if intervals else ""),
             "Generated by `python benchmarks/speed/bench_paper_ratios.py`.", ""]
    for run in report["runs"]:
        original = any("x_tent_original" in m for m in run["methods"].values())
        lines += [f"### {run['arch']} {run['image_size']} px, batch {run['batch_size']} "
                  f"({run['memory_format']})", "",
                  "| method | ms | × inference | × Tent (with reforward) | "
                  + ("× Tent (original) | " if original else "")
                  + "forward | plan | backward | reforward | units |",
                  "|---|---:|---:|---:|" + ("---:|" if original else "")
                  + "---:|---:|---:|---:|---:|"]
        for label, m in run["methods"].items():
            ph = m["phases_median_ms"]
            keys = ("x_inference", "x_tent") + (("x_tent_original",) if original else ())
            ratios = " | ".join(results.with_interval(m, k) for k in keys)
            # a run before the two Tents: its "tent" was tent with the reforward
            name = TENT_REFORWARD if label == "tent" and not original else label
            lines.append(f"| {name} | {m['median_ms']:.1f} | {ratios} | "
                         f"{ph['forward_ms']:.1f} | {ph['plan_ms']:.1f} | "
                         f"{ph['backward_ms']:.1f} | {ph['reforward_ms']:.1f} | "
                         f"{m['units_updated_median']:g} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    keep_freed_memory()  # as the tta CLI and the ROS entry points
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50:224:4,resnet18:224:8",
                    help="comma list of arch:size:batch")
    ap.add_argument("--batches", type=int, default=100, help="measured batches per model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--sigma", type=float, default=None, help="AdaShadow's sigma (default: "
                    "its own default)")
    ap.add_argument("--out", default="docs/results", help="folder for paper_ratios.json/.md "
                    "('' : print only)")
    args = ap.parse_args(argv)
    try:
        specs = [ModelSpec.parse(t) for t in args.models.split(",") if t.strip()]
        device = torch.device(args.device)
    except (ValueError, RuntimeError) as exc:
        ap.error(str(exc))
    if args.batches < 1 or args.warmup < 0:
        ap.error(f"--batches must be >= 1 and --warmup >= 0, got {args.batches}, {args.warmup}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = {"device": name, "threads": args.threads, "batches": args.batches,
              "warmup": args.warmup,
              "runs": [run_model(s, args.batches, args.warmup, device, args.sigma)
                       for s in specs]}
    print(to_markdown(report))
    if args.out:
        harness.save("paper_ratios", report, options=args, out=Path(args.out))
    return report


if __name__ == "__main__":
    main()
