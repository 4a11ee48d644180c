"""DAF dynamic widths for every gradient method through the shared loop: budget held, step
time and gradient cosine against the method's own dense saves.

Per model (torchvision, random weights, 10 classes, 224 px: ResNet-18 batch 8, ResNet-50
batch 4; `--models` for others) one interleaved run: per batch (fresh random inputs, the
same for every config), each config takes one `forward_and_adapt` at lr 0 (weights fixed, so
gradients compare), the configs' order rotated per batch, for each method of `--methods`:
  <m> dense     the method with dense saves
  <m> dyn_<f>   the same with `activation_budget_frac` = f: widths 0/2/4/8 per unit per batch
Methods: tent (`trainable: all`: conv/linear inputs get widths too), eata, sar (norm
affines; every sample reliable: entropy margin ln C, random weights are unsure), cotta (all
parameters, the mean teacher), surgeon (robot mode, keep_floor 1: its dense run stores
every save dense, so both compute the exact gradient of the same update).
Figures: share of batches whose measured saved bytes <= budget; step time ratio to the
method's dense run over the measured batches: the median of the per-round ratios (the
issue's figure), of the medians, and of the minima, on the wall clock and on the thread's
CPU clock (other jobs on a shared machine inflate wall time, less so CPU time); gradient
cosine to dense (every trainable parameter, 0 for units frozen by a 0-bit width; captured
at the optimizer step, so SAR's SAM gradient counts), min and median; mean width.
The first `--warmup` batches (moving average not filled yet) are run but not measured.

Accuracy: `tta bench` (continual stream, severity 5, batch 16, seed 0, 1 thread) of each
method dense and with dynamic widths at `activation_budget_frac` = the first of --fracs
(`<m>@dyn`), on the shipped card, --acc-samples samples per domain.
Usage: python benchmarks/memory/bench_dynamic_widths.py [--batches 6] [--warmup 2]
       [--threads 1] [--acc-samples 64] [--methods tent,eata,sar,cotta,surgeon]
Writes docs/results/dynamic_widths.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from torch import nn
from torchvision import models as tv_models

from tta_core.cli import main as tta_main
from tta_core.memory import ActivationCodec, SavedActivationCounter
from tta_core.memory.codec import ReluMask
from tta_core.memory.ledger import MIB
from tta_core.memory.packed import PackedMask
from tta_core.memory.quant import PackedInt, PackedQuant
from tta_core.registry import build_method
from tta_core.runtime import losses
from tta_core.runtime.malloc_tuning import keep_freed_memory
from tta_core.runtime.method import TTAMethod

ROOT = Path(__file__).resolve().parents[2]
BYTE_KINDS = ("codes wgrad", "codes other", "group min/scale", "ReLU masks", "pool indices",
              "held dense", "total")
CARD = "checkpoints/small_resnet_signs32.json"
METHODS = ("tent", "eata", "sar", "cotta", "surgeon")
#: per method, what makes its dense and dynamic runs comparable at lr 0 on random weights
#: (module doc); the accuracy runs use the methods' defaults
BENCH_OPTIONS: dict[str, dict] = {
    "tent": {"trainable": "all", "reforward": False},
    "eata": {"e_margin_scale": 1.0, "d_margin": 1.0, "reforward": False},
    "sar": {"e_margin_scale": 1.0, "reforward": False},
    "cotta": {},
    "surgeon": {"mode": "robot", "keep_floor": 1.0, "prune_norm": False, "reforward": False},
}
CLOCK_NAMES = ("wall", "thread")


def _make(method: str, model: nn.Module, **cfg: object) -> TTAMethod:
    return build_method(method, copy.deepcopy(model), lr=0.0, lr_ref_batch=0,
                        memory_format="contiguous", **BENCH_OPTIONS[method], **cfg)


def _dense_bytes(model: nn.Module, x: torch.Tensor) -> int:
    meth = _make("tent", model)
    counter = SavedActivationCounter(meth.model)
    with torch.enable_grad(), counter:
        losses.entropy_loss(meth.model(x))
    return counter.result.total


class _Tally(ActivationCodec):
    """The activation codec, with the bytes of each object it stores sorted by content."""

    def __init__(self, target: nn.Module, plan: object) -> None:
        super().__init__(target, plan)  # type: ignore[arg-type]
        self.kinds: collections.Counter = collections.Counter()

    def _store(self, t: torch.Tensor, enc: object, site: object, encode: object) -> object:
        if self._lookup(t, enc) is not None:  # type: ignore[arg-type]
            return super()._store(t, enc, site, encode)  # type: ignore[arg-type]
        packed = super()._store(t, enc, site, encode)  # type: ignore[arg-type]
        if isinstance(packed, PackedQuant):
            codes, mn, scale = packed.qt
            self.kinds[f"codes {site.role}"] += codes.untyped_storage().nbytes()  # type: ignore[attr-defined]
            self.kinds["group min/scale"] += (mn.untyped_storage().nbytes()
                                              + scale.untyped_storage().nbytes())
        elif isinstance(packed, PackedMask | ReluMask):
            self.kinds["ReLU masks"] += packed.nbytes
        elif isinstance(packed, PackedInt):
            self.kinds["pool indices"] += packed.nbytes
        return packed


def where_bytes_go(meth: TTAMethod, x: torch.Tensor, dense_b: int) -> dict[str, float]:
    """One more forward of a dynamic-widths method at the widths it picks for x: its saved
    bytes by content, % of the dense bytes (codes of ∂W inputs / of BN and pooling inputs,
    per-group min and scale, 1-bit ReLU masks, pooling indices, saves held as they are)."""
    widths = meth.codec
    widths.before_forward(x)
    widths.codec = tally = _Tally(meth.model, widths.codec.plan)
    with torch.enable_grad(), widths:
        losses.entropy_loss(meth.model(x))
    held = tally.result.total - sum(tally.kinds.values())
    out = {k: round(100 * v / dense_b, 2) for k, v in sorted(tally.kinds.items())}
    return {**out, "held dense": round(100 * held / dense_b, 2),
            "total": round(100 * tally.result.total / dense_b, 2)}


def _step(meth: TTAMethod, x: torch.Tensor) -> tuple[dict, dict, torch.Tensor | None]:
    """(ms per clock, stats, the gradient the optimizer stepped with) of one step."""
    seen: list[torch.Tensor] = []
    step = meth.optimizer.step

    def capture(*a: object, **k: object) -> object:
        seen.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                               .double().flatten() for p in meth.params]))
        return step(*a, **k)

    meth.optimizer.step = capture  # type: ignore[method-assign]
    try:
        meth.optimizer.zero_grad(set_to_none=True)
        with harness.Stopwatch(CLOCK_NAMES) as sw:
            res = meth.forward_and_adapt(x)
    finally:
        meth.optimizer.step = step  # type: ignore[method-assign]
    return sw.elapsed, res.stats, seen[-1] if seen else None


def bench(model: nn.Module, batch: int, res: int, fracs: list[float], batches: int,
          warmup: int, methods: list[str]) -> dict:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, 3, res, res, generator=gen) for _ in range(warmup + batches)]
    meths = {}
    for m in methods:
        meths[(m, "dense")] = _make(m, model)
        for f in fracs:
            meths[(m, f"dyn_{f:g}")] = _make(m, model, activation_budget_frac=f)
    rec = {k: {"ms": {c: [] for c in CLOCK_NAMES}, "held": [], "cos": [], "bits": [],
               "saved": [], "budget": []} for k in meths}
    keys = list(meths)
    for i, x in enumerate(harness_progress(xs, f"{model.__class__.__name__} b{batch}")):
        order = keys[i % len(keys):] + keys[:i % len(keys)]  # rotated: no config always first
        steps = {key: _step(meths[key], x) for key in order}
        if i < warmup:
            continue
        for key, (ms, stats, g) in steps.items():
            r = rec[key]
            for c in CLOCK_NAMES:
                r["ms"][c].append(ms[c])
            r["saved"].append(stats.get("saved_bytes", 0))
            if key[1] != "dense":
                r["budget"].append(stats["width_budget_bytes"])
                g_dense = steps[(key[0], "dense")][2]
                r["held"].append(bool(stats["within_width_budget"]))
                r["cos"].append(_cosine(g, g_dense))
                r["bits"].append(stats["width_mean_bits"])
    out: dict = {"dense_saved_mib": round(_dense_bytes(model, xs[0]) / MIB, 2),
                 "methods": {m: _summary(rec, m, fracs) for m in methods}}
    if "tent" in methods:
        out["bytes_pct_of_dense"] = where_bytes_go(meths[("tent", f"dyn_{fracs[0]:g}")],
                                                   xs[-1], _dense_bytes(model, xs[0]))
    return out


def harness_progress(xs: list, desc: str) -> object:
    """tqdm over the batches (stderr), plain iteration without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return xs
    return tqdm(xs, desc=desc, file=sys.stderr)


def _cosine(g: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if g is None or ref is None:  # no step: nothing to compare (counted as 0)
        return 0.0
    return float(g @ ref / (g.norm() * ref.norm()).clamp_min(1e-300))


def _summary(rec: dict, method: str, fracs: list[float]) -> dict:
    dense = rec[(method, "dense")]
    out: dict = {"dense_ms": round(statistics.median(dense["ms"]["wall"]), 1)}
    for f in fracs:
        r = rec[(method, f"dyn_{f:g}")]
        row = {"saved_mib_max": round(max(r["saved"]) / MIB, 2),
               "budget_mib_min": round(min(r["budget"]) / MIB, 2),
               "budget_held_pct": round(100 * sum(r["held"]) / len(r["held"]), 1),
               "cos_min": round(min(r["cos"]), 4),
               "cos_median": round(statistics.median(r["cos"]), 4),
               "mean_bits": round(statistics.mean(r["bits"]), 2)}
        for c in CLOCK_NAMES:
            a, b = r["ms"][c], dense["ms"][c]
            row[f"time_ratio_per_round_{c}"] = round(statistics.median(
                x / y for x, y in zip(a, b, strict=True)), 3)
            row[f"time_ratio_{c}"] = round(statistics.median(a) / statistics.median(b), 3)
            row[f"time_ratio_min_{c}"] = round(min(a) / min(b), 3)
        out[f"dyn_{f:g}"] = row
    return out


def accuracy(card: str, frac: float, samples: int, threads: int, methods: list[str]) -> dict:
    """Mean accuracy (%) and saved-activation MiB per step (--measure-activations) of each
    method dense and as `<m>@dyn` (dynamic widths at `frac` of the dense bytes) on one
    card's stream (seed 0), from one `tta bench` report."""
    labels = [x for m in methods for x in (m, f"{m}@dyn")]
    sets = [a for m in methods for a in ("--set", f"{m}@dyn.activation_budget_frac={frac:g}")]
    with tempfile.TemporaryDirectory() as out:
        rc = tta_main(["bench", "--methods", ",".join(labels), *sets, "--batch-size", "16",
                       "--samples-per-domain", str(samples), "--threads", str(threads),
                       "--seed", "0", "--model-card", str(ROOT / card),
                       "--measure-activations", "--no-progress", "--out", out])
        if rc:
            raise RuntimeError(f"tta bench exited {rc} on {card}")
        report = json.loads((Path(out) / "report.json").read_text())
    rows = {r["method"]: r for r in report["summaries"]}
    res: dict = {"budget_frac": frac, "samples_per_domain": samples}
    for m in methods:
        a, d = rows[m], rows[f"{m}@dyn"]
        res[m] = {"dense_acc_pct": round(100 * a["mean_accuracy"], 2),
                  "dyn_acc_pct": round(100 * d["mean_accuracy"], 2),
                  "gap_points": round(100 * (a["mean_accuracy"] - d["mean_accuracy"]), 2),
                  "dense_saved_mib_max": round(a["saved_mib_max"], 3),
                  "dyn_saved_mib_max": round(d["saved_mib_max"], 3)}
    return res


def _markdown(res: dict) -> str:
    rows = ["Step time / dense: median of the per-round ratios on the wall clock (thread CPU "
            "clock); medians; minima (wall).", "",
            "| model | method | dense ms | budget | budget MiB (min) | max saved MiB | "
            "budget held | step time / dense | medians | minima | grad cosine min / median "
            "| mean bits |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        if name in ("meta", "accuracy", "provenance"):
            continue
        for method, m in r["methods"].items():
            for key, c in m.items():
                if key.startswith("dyn_"):
                    rows.append(
                        f"| {name} | {method} | {m['dense_ms']} | {float(key[4:]):.0%} | "
                        f"{c['budget_mib_min']} | {c['saved_mib_max']} | "
                        f"{c['budget_held_pct']} % | {c['time_ratio_per_round_wall']} "
                        f"({c['time_ratio_per_round_thread']}) | {c['time_ratio_wall']} | "
                        f"{c['time_ratio_min_wall']} | {c['cos_min']} / {c['cos_median']} | "
                        f"{c['mean_bits']} |")
    rows += ["", "Where tent's (trainable all) saved bytes go at the first budget (% of dense "
             "bytes, widths of the last batch):", "",
             "| model | " + " | ".join(BYTE_KINDS) + " |", "|---|" + "---|" * len(BYTE_KINDS)]
    for name, r in res.items():
        if isinstance(r, dict) and "bytes_pct_of_dense" in r:
            b = r["bytes_pct_of_dense"]
            rows.append(f"| {name} | " + " | ".join(str(b.get(k, 0.0)) for k in BYTE_KINDS)
                        + " |")
    acc = res.get("accuracy")
    if acc:
        rows += ["", f"Accuracy (`tta bench`, shipped card, continual, severity 5, batch 16, "
                 f"seed 0, {acc['samples_per_domain']} samples per domain): each method dense "
                 f"and with dynamic widths at {acc['budget_frac']:.0%} (`<m>@dyn`).", "",
                 "| method | dense mean acc % | dyn mean acc % | gap (points) | saved MiB max "
                 "dense / dyn |", "|---|---|---|---|---|"]
        for m, a in acc.items():
            if isinstance(a, dict):
                rows.append(f"| {m} | {a['dense_acc_pct']} | {a['dyn_acc_pct']} | "
                            f"{a['gap_points']} | {a['dense_saved_mib_max']} / "
                            f"{a['dyn_saved_mib_max']} |")
    load = res.get("meta", {}).get("load_avg_1m")
    if load:
        rows += ["", f"Machine load (1-minute average, {os.cpu_count()} cores at render) at the "
                 f"start / end of the timed steps: {load[0]} / {load[1]}."]
    return "\n".join(rows) + "\n"


ARCHS = {"resnet18": 8, "resnet50": 4}


def main() -> None:
    keep_freed_memory()  # as the tta CLI and the ROS entry points
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--fracs", default="0.12")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--models", default="resnet18:8,resnet50:4",
                    help="torchvision arch:batch, comma-separated")
    ap.add_argument("--acc-samples", type=int, default=64,
                    help="samples per domain of the accuracy runs (0: none)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: docs/results)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    load_start = os.getloadavg()[0]  # the machine may be shared: the load the timings ran under
    fracs = [float(f) for f in args.fracs.split(",")]
    res = {}
    for spec in args.models.split(","):
        arch, batch = spec.split(":")
        torch.manual_seed(0)
        model = getattr(tv_models, arch)(num_classes=10).train()
        res[f"{arch}_{args.res}px_b{batch}"] = bench(model, int(batch), args.res, fracs,
                                                     args.batches, args.warmup, methods)
    load_end = os.getloadavg()[0]
    if args.acc_samples:
        res["accuracy"] = accuracy(CARD, fracs[0], args.acc_samples, args.threads, methods)
    res["meta"] = {"load_avg_1m": [round(load_start, 2), round(load_end, 2)],
                   "threads": args.threads, "batches": args.batches, "warmup": args.warmup,
                   "acc_samples": args.acc_samples, "torch": torch.__version__,
                   "device": "cpu"}
    print(json.dumps(res, indent=1))
    if args.out is None:
        harness.save("dynamic_widths", res, options=args)
    else:
        harness.save("dynamic_widths", res, options=args, out=args.out)


if __name__ == "__main__":
    main()
