"""Like-for-like saved-activation memory: methods compared at the same updated units, so
what the codec saves (storage) and what the plan saves (fewer units, less graph) separate.

Per model (torchvision, random weights, 10 classes, 224 px: ResNet-18 batch 8, ResNet-50
batch 4), two unit sets: T = the BN units AdaShadow may update (Tent's, less any the
engine does not offer) and P = the units
AdaShadow's own planner picks on the first batch (default config). Rows:
  tent           every BN unit, dense saves          (the reference)
  tent+daf8      every BN unit, DAF 8-bit codec      (codec alone)
  tent@T         Tent restricted to T, when T is not every BN unit (AdaShadow's
                 candidates exclude some units)
  adashadow@T    AdaShadow engine, external plan = T (engine alone: graph floor, reuse)
  adashadow@T+8  the same with activation_bits 8
  adashadow      AdaShadow's own plan P, dense
  adashadow+8    plan P, activation_bits 8
  tent@P         Tent restricted to P (the other BN affines frozen), dense (plan alone)
  tent@P+daf8    Tent restricted to P, DAF 8-bit codec
Saved bytes: one step after one warm-up step, measured by the same storage-dedup ledger
(a SavedActivationCounter around the step for dense saves; the codec's own ledger,
`stats["saved_bytes"]`, when a codec stores them).
Usage: python benchmarks/memory/bench_like_for_like.py [--threads 1] [--res 224]
Writes docs/results/like_for_like.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch
from torch import nn
from torchvision.models import resnet18, resnet50

from tta_core.api import Plan
from tta_core.memory import SavedActivationCounter
from tta_core.memory.ledger import MIB
from tta_core.registry import build_method

OUT = Path(__file__).resolve().parents[2] / "docs" / "results"


def _saved(meth, x: torch.Tensor, plan: Plan | None = None) -> tuple[int, int]:
    """(saved bytes, units updated) of one step (after a warm-up step)."""
    step = (lambda: meth.step(x, plan)) if plan is not None else (lambda: meth.step(x))
    step()
    counter = SavedActivationCounter(meth.model)
    with counter:
        res = step()
    saved = res.stats.get("saved_bytes", counter.result.total)
    if meth.name == "tent":  # its count assumes every norm affine trains
        return int(saved), sum(any(p.requires_grad for p in m.parameters(recurse=False))
                               for m in meth.model.modules()
                               if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return int(saved), int(res.units_updated)


def _restrict(meth, units: set[str]) -> None:
    """Freeze the BN affines of Tent outside `units`."""
    for name, mod in meth.model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and name not in units:
            for p in mod.parameters(recurse=False):
                p.requires_grad_(False)


def _external(meth, units: set[str]) -> Plan:
    update = np.array([n in units for n in meth.unit_names], dtype=bool)
    return Plan(update, int(np.flatnonzero(update)[0]), 0.0, 0.0, float("inf"), 0.0, 0.0)


def bench(make, batch: int, res: int) -> dict:
    x = torch.randn(batch, 3, res, res, generator=torch.Generator().manual_seed(0))
    common = {"memory_format": "contiguous"}
    ada_opts = {"input_shape": (3, res, res), **common}
    own = build_method("adashadow", make(), **ada_opts)
    r = own.step(x)
    plan_units = {n for n, u in zip(own.unit_names, r.plan.update, strict=True) if u}
    all_bn = {n for n, m in own.model.named_modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    bn_units = {n for n, ok in zip(own.unit_names, own.trainable, strict=True)
                if ok and n in all_bn}  # the BN units AdaShadow may update
    rows: dict[str, tuple[int, int]] = {}
    rows["tent"] = _saved(build_method("tent", make(), **common), x)
    rows["tent+daf8"] = _saved(build_method("tent", make(), activation_bits=8, **common), x)
    if bn_units != all_bn:
        tent = build_method("tent", make(), **common)
        _restrict(tent, bn_units)
        rows["tent@T"] = _saved(tent, x)
    for bits, tag in ((None, ""), (8, "+8")):
        opts = {**ada_opts, **({"activation_bits": bits} if bits else {})}
        ada = build_method("adashadow", make(), **opts)
        rows[f"adashadow@T{tag}"] = _saved(ada, x, _external(ada, bn_units))
        rows[f"adashadow{tag}"] = _saved(build_method("adashadow", make(), **opts), x)
    for bits, tag in ((None, ""), (8, "+daf8")):
        tent = build_method("tent", make(), **({"activation_bits": bits} if bits else {}),
                            **common)
        _restrict(tent, plan_units)
        rows[f"tent@P{tag}"] = _saved(tent, x)
    ref = rows["tent"][0]
    return {"plan_units": sorted(plan_units), "bn_units": len(all_bn),
            "not_adashadow_candidates": sorted(all_bn - bn_units),
            "rows": {k: {"saved_mib": round(b / MIB, 2), "over_tent": round(b / ref, 4),
                         "units_updated": u} for k, (b, u) in rows.items()}}


def _markdown(res: dict) -> str:
    out = []
    for name, r in res.items():
        if name == "meta":
            continue
        out += [f"**{name}**: Tent updates {r['bn_units']} BN units; T = those AdaShadow may "
                f"update (not: {', '.join(r['not_adashadow_candidates']) or 'none'}); P = "
                f"{', '.join(r['plan_units'])} (AdaShadow's plan). Tent's saves are the "
                "same with or without the reforward (a no-grad forward saves nothing): / Tent "
                "is to Tent (original) and to Tent (with reforward) alike", "",
                "| config | units | saved MiB | / Tent |", "|---|---|---|---|"]
        out += [f"| {k} | {c['units_updated']} | {c['saved_mib']} | {c['over_tent']} |"
                for k, c in r["rows"].items()]
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--res", type=int, default=224)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def make(arch):
        def build() -> nn.Module:
            torch.manual_seed(0)
            return arch(num_classes=10)
        return build

    res = {f"resnet18_{args.res}px_b8": bench(make(resnet18), 8, args.res),
           f"resnet50_{args.res}px_b4": bench(make(resnet50), 4, args.res),
           "meta": {"threads": args.threads, "torch": torch.__version__, "device": "cpu"}}
    print(json.dumps(res, indent=1))
    harness.save("like_for_like", res, options=args, out=OUT)


if __name__ == "__main__":
    main()
