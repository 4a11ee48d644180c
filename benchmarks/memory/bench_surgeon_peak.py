"""SURGEON's step peak (importance pass included) against Tent's saved bytes, with the
process RSS rise of each step, the keep ratios of the cheap importance pass against the
official one's, the effect of the official BN gradient on its importances and keep ratios,
and (with --sweep) SURGEON's accuracy on the shift stream against Tent's.

Models (MODELS), all at --res px (224): the shipped trained ResNet-class cards,
checkpoints/resnet18_cifar_w32_signs64 (CIFAR-style ResNet-18, batch 8) and
checkpoints/resnet26_signs32c (CIFAR ResNet-26, batch 4, in ResNet-50's slot: no trained
ResNet-50 is shipped), and torchvision's ResNet-18 (batch 8) and ResNet-50 (batch 4), the
paper's architectures, with random weights (torch seed 0; no trained 224 px ones shipped).
Inputs: the first images of the continual shift stream (gaussian_noise, severity 5, seed
0) rendered at --res px, normalised with the card's mean/std (ImageNet's for torchvision).

Saved bytes are measured by the same storage-dedup ledger (tta_core.memory.accounting):
Tent (BN affine, dense saves) with a SavedActivationCounter around its step; SURGEON from
its codecs' ledgers (what they actually store: `peak_saved_bytes` = max of the importance
pass and the adaptation pass), second step. RSS rise (Tent and RSS_CONFIGS): in a fresh
interpreter per method and config (`--rss-child`), the peak RSS (VmHWM, reset after
building) of two steps above the RSS of the built method and its inputs (saved
activations, transient buffers, gradients and optimizer state together), under glibc's
default allocator settings and with a fixed 64 KiB mmap threshold (ALLOCATORS).
Configs (CONFIGS): surgeon (defaults: BN inputs centred-pruned, importance pass on one
random half-side crop at keep 0.01), surgeon with BN inputs dense (`prune_norm=False`),
surgeon with the official importance pass (10 samples, whole images, dense), surgeon (BN).
keep_vs_official: one importance pass with the defaults and one official (as above) on the
same batch and weights: largest and mean absolute change of keep_i over the layers.
bn_grad: one importance pass each with `bn_grad` exact and official (defaults otherwise):
largest relative change of G_i and of keep_i over the layers.
--sweep: a finished `tta sweep config/sweeps/surgeon_accuracy.yaml` (accuracy % per batch
size and method, mean ± 95 % t-interval over the seeds, paired difference to tent).
--merge-sweep: the same sweep section added to the existing JSON without measuring again.
Usage: python benchmarks/memory/bench_surgeon_peak.py [--threads 1] [--res 224]
       [--models NAME,...] [--sweep runs/sweep-surgeon_accuracy]
       python benchmarks/memory/bench_surgeon_peak.py --merge-sweep runs/sweep-surgeon_accuracy
Writes docs/results/surgeon_peak.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from torchvision import models

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.memory import SavedActivationCounter
from tta_core.memory.accounting import peak_rss_bytes, reset_peaks
from tta_core.memory.ledger import MIB
from tta_core.model.source import load_source
from tta_core.registry import build_method
from tta_core.surgeon.method import SurgeonConfig
from tta_core.sweep.aggregate import mean_ci, paired

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results"
OFFICIAL_IMPORTANCE = {"importance_samples": 10, "importance_keep": 1.0,
                       "importance_crop": 1.0, "importance_bits": None}
CONFIGS = {"surgeon": {}, "surgeon_dense_bn_inputs": {"prune_norm": False},
           "surgeon_official_importance": OFFICIAL_IMPORTANCE,
           "surgeon_bn": {"trainable": "norm"}}
# row prefix -> (a model card: trained weights, or a torchvision arch: random weights, batch)
MODELS = {"resnet18_cifar_w32_signs64": ("checkpoints/resnet18_cifar_w32_signs64.json", 8),
          "resnet26_signs32c": ("checkpoints/resnet26_signs32c.json", 4),
          "resnet18": ("resnet18", 8), "resnet50": ("resnet50", 4)}
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CORRUPTION = "gaussian_noise"
# acceptance: SURGEON's / SURGEON (BN)'s peak over Tent's, the importance pass's share of
# the step, and the accuracy gap to Tent (points)
BOUNDS = {"surgeon": 0.45, "surgeon_bn": 0.40, "importance_share": 0.10, "accuracy_gap": 0.5}
# RSS measurements: glibc's defaults, and a fixed 64 KiB mmap threshold (no heap retention)
ALLOCATORS = {"default": {}, "mmap_64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
RSS_CONFIGS = ("surgeon", "surgeon_bn")  # the configs whose RSS is measured (and Tent)
STATS_ONLY = "bn_adapt"  # the sweep's no-gradient reference (normalisation statistics only)
SWEEP_METHODS = {"surgeon": "surgeon", "surgeon@bn": "surgeon_bn"}


def _is_card(src: str) -> bool:
    return src.endswith(".json")


def _model(src: str) -> torch.nn.Module:
    """The card's trained model, or the torchvision arch with random weights (seed 0)."""
    if _is_card(src):
        return load_source(ROOT / src)[0]
    torch.manual_seed(0)
    return getattr(models, src)(num_classes=10)


def _inputs(src: str, batch: int, res: int) -> torch.Tensor:
    """The first `batch` images of the shift stream's first domain, at res px."""
    stream = build_stream(StreamSpec(image_size=res, samples_per_domain=batch,
                                     corruptions=(CORRUPTION,), seed=0))
    if _is_card(src):
        card = load_source(ROOT / src)[1]
        mean, std = tuple(card.mean), tuple(card.std)
    else:
        mean, std = IMAGENET
    return images_to_tensor(stream.images[:batch], mean, std)


def _rss_bytes() -> int:
    """The process's resident set size now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_child(src: str, batch: int, res: int, method: str, opts: dict) -> dict:
    """In this (fresh) process: the peak RSS of two steps above the RSS of the built
    method and its inputs, MiB (None where VmHWM can't be reset)."""
    x = _inputs(src, batch, res)
    meth = build_method(method, _model(src), memory_format="contiguous", **opts)
    gc.collect()
    before = _rss_bytes()
    ok = reset_peaks()
    meth.step(x)
    meth.step(x)
    rise = round((peak_rss_bytes() - before) / MIB, 1) if ok else None
    return {"rss_rise_mib": rise, "rss_built_mib": round(before / MIB, 1)}


def _rss(src: str, batch: int, res: int, method: str, opts: dict, threads: int) -> dict:
    """rss_child in a fresh interpreter (no other model's pages or allocator cache), under
    glibc's default allocator settings and with a fixed mmap threshold (MMAP_THRESHOLD:
    freed buffers go back to the system at once, so the peak shows what was live)."""
    spec = json.dumps({"src": src, "batch": batch, "res": res, "method": method,
                       "opts": opts})
    out = {}
    for name, extra in ALLOCATORS.items():
        run = subprocess.run([sys.executable, __file__, "--threads", str(threads),
                              "--rss-child", spec], check=True, capture_output=True,
                             text=True, env={**os.environ, **extra})
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def _tent(src: str, x: torch.Tensor) -> int:
    """Tent's saved bytes: a counter around its second step."""
    meth = build_method("tent", _model(src), memory_format="contiguous")
    meth.step(x)
    counter = SavedActivationCounter(meth.model)
    with counter:
        meth.step(x)
    return counter.result.total


def _surgeon(src: str, x: torch.Tensor, opts: dict, tent: int) -> dict:
    """One config's second-step figures (saved bytes from its codecs)."""
    meth = build_method("surgeon", _model(src), memory_format="contiguous", **opts)
    meth.step(x)
    s = meth.step(x).stats
    return {"importance_pass_mib": round(s["importance_saved_bytes"] / MIB, 2),
            "adaptation_pass_mib": round(s["saved_bytes"] / MIB, 2),
            "peak_mib": round(s["peak_saved_bytes"] / MIB, 2),
            "peak_over_tent": round(s["peak_saved_bytes"] / tent, 3),
            "importance_share": round(s["importance_saved_bytes"] / s["saved_bytes"], 4),
            "keep_mean": round(s["keep_mean"], 3), "keep_min": round(s["keep_min"], 4)}


def _bn_effect(src: str, x: torch.Tensor) -> dict:
    """Largest relative change of G_i and absolute change of keep_i, official vs exact."""
    imps = {}
    for mode in ("exact", "official"):
        meth = build_method("surgeon", _model(src), bn_grad=mode, lr=0.0,
                            memory_format="contiguous")
        imps[mode] = meth._importance_pass(x)[0]
    ex, of = imps["exact"], imps["official"]
    g = max(abs(of.gradient[n] - v) / v for n, v in ex.gradient.items() if v > 0)
    k = max(abs(of.keep[n] - v) for n, v in ex.keep.items())
    top = {m: max(i.importance, key=i.importance.get) for m, i in imps.items()}
    return {"max_rel_change_G": round(g, 3), "max_abs_change_keep": round(k, 3),
            "top_layer": top}


def _keep_vs_official(src: str, x: torch.Tensor) -> dict:
    """Largest and mean absolute change of keep_i: default importance pass vs official."""
    keeps = []
    for opts in ({}, OFFICIAL_IMPORTANCE):
        meth = build_method("surgeon", _model(src), lr=0.0, memory_format="contiguous",
                            **opts)
        keeps.append(meth._importance_pass(x)[0].keep)
    diff = [abs(keeps[0][n] - v) for n, v in keeps[1].items()]
    return {"max_abs_change_keep": round(max(diff), 3),
            "mean_abs_change_keep": round(sum(diff) / len(diff), 4),
            "keep_mean": {"default": round(sum(keeps[0].values()) / len(diff), 4),
                          "official": round(sum(keeps[1].values()) / len(diff), 4)}}


def bench(src: str, batch: int, res: int, threads: int) -> dict:
    """Every figure of one model at res px and its batch size."""
    x = _inputs(src, batch, res)
    tent = _tent(src, x)
    out: dict = {"source": src, "batch": batch, "res": res,
                 "weights": (f"trained ({src})" if _is_card(src)
                             else "random (torchvision init, torch seed 0)"),
                 "tent_saved_mib": round(tent / MIB, 2),
                 "tent_rss": _rss(src, batch, res, "tent", {}, threads)}
    for key, opts in CONFIGS.items():
        out[key] = _surgeon(src, x, opts, tent)
        if key in RSS_CONFIGS:
            out[key]["rss"] = _rss(src, batch, res, "surgeon", opts, threads)
    out["keep_vs_official"] = _keep_vs_official(src, x)
    out["bn_grad_official_vs_exact"] = _bn_effect(src, x)
    return out


def collect_sweep(sweep: Path) -> dict:
    """Per batch size and method of a finished sweep: accuracy % mean ± 95 % CI over the
    seeds and the paired difference to the sweep's baseline (tent)."""
    data = json.loads((sweep / "sweep.json").read_text())
    base = data.get("baseline", "tent")
    acc: dict[int, dict[str, dict[int, float]]] = {}
    for cell in data["cells"]:
        if cell.get("status") != "done":
            continue
        opt = cell["options"]
        for s in cell["summaries"]:
            acc.setdefault(int(opt["batch_size"]), {}).setdefault(s["method"], {})[
                int(opt["seed"])] = 100.0 * s["mean_accuracy"]
    rel = sweep.resolve()
    out: dict[str, Any] = {"sweep": rel.relative_to(ROOT).as_posix()
                           if rel.is_relative_to(ROOT) else str(sweep),
                           "spec": data.get("spec", ""), "baseline": base, "batch_sizes": {}}
    for bs in sorted(acc):
        rows = {}
        for method, runs in acc[bs].items():
            seeds = sorted(runs)
            ci = mean_ci([runs[k] for k in seeds])
            row = {"seeds": seeds, "accuracy": ci.mean, "accuracy_ci": ci.half_width}
            common = [k for k in seeds if k in acc[bs].get(base, {})]
            if method != base and len(common) >= 2:
                p = paired([runs[k] for k in common], [acc[bs][base][k] for k in common])
                row |= {"minus_base": p.diff.mean, "minus_base_ci": p.diff.half_width,
                        "p_value": p.p_value}
            stats_only = [k for k in seeds if k in acc[bs].get(STATS_ONLY, {})]
            if method != STATS_ONLY and len(stats_only) >= 2:
                q = paired([runs[k] for k in stats_only],
                           [acc[bs][STATS_ONLY][k] for k in stats_only])
                row |= {"minus_stats": q.diff.mean, "minus_stats_ci": q.diff.half_width}
            rows[method] = row
        out["batch_sizes"][str(bs)] = rows
    return out


def _pm(mean: float, half: float | None, fmt: str = ".1f") -> str:
    if half is None or half != half:  # NaN: one seed
        return f"{mean:{fmt}}"
    return f"{mean:{fmt}} ± {half:{fmt}}"


def _models(res: dict) -> dict[str, dict]:
    return {k: v for k, v in res.items() if k not in ("meta", "sweep", "provenance")}


def _peak_rows(res: dict) -> list[str]:
    rows = ["| model | weights | Tent MiB | config | importance pass MiB | adaptation pass MiB "
            "| peak MiB | peak / Tent | importance / adaptation |", "|---|---|---|---|---|---|"
            "---|---|---|"]
    for name, r in _models(res).items():
        weights = "trained" if r["weights"].startswith("trained") else "random"
        for key in CONFIGS:
            c = r[key]
            rows.append(f"| {name} | {weights} | {r['tent_saved_mib']} | {key} | "
                        f"{c['importance_pass_mib']} | {c['adaptation_pass_mib']} | "
                        f"{c['peak_mib']} | {c['peak_over_tent']} | "
                        f"{c['importance_share']} |")
    return rows


def _rss_rows(res: dict) -> list[str]:
    rows = ["| model | method | RSS rise MiB (glibc defaults) | / Tent's | RSS rise MiB "
            "(mmap threshold 64 KiB) | / Tent's | RSS of the built method MiB |",
            "|---|---|---|---|---|---|---|"]
    for name, r in _models(res).items():
        tent = r["tent_rss"]
        for key, c in (("tent", tent), *((k, r[k]["rss"]) for k in RSS_CONFIGS)):
            cells = []
            for alloc in ALLOCATORS:
                v, t = c[alloc]["rss_rise_mib"], tent[alloc]["rss_rise_mib"]
                cells += [str(v), str(round(v / t, 3)) if v is not None and t else "-"]
            rows.append(f"| {name} | {key} | " + " | ".join(cells)
                        + f" | {c['default']['rss_built_mib']} |")
    return rows


def _check_rows(res: dict) -> list[str]:
    """Acceptance per model: peak / Tent within BOUNDS and the importance pass's share."""
    rows = ["| model | SURGEON peak / Tent (<= {surgeon}) | SURGEON (BN) peak / Tent "
            "(<= {surgeon_bn}) | importance / adaptation, largest (<= {importance_share}) |"
            .format(**BOUNDS), "|---|---|---|---|"]
    for name, r in _models(res).items():
        share = max(r[k]["importance_share"] for k in ("surgeon", "surgeon_bn"))
        marks = [r["surgeon"]["peak_over_tent"] <= BOUNDS["surgeon"],
                 r["surgeon_bn"]["peak_over_tent"] <= BOUNDS["surgeon_bn"],
                 share <= BOUNDS["importance_share"]]
        vals = [r["surgeon"]["peak_over_tent"], r["surgeon_bn"]["peak_over_tent"], share]
        rows.append(f"| {name} | " + " | ".join(
            f"{v} {'yes' if ok else 'NO'}" for v, ok in zip(vals, marks, strict=True)) + " |")
    return rows


def _keep_rows(res: dict) -> list[str]:
    rows = ["| model | max abs. change of keep (default vs official importance pass) | "
            "mean abs. change | keep mean default | keep mean official |",
            "|---|---|---|---|---|"]
    for name, r in _models(res).items():
        k = r["keep_vs_official"]
        rows.append(f"| {name} | {k['max_abs_change_keep']} | {k['mean_abs_change_keep']} "
                    f"| {k['keep_mean']['default']} | {k['keep_mean']['official']} |")
    rows += ["", "| model | max rel. change of G (official vs exact BN grad) | "
             "max abs. change of keep |", "|---|---|---|"]
    for name, r in _models(res).items():
        b = r["bn_grad_official_vs_exact"]
        rows.append(f"| {name} | {b['max_rel_change_G']} | {b['max_abs_change_keep']} |")
    return rows


def _sweep_rows(sw: dict) -> list[str]:
    base, gap = sw["baseline"], BOUNDS["accuracy_gap"]
    lines = ["## Accuracy on the shift stream (`tta sweep "
             "config/sweeps/surgeon_accuracy.yaml`)", "",
             f"Sweep `{sw['sweep']}`: the shipped 32 px card (small_resnet_signs32), the 15 "
             "corruptions at severity 5 in a continual stream, 200 images each, one method "
             "per cell, each seed drawing its own images. Accuracy % mean ± 95 % t-interval "
             f"over the seeds; the differences to {base} and to {STATS_ONLY} (normalisation "
             "statistics alone, no gradient) paired by seed (p: t-test against "
             f"{base}; * p < 0.05); held: SURGEON at most {gap} points below {base}."
             + (f" Added by `{sw['added_by']}`." if sw.get("added_by") else ""), ""]
    for bs, rows in sw["batch_sizes"].items():
        lines += [f"### batch {bs}", "", f"| method | seeds | accuracy % | − {base} (points) "
                  f"| p | − {STATS_ONLY} (points) | held |", "|---|---:|---:|---:|---:|---:|---|"]
        for method, r in rows.items():
            has = "minus_base" in r
            diff = _pm(r["minus_base"], r["minus_base_ci"], ".2f") if has else "-"
            p = (f"{r['p_value']:.3f}{'*' if r['p_value'] < 0.05 else ''}"
                 if "p_value" in r else "-")
            stats = (_pm(r["minus_stats"], r["minus_stats_ci"], ".2f")
                     if "minus_stats" in r else "-")
            held = ("yes" if r["minus_base"] >= -gap else "NO") \
                if has and method in SWEEP_METHODS else "-"
            lines.append(f"| {method} | {len(r['seeds'])} | "
                         f"{_pm(r['accuracy'], r['accuracy_ci'])} | {diff} | {p} | {stats} | "
                         f"{held} |")
        lines.append("")
    return lines


def _markdown(res: dict) -> str:
    meta = res["meta"]
    rows = ["Saved bytes measured by one storage-dedup ledger: Tent's with a saved-tensor "
            "counter around its step (the same for Tent (original) and Tent (with "
            "reforward): a no-grad reforward saves nothing), SURGEON's by its codecs (what "
            "they store), second step; peak = max(importance pass, adaptation pass).",
            f"Weights: {meta['weights']}. Inputs: {meta['inputs']}. torch {meta['torch']}, "
            f"{meta['threads']} thread(s), {meta['device']}; options per config: "
            f"{json.dumps(meta['configs'])}; SURGEON defaults: {json.dumps(meta['defaults'])}.",
            "", "## Step peak against Tent", "", *_peak_rows(res), "", "## Acceptance", "",
            *_check_rows(res), "", "## Process memory (RSS)", "",
            "In a fresh process per method and config: the peak RSS of two steps above the "
            "RSS of the built method and its inputs: saved activations, transient "
            "forward/backward buffers, gradients and optimizer state (SURGEON's Adam moments "
            "cover every weight, Tent's only the BN affine parameters). Under glibc's "
            "defaults freed buffers below its (adaptive) mmap threshold stay in the heap, so "
            "the peak also shows what earlier steps freed; with a fixed 64 KiB threshold "
            "(MALLOC_MMAP_THRESHOLD_=65536) they go back at once.", "", *_rss_rows(res), "",
            "## Importance pass: cheap vs official, BN gradient", "",
            *_keep_rows(res)]
    if res.get("sweep"):
        rows += ["", *_sweep_rows(res["sweep"])]
    return "\n".join(rows).rstrip("\n") + "\n"


def merge_sweep(sweep: Path) -> None:
    """The page's JSON with `sweep`'s accuracy section added (or replaced)."""
    if not (sweep / "sweep.json").is_file():
        raise SystemExit(f"{sweep}/sweep.json not found: run "
                         "`tta sweep config/sweeps/surgeon_accuracy.yaml` first")
    res = json.loads((OUT / "surgeon_peak.json").read_text())
    res["sweep"] = collect_sweep(sweep) | {
        "added_by": f"python benchmarks/memory/bench_surgeon_peak.py --merge-sweep {sweep}"}
    harness.save("surgeon_peak", res, out=OUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--sweep", type=Path, default=None,
                    help="a finished sweep of config/sweeps/surgeon_accuracy.yaml to add")
    ap.add_argument("--merge-sweep", type=Path, default=None,
                    help="add a finished sweep to the existing page's JSON (no measuring; "
                         "the measurement's provenance kept)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child is not None:  # one RSS measurement in this fresh process
        torch.set_num_threads(args.threads)
        c = json.loads(args.rss_child)
        print(json.dumps(rss_child(c["src"], c["batch"], c["res"], c["method"], c["opts"])))
        return
    if args.merge_sweep is not None:
        merge_sweep(args.merge_sweep)
        return
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad or not names:
        raise SystemExit(f"--models: unknown {bad or names}; choose from {', '.join(MODELS)}")
    if args.sweep is not None and not (args.sweep / "sweep.json").is_file():
        raise SystemExit(f"{args.sweep}/sweep.json not found: run "
                         "`tta sweep config/sweeps/surgeon_accuracy.yaml` first")
    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {}
    for name in names:
        src, batch = MODELS[name]
        res[f"{name}_{args.res}px_b{batch}"] = bench(src, batch, args.res, args.threads)
        print(name, json.dumps(res[f"{name}_{args.res}px_b{batch}"]), flush=True)
    res["meta"] = {
        "threads": args.threads, "torch": torch.__version__, "device": "cpu",
        "weights": "trained for the model cards (checkpoints/*.safetensors), random "
                   "(torchvision init, torch seed 0) for torchvision's resnet18/resnet50: "
                   "no trained 224 px ResNet-18/50 is shipped",
        "inputs": f"the first images of the continual shift stream ({CORRUPTION}, severity "
                  f"5, seed 0) rendered at {args.res} px, normalised with the card's "
                  "mean/std (ImageNet's for torchvision)",
        "configs": CONFIGS,
        "defaults": {k: v for k, v in vars(SurgeonConfig()).items()
                     if k.startswith(("importance", "prune", "keep", "mode"))}}
    if args.sweep is not None:
        res["sweep"] = collect_sweep(args.sweep)
    harness.save("surgeon_peak", res, options=args, out=OUT)


if __name__ == "__main__":
    main()
