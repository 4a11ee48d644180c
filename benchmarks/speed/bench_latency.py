"""Per-batch latency of source, Tent (sequential) and AdaShadow; prints JSON.

Median wall time per batch over `--batches` batches after `--warmup` warm-ups, with the
per-phase split, and the ratio AdaShadow / Tent measured in the same run (AdaShadow §5:
2x-3.5x faster than Tent). Default: torchvision ResNet-50, batch 4, 224 px, 2 threads.
AdaShadow runs with a measured offline profile (`tta profile`) unless --no-profile.
`--sweep 0.25,0.4,0.5` adds AdaShadow at other sigmas to the same rounds and `--plot` draws
latency / Tent and the units updated against sigma.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch

from tta_core.adashadow.profiler import profile_model
from tta_core.model.norms import set_bn_mode
from tta_core.model.units import decompose
from tta_core.model.zoo import build_model
from tta_core.registry import build_method
from tta_core.runtime.malloc_tuning import keep_freed_memory

PHASES = ("forward_ms", "plan_ms", "backward_ms", "reforward_ms", "total_ms")


def _finite(v: float) -> float | None:
    return round(v, 2) if np.isfinite(v) else None


def _bench(methods: dict, xs: list[torch.Tensor], warmup: int) -> dict:
    """Round-robin over methods per batch, so machine load hits all of them alike."""
    phases = {n: {k: [] for k in PHASES} for n in methods}
    ups = {n: [] for n in methods}
    pred = {n: [] for n in methods}

    def note(name: str, res, counted: bool) -> None:
        if counted:
            ups[name].append(res.units_updated)
            pred[name].append((res.predicted_total_ms, res.budget_ms))
            for k in PHASES:
                phases[name][k].append(getattr(res.times, k))

    t = harness.round_robin({n: m.step for n, m in methods.items()}, warmup=warmup,
                            inputs=xs, on_result=note)
    walls = {n: t[n].ms for n in methods}
    return {n: {"median_ms": round(statistics.median(walls[n]), 2),
                "phases_median_ms": {k: round(statistics.median(v), 2)
                                     for k, v in phases[n].items()},
                "units_updated": ups[n],
                "walls_ms": [round(v, 2) for v in walls[n]],
                # AdaShadow's own prediction of its total and its budget sigma*T (ms)
                "predicted_total_median_ms": _finite(statistics.median(p for p, _ in pred[n])),
                "budget_median_ms": _finite(statistics.median(b for _, b in pred[n]))}
            for n in methods}


def _plot(by_sigma: dict, tent_ms: float, report: dict, path: str) -> None:
    """Latency / Tent's and median units updated against sigma."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sig = sorted(by_sigma)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(sig, [by_sigma[s]["median_ms"] / tent_ms for s in sig], "o-", label="AdaShadow / Tent")
    ax.axhline(0.4, color="k", ls="--", lw=0.8, label="0.4 goal")
    ax.set_xlabel("sigma (budget / full-update latency)")
    ax.set_ylabel("latency ratio to Tent")
    ax2 = ax.twinx()
    ax2.plot(sig, [statistics.median(by_sigma[s]["units_updated"]) for s in sig], "s:", color="C1")
    ax2.set_ylabel("units updated (median)", color="C1")
    ax.set_title(f"{report['arch']} {report['image_size']} px, batch {report['batch_size']}, "
                 f"{report['threads']} threads", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    keep_freed_memory()  # as the tta CLI and the ROS entry points (tta_core.runtime.malloc_tuning)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sigma", type=float, default=0.33)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--sweep", default="", help="comma list of extra sigmas for AdaShadow")
    ap.add_argument("--plot", default="", help="PNG path: ratio to Tent vs sigma")
    args = ap.parse_args(argv)
    try:
        sweep = sorted({float(v) for v in args.sweep.split(",") if v.strip()} - {args.sigma})
    except ValueError as exc:
        ap.error(f"--sweep {args.sweep!r}: {exc}")
    torch.set_num_threads(args.threads)
    shape = (3, args.image_size, args.image_size)
    gen = torch.Generator().manual_seed(0)
    n = args.batches + args.warmup
    # a drifting stream: brightness/contrast change per batch so importance is non-zero
    xs = [torch.randn(args.batch_size, *shape, generator=gen) * (1 + 0.3 * (i % 3)) + 0.2 * i
          for i in range(n)]
    prof = None
    if not args.no_profile:
        torch.manual_seed(0)
        pm = build_model(args.arch, 10)
        set_bn_mode(pm, "batch")
        prof = profile_model(decompose(pm, shape, args.arch), batch=args.batch_size, repeats=5)
    methods = {}
    runs = [("source", "source", {}), ("tent", "tent", {}),
            ("adashadow", "adashadow", {"sigma": args.sigma, "profile": prof})]
    runs += [(f"adashadow@{sg:g}", "adashadow", {"sigma": sg, "profile": prof}) for sg in sweep]
    for key, name, cfg in runs:
        torch.manual_seed(0)
        methods[key] = build_method(name, build_model(args.arch, 10), input_shape=shape,
                                    arch=args.arch, **cfg)
    results = _bench(methods, xs, args.warmup)
    by_sigma = {args.sigma: results["adashadow"], **{sg: results[f"adashadow@{sg:g}"]
                                                     for sg in sweep}}
    report = {
        "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size,
        "threads": args.threads, "batches": args.batches, "sigma": args.sigma,
        "profile": None if prof is None else {
            "forward_ms": round(prof.forward_ms, 2),
            "sum_backward_ms": round(float(np.sum(prof.w_ms + prof.x_ms)), 2)},
        "methods": results,
        "ratio_adashadow_tent": results["adashadow"]["median_ms"] / results["tent"]["median_ms"],
        # the same ratio per round (both methods ran back to back on the same batch): less
        # sensitive to load that changes between rounds
        "ratio_adashadow_tent_per_round_median": statistics.median(
            a / t for a, t in zip(results["adashadow"]["walls_ms"], results["tent"]["walls_ms"],
                                  strict=True)),
        "ratio_adashadow_source": (results["adashadow"]["median_ms"]
                                   / results["source"]["median_ms"]),
        "ratio_tent_source": results["tent"]["median_ms"] / results["source"]["median_ms"],
        "ratio_adashadow_tent_by_sigma": {
            f"{sg:g}": round(r["median_ms"] / results["tent"]["median_ms"], 4)
            for sg, r in sorted(by_sigma.items())},
    }
    if args.plot:
        _plot(by_sigma, results["tent"]["median_ms"], report, args.plot)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
