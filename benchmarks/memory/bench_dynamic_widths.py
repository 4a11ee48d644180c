"""DAF dynamic widths through the shared loop: budget held, step time and gradient cosine
against dense saves, all parameters trainable.

Per model (torchvision, random weights, 10 classes, 224 px: ResNet-18 batch 8, ResNet-50
batch 4) one interleaved run: per batch (fresh random inputs, the same for every config),
each config takes one `forward_and_adapt` at lr 0 (weights fixed, so gradients compare):
  dense       Tent's loop with every parameter trainable, dense saves
  dyn_<f>     the same with `activation_budget_mb` = f x the dense saved bytes (measured by
              SavedActivationCounter on the first batch): widths 0/2/4/8 per unit per batch
Figures: share of batches whose measured saved bytes <= budget; step time ratio to dense
over the measured batches (the order of the configs rotated per batch): of the medians, the
median of the per-batch ratios, and of the minima (the VM is shared: other jobs only ever
slow a step down); gradient cosine to dense (all
parameters, 0 for units frozen by a 0-bit width), min and median; mean width.
The first `--warmup` batches (moving average not filled yet) are run but not measured.

Accuracy: `tta bench` (continual stream, severity 5, batch 16, 1 thread) of dense Tent and
Tent with dynamic widths at `activation_budget_frac` = the first of --fracs (`tent@dyn`), on
the shipped card and the ResNet-18 w32 card, --acc-samples samples per domain.
Usage: python benchmarks/memory/bench_dynamic_widths.py [--batches 6] [--warmup 2] [--threads 1]
       [--acc-samples 64]
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
from torchvision.models import resnet18, resnet50

from tta_core.cli import main as tta_main
from tta_core.memory import ActivationCodec, SavedActivationCounter
from tta_core.memory.codec import ReluMask
from tta_core.memory.ledger import MIB
from tta_core.memory.packed import PackedMask
from tta_core.memory.quant import PackedInt, PackedQuant
from tta_core.methods.tent import Tent, TentConfig
from tta_core.runtime import losses
from tta_core.runtime.malloc_tuning import keep_freed_memory

ROOT = Path(__file__).resolve().parents[2]
BYTE_KINDS = ("codes wgrad", "codes other", "group min/scale", "ReLU masks", "pool indices",
              "held dense", "total")
CARDS = ("checkpoints/small_resnet_signs32.json", "checkpoints/resnet18_cifar_w32_signs64.json")


class TentAll(Tent):
    """Tent's loop with every parameter trainable."""

    def configure_model(self) -> None:
        super().configure_model()
        self.model.requires_grad_(True)


def _grads(meth: Tent) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten()
                      for p in meth.params])


def _dense_bytes(model: nn.Module, x: torch.Tensor) -> int:
    meth = TentAll(copy.deepcopy(model), TentConfig(memory_format="contiguous"))
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


def where_bytes_go(meth: Tent, x: torch.Tensor, dense_b: int) -> dict[str, float]:
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


def _step(meth: Tent, x: torch.Tensor) -> tuple[float, dict, torch.Tensor]:
    meth.optimizer.zero_grad(set_to_none=True)
    ms, res = harness.timed(lambda: meth.forward_and_adapt(x))
    return ms, res.stats, _grads(meth)


def bench(model: nn.Module, batch: int, res: int, fracs: list[float], batches: int,
          warmup: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, 3, res, res, generator=gen) for _ in range(warmup + batches)]
    dense_b = _dense_bytes(model, xs[0])
    cfg = {"lr": 0.0, "lr_ref_batch": 0, "reforward": False, "memory_format": "contiguous"}
    meths = {"dense": TentAll(copy.deepcopy(model), TentConfig(**cfg))}
    for f in fracs:
        meths[f"dyn_{f:g}"] = TentAll(copy.deepcopy(model), TentConfig(
            **cfg, activation_budget_mb=f * dense_b / MIB))
    rec: dict[str, dict[str, list]] = {k: {"ms": [], "held": [], "cos": [], "bits": [],
                                           "saved": []} for k in meths}
    keys = list(meths)
    for i, x in enumerate(xs):
        order = keys[i % len(keys):] + keys[:i % len(keys)]  # rotated: no config always first
        steps = {key: _step(meths[key], x) for key in order}
        if i < warmup:
            continue
        g_dense = steps["dense"][2]
        for key, (ms, stats, g) in steps.items():
            r = rec[key]
            r["ms"].append(ms)
            r["saved"].append(stats.get("saved_bytes", 0))
            if key != "dense":
                r["held"].append(bool(stats["within_width_budget"]))
                r["cos"].append(float(g @ g_dense / (g.norm() * g_dense.norm())))
                r["bits"].append(stats["width_mean_bits"])
    out = _summary(rec, dense_b, fracs)
    out["bytes_pct_of_dense"] = where_bytes_go(meths[f"dyn_{fracs[0]:g}"], xs[-1], dense_b)
    return out


def _summary(rec: dict, dense_b: int, fracs: list[float]) -> dict:
    dense_ms = statistics.median(rec["dense"]["ms"])
    out: dict = {"dense_saved_mib": round(dense_b / MIB, 2), "dense_ms": round(dense_ms, 1)}
    for f in fracs:
        r = rec[f"dyn_{f:g}"]
        out[f"dyn_{f:g}"] = {
            "budget_mib": round(f * dense_b / MIB, 2),
            "saved_mib_max": round(max(r["saved"]) / MIB, 2),
            "budget_held_pct": round(100 * sum(r["held"]) / len(r["held"]), 1),
            "time_ratio": round(statistics.median(r["ms"]) / dense_ms, 3),
            "time_ratio_min": round(min(r["ms"]) / min(rec["dense"]["ms"]), 3),
            "time_ratio_per_round": round(statistics.median(
                a / b for a, b in zip(r["ms"], rec["dense"]["ms"], strict=True)), 3),
            "cos_min": round(min(r["cos"]), 4), "cos_median": round(statistics.median(r["cos"]), 4),
            "mean_bits": round(statistics.mean(r["bits"]), 2)}
    return out


def accuracy(card: str, frac: float, samples: int, threads: int) -> dict:
    """Mean accuracy (%) and saved-activation MiB per step (--measure-activations) of
    dense Tent and `tent@dyn` (dynamic widths at `frac` of the dense bytes) on one card's
    stream, from `tta bench`'s report."""
    with tempfile.TemporaryDirectory() as out:
        rc = tta_main(["bench", "--methods", "tent,tent@dyn", "--set",
                       f"tent@dyn.activation_budget_frac={frac:g}", "--batch-size", "16",
                       "--samples-per-domain", str(samples), "--threads", str(threads),
                       "--model-card", str(ROOT / card), "--measure-activations",
                       "--no-progress", "--out", out])
        if rc:
            raise RuntimeError(f"tta bench exited {rc} on {card}")
        report = json.loads((Path(out) / "report.json").read_text())
    rows = {r["method"]: r for r in report["summaries"]}
    res = {m: {"mean_acc_pct": round(100 * rows[m]["mean_accuracy"], 2),
               "saved_mib_mean": round(rows[m]["saved_mib_mean"], 3),
               "saved_mib_max": round(rows[m]["saved_mib_max"], 3)} for m in ("tent", "tent@dyn")}
    res["gap_points"] = round(res["tent"]["mean_acc_pct"] - res["tent@dyn"]["mean_acc_pct"], 2)
    return {"budget_frac": frac, "samples_per_domain": samples, **res}


def _markdown(res: dict) -> str:
    rows = ["| model | dense saved MiB | dense ms | budget | budget MiB | max saved MiB | "
            "budget held | step time / dense (medians, per round, minima) | "
            "grad cosine min / median | "
            "mean bits |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        if name in ("meta", "accuracy"):
            continue
        for key, c in r.items():
            if key.startswith("dyn_"):
                rows.append(f"| {name} | {r['dense_saved_mib']} | {r['dense_ms']} | "
                            f"{float(key[4:]):.0%} | {c['budget_mib']} | {c['saved_mib_max']} "
                            f"| {c['budget_held_pct']} % | {c['time_ratio']}, "
                            f"{c.get('time_ratio_per_round', '–')}, "
                            f"{c.get('time_ratio_min', '–')} | "
                            f"{c['cos_min']} / {c['cos_median']} | {c['mean_bits']} |")
    rows += ["", "Where the saved bytes go at the first budget (% of dense bytes, widths of the "
             "last batch):", "", "| model | " + " | ".join(BYTE_KINDS) + " |",
             "|---|" + "---|" * len(BYTE_KINDS)]
    for name, r in res.items():
        if "bytes_pct_of_dense" in r:
            b = r["bytes_pct_of_dense"]
            rows.append(f"| {name} | " + " | ".join(str(b.get(k, 0.0)) for k in BYTE_KINDS)
                        + " |")
    rows += ["", "Accuracy (`tta bench`, continual, severity 5, batch 16): dense Tent vs "
             "Tent with dynamic widths (`tent@dyn`, `activation_budget_frac`).", "",
             "| card | budget | samples / domain | tent mean acc % | tent@dyn mean acc % | "
             "gap (points) | saved MiB max tent / tent@dyn |", "|---|---|---|---|---|---|---|"]
    for card, a in res.get("accuracy", {}).items():
        rows.append(f"| {card} | {a['budget_frac']:.0%} | {a['samples_per_domain']} | "
                    f"{a['tent']['mean_acc_pct']} | {a['tent@dyn']['mean_acc_pct']} | "
                    f"{a['gap_points']} | {a['tent']['saved_mib_max']} / "
                    f"{a['tent@dyn']['saved_mib_max']} |")
    load = res.get("meta", {}).get("load_avg_1m")
    if load:
        rows += ["", f"Machine load (1-minute average, 2 shared cores) at the start / end of "
                 f"the timed steps: {load[0]} / {load[1]}; other jobs disturb the min ratios "
                 "least."]
    return "\n".join(rows) + "\n"


def main() -> None:
    keep_freed_memory()  # as the tta CLI and the ROS entry points
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--fracs", default="0.12,0.2")
    ap.add_argument("--acc-samples", type=int, default=64,
                    help="samples per domain of the accuracy runs (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]  # the VM is shared: the load the timings ran under
    fracs = [float(f) for f in args.fracs.split(",")]
    res = {}
    for arch, make, batch in (("resnet18", resnet18, 8), ("resnet50", resnet50, 4)):
        torch.manual_seed(0)
        res[f"{arch}_{args.res}px_b{batch}"] = bench(make(num_classes=10).train(), batch,
                                                     args.res, fracs, args.batches, args.warmup)
    load_end = os.getloadavg()[0]
    if args.acc_samples:
        res["accuracy"] = {Path(c).stem: accuracy(c, fracs[0], args.acc_samples, args.threads)
                           for c in CARDS}
    res["meta"] = {"load_avg_1m": [round(load_start, 2), round(load_end, 2)],
                   "threads": args.threads, "batches": args.batches, "warmup": args.warmup,
                   "acc_samples": args.acc_samples, "torch": torch.__version__,
                   "device": "cpu"}
    print(json.dumps(res, indent=1))
    harness.save("dynamic_widths", res, options=args)


if __name__ == "__main__":
    main()
