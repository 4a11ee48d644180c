"""Segmentation TTA on the synthetic driving scenes: the shipped LR-ASPP card's clean mIoU
and its mIoU under fog, night, rain and snow (ACDC layout, continual in that order) for
source, bn_adapt and tent (tta_core.eval.seg_bench), with per-class IoU.

    tta make-benchmark --scenes data/scenes
    python benchmarks/domains/bench_segmentation.py [--samples-per-domain 250]

Writes docs/results/segmentation.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch

from tta_core.eval.seg_bench import SEG_METHODS, SegBenchConfig, run_seg_bench

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "checkpoints" / "lraspp_mobilenet_v3_large_scenes.json"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def render(data: dict) -> str:
    """The results page: clean and per-condition mIoU per method, then per-class IoU."""
    clean = data["clean"]["miou"].get("clean")
    runs = data["runs"]
    conds = list(runs[0]["miou"]) if runs else []
    lines = [f"Card `{data['card']}` on `{data['data']}` ({data['samples_per_domain'] or 'all'} "
             f"images per condition, batch {data['batch_size']}, {data['threads']} thread). "
             f"Clean val mIoU (source, `cityscapes:`): **{_pct(clean)} %**.", "",
             "| method | " + " | ".join(conds) + " | mean | Δ mean vs clean | ms / batch |",
             "|---" * (len(conds) + 4) + "|"]
    for r in runs:
        cells = " | ".join(_pct(r["miou"][c]) for c in conds)
        delta = "–" if clean is None else f"{100 * (r['mean_miou'] - clean):+.1f}"
        lines.append(f"| {r['method']} | {cells} | {_pct(r['mean_miou'])} | {delta} | "
                     f"{r['ms_per_batch']:.0f} |")
    lines += ["", "Per-class IoU % of source (clean, then each condition):", ""]
    src = next((r for r in runs if r["method"] == "source"), None)
    if src is not None:
        names = list(data["clean"]["class_iou"]["clean"])
        lines += ["| domain | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for dom, ious in [("clean", data["clean"]["class_iou"]["clean"]),
                          *src["class_iou"].items()]:
            lines.append(f"| {dom} | " + " | ".join(_pct(ious.get(n)) for n in names) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", type=Path, default=CARD)
    ap.add_argument("--scenes", default="data/scenes")
    ap.add_argument("--samples-per-domain", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    common = {"model_card": a.card, "batch_size": a.batch_size, "threads": a.threads,
              "samples_per_domain": a.samples_per_domain}
    clean, _ = run_seg_bench(SegBenchConfig(data=f"cityscapes:{a.scenes}", methods=("source",),
                                            **common), progress=not a.no_progress)
    runs, _ = run_seg_bench(SegBenchConfig(data=f"acdc:{a.scenes}", methods=SEG_METHODS,
                                           **common), progress=not a.no_progress)
    card = a.card.relative_to(ROOT).as_posix() if a.card.is_relative_to(ROOT) else str(a.card)
    report = {"card": card, "data": a.scenes, "samples_per_domain": a.samples_per_domain,
              "batch_size": a.batch_size, "threads": a.threads, "clean": asdict(clean[0]),
              "runs": [asdict(r) for r in runs]}
    print(render(report))
    print(f"wrote {harness.save('segmentation', report, options=a)}")


if __name__ == "__main__":
    main()
