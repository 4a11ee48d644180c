"""DAF dynamic widths through the shared loop: budget held, step time and gradient cosine
against dense saves, all parameters trainable.

Per model (torchvision, random weights, 10 classes, 224 px: ResNet-18 batch 8, ResNet-50
batch 4) one interleaved run: per batch (fresh random inputs, the same for every config),
each config takes one `forward_and_adapt` at lr 0 (weights fixed, so gradients compare):
  dense       Tent's loop with every parameter trainable, dense saves
  dyn_<f>     the same with `activation_budget_mb` = f x the dense saved bytes (measured by
              SavedActivationCounter on the first batch): widths 0/2/4/8 per unit per batch
Figures: share of batches whose measured saved bytes <= budget; median step time ratio to
dense over the measured batches (round-robin order); gradient cosine to dense (all
parameters, 0 for units frozen by a 0-bit width), min and median; mean width.
The first `--warmup` batches (moving average not filled yet) are run but not measured.
Usage: python benchmarks/bench_dynamic_widths.py [--batches 6] [--warmup 2] [--threads 1]
Writes docs/results/dynamic_widths.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torchvision.models import resnet18, resnet50

from tta_core.memory import SavedActivationCounter
from tta_core.memory.ledger import MIB
from tta_core.methods.tent import Tent, TentConfig
from tta_core.runtime import losses

OUT = Path(__file__).resolve().parents[1] / "docs" / "results"


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


def _step(meth: Tent, x: torch.Tensor) -> tuple[float, dict, torch.Tensor]:
    meth.optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    res = meth.forward_and_adapt(x)
    return (time.perf_counter() - t0) * 1e3, res.stats, _grads(meth)


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
    for i, x in enumerate(xs):
        g_dense = None
        for key, meth in meths.items():
            ms, stats, g = _step(meth, x)
            if key == "dense":
                g_dense = g
            if i < warmup:
                continue
            r = rec[key]
            r["ms"].append(ms)
            r["saved"].append(stats.get("saved_bytes", 0))
            if key != "dense":
                r["held"].append(bool(stats["within_width_budget"]))
                r["cos"].append(float(g @ g_dense / (g.norm() * g_dense.norm())))
                r["bits"].append(stats["width_mean_bits"])
    return _summary(rec, dense_b, fracs)


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
            "cos_min": round(min(r["cos"]), 4), "cos_median": round(statistics.median(r["cos"]), 4),
            "mean_bits": round(statistics.mean(r["bits"]), 2)}
    return out


def _markdown(res: dict) -> str:
    rows = ["| model | dense saved MiB | dense ms | budget | budget MiB | max saved MiB | "
            "budget held | step time / dense | grad cosine min / median | mean bits |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        if name == "meta":
            continue
        for key, c in r.items():
            if key.startswith("dyn_"):
                rows.append(f"| {name} | {r['dense_saved_mib']} | {r['dense_ms']} | "
                            f"{float(key[4:]):.0%} | {c['budget_mib']} | {c['saved_mib_max']} "
                            f"| {c['budget_held_pct']} % | {c['time_ratio']} | "
                            f"{c['cos_min']} / {c['cos_median']} | {c['mean_bits']} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--fracs", default="0.12,0.2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fracs = [float(f) for f in args.fracs.split(",")]
    res = {}
    for arch, make, batch in (("resnet18", resnet18, 8), ("resnet50", resnet50, 4)):
        torch.manual_seed(0)
        res[f"{arch}_{args.res}px_b{batch}"] = bench(make(num_classes=10).train(), batch,
                                                     args.res, fracs, args.batches, args.warmup)
    res["meta"] = {"threads": args.threads, "batches": args.batches, "warmup": args.warmup,
                   "torch": torch.__version__, "device": "cpu"}
    print(json.dumps(res, indent=1))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dynamic_widths.json").write_text(json.dumps(res, indent=1) + "\n")
    (OUT / "dynamic_widths.md").write_text(_markdown(res))


if __name__ == "__main__":
    main()
