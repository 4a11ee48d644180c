"""SURGEON's step peak (importance pass included) against Tent's saved bytes, the keep
ratios of the cheap importance pass against the official one's, and the effect of the
official BN gradient on its importances and keep ratios.

Per model (torchvision, 10 classes, 224 px): ResNet-18 batch 8, ResNet-50 batch 4. Weights
are random (torch seed 0): no trained 224 px ResNet-18/50 is shipped (checkpoints/ holds
32/64 px CIFAR-style nets). Saved bytes are measured by the same storage-dedup ledger: Tent
(BN affine, dense saves) with a SavedActivationCounter around its step; SURGEON from its
codecs' stats (`peak_saved_bytes` = max of the importance pass and the adaptation pass),
second step. Configs (CONFIGS): surgeon (defaults: BN inputs centred-pruned, importance
pass on one random half-side crop at keep 0.01), surgeon with BN inputs dense
(`prune_norm=False`, as before), surgeon with the official importance pass (10 samples,
whole images, dense), surgeon (BN).
keep_vs_official: one importance pass with the defaults and one official (as above) on the
same batch and weights: largest and mean absolute change of keep_i over the layers.
bn_grad: one importance pass each with `bn_grad` exact and official (defaults otherwise):
largest relative change of G_i and of keep_i over the layers.
Usage: python benchmarks/memory/bench_surgeon_peak.py [--threads 1] [--res 224]
Writes docs/results/surgeon_peak.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from torchvision.models import resnet18, resnet50

from tta_core.memory import SavedActivationCounter
from tta_core.memory.ledger import MIB
from tta_core.registry import build_method
from tta_core.surgeon.method import SurgeonConfig

OFFICIAL_IMPORTANCE = {"importance_samples": 10, "importance_keep": 1.0,
                       "importance_crop": 1.0, "importance_bits": None}
CONFIGS = {"surgeon": {}, "surgeon_dense_bn_inputs": {"prune_norm": False},
           "surgeon_official_importance": OFFICIAL_IMPORTANCE,
           "surgeon_bn": {"trainable": "norm"}}
OUT = Path(__file__).resolve().parents[2] / "docs" / "results"


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return {"resnet18": resnet18, "resnet50": resnet50}[arch](num_classes=10)


def _tent_bytes(arch: str, x: torch.Tensor) -> int:
    meth = build_method("tent", _model(arch), memory_format="contiguous")
    counter = SavedActivationCounter(meth.model)
    with counter:
        meth.step(x)
    return counter.result.total


def _bn_effect(arch: str, x: torch.Tensor) -> dict:
    """Largest relative change of G_i and absolute change of keep_i, official vs exact."""
    imps = {}
    for mode in ("exact", "official"):
        meth = build_method("surgeon", _model(arch), bn_grad=mode, lr=0.0,
                            memory_format="contiguous")
        imps[mode] = meth._importance_pass(x)[0]
    ex, of = imps["exact"], imps["official"]
    g = max(abs(of.gradient[n] - v) / v for n, v in ex.gradient.items() if v > 0)
    k = max(abs(of.keep[n] - v) for n, v in ex.keep.items())
    top = {m: max(i.importance, key=i.importance.get) for m, i in imps.items()}
    return {"max_rel_change_G": round(g, 3), "max_abs_change_keep": round(k, 3),
            "top_layer": top}


def _keep_vs_official(arch: str, x: torch.Tensor) -> dict:
    """Largest and mean absolute change of keep_i: default importance pass vs official."""
    keeps = []
    for opts in ({}, OFFICIAL_IMPORTANCE):
        meth = build_method("surgeon", _model(arch), lr=0.0, memory_format="contiguous",
                            **opts)
        keeps.append(meth._importance_pass(x)[0].keep)
    diff = [abs(keeps[0][n] - v) for n, v in keeps[1].items()]
    return {"max_abs_change_keep": round(max(diff), 3),
            "mean_abs_change_keep": round(sum(diff) / len(diff), 4),
            "keep_mean": {"default": round(sum(keeps[0].values()) / len(diff), 4),
                          "official": round(sum(keeps[1].values()) / len(diff), 4)}}


def bench(arch: str, batch: int, res: int) -> dict:
    x = torch.randn(batch, 3, res, res, generator=torch.Generator().manual_seed(0))
    tent = _tent_bytes(arch, x)
    out: dict = {"tent_saved_mib": round(tent / MIB, 2)}
    for key, opts in CONFIGS.items():
        meth = build_method("surgeon", _model(arch), memory_format="contiguous", **opts)
        meth.step(x)
        s = meth.step(x).stats
        out[key] = {"importance_pass_mib": round(s["importance_saved_bytes"] / MIB, 2),
                    "adaptation_pass_mib": round(s["saved_bytes"] / MIB, 2),
                    "peak_mib": round(s["peak_saved_bytes"] / MIB, 2),
                    "peak_over_tent": round(s["peak_saved_bytes"] / tent, 3),
                    "keep_mean": round(s["keep_mean"], 3), "keep_min": round(s["keep_min"], 4)}
    out["keep_vs_official"] = _keep_vs_official(arch, x)
    out["bn_grad_official_vs_exact"] = _bn_effect(arch, x)
    return out


def _markdown(res: dict) -> str:
    meta = res["meta"]
    rows = ["Tent MiB: what Tent's update saves for its backward, the same for Tent (original) "
            "and Tent (with reforward) (a no-grad reforward saves nothing).",
            f"Weights: {meta['weights']}. torch {meta['torch']}, {meta['threads']} thread(s), "
            f"{meta['device']}; options per config: {json.dumps(meta['configs'])}.", "",
            "| model | Tent MiB | config | importance pass MiB | adaptation pass MiB | "
            "peak MiB | peak / Tent |", "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        if name == "meta":
            continue
        for key in CONFIGS:
            c = r[key]
            rows.append(f"| {name} | {r['tent_saved_mib']} | {key} | "
                        f"{c['importance_pass_mib']} | {c['adaptation_pass_mib']} | "
                        f"{c['peak_mib']} | {c['peak_over_tent']} |")
    rows += ["", "| model | max abs. change of keep (default vs official importance pass) | "
             "mean abs. change | keep mean default | keep mean official |",
             "|---|---|---|---|---|"]
    for name, r in res.items():
        if name != "meta":
            k = r["keep_vs_official"]
            rows.append(f"| {name} | {k['max_abs_change_keep']} | {k['mean_abs_change_keep']} "
                        f"| {k['keep_mean']['default']} | {k['keep_mean']['official']} |")
    rows += ["", "| model | max rel. change of G (official vs exact BN grad) | "
             "max abs. change of keep |", "|---|---|---|"]
    for name, r in res.items():
        if name != "meta":
            b = r["bn_grad_official_vs_exact"]
            rows.append(f"| {name} | {b['max_rel_change_G']} | {b['max_abs_change_keep']} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--res", type=int, default=224)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = {f"resnet18_{args.res}px_b8": bench("resnet18", 8, args.res),
           f"resnet50_{args.res}px_b4": bench("resnet50", 4, args.res),
           "meta": {"threads": args.threads, "torch": torch.__version__, "device": "cpu",
                    "weights": "random (torchvision init, torch seed 0); no trained 224 px "
                               "ResNet-18/50 is shipped", "configs": CONFIGS,
                    "defaults": {k: v for k, v in vars(SurgeonConfig()).items()
                                 if k.startswith(("importance", "prune", "keep", "mode"))}}}
    print(json.dumps(res, indent=1))
    harness.save("surgeon_peak", res, options=args, out=OUT)


if __name__ == "__main__":
    main()
