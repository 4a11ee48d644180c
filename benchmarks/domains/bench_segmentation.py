"""Segmentation TTA on the synthetic driving scenes, SURGEON's Table 2 protocol: the shipped
LR-ASPP card streamed fog -> night -> rain -> snow over several rounds without a reset,
batch 2, several seeds (config/sweeps/seg_table2.yaml, run by `tta sweep`); per method
the mean online mIoU and SURGEON's online error with 95 % CIs over seeds, the measured
cache (saved-activation MiB per update), the paired test against source, SURGEON's
acceptance (cache <= 0.45 x Tent's, mIoU within 1 point of Tent's), the mIoU per
condition and per round, and the card's clean mIoU.

    tta make-benchmark --scenes
    tta sweep config/sweeps/seg_table2.yaml --workers 1
    python benchmarks/domains/bench_segmentation.py [--sweep runs/sweep-seg_table2]

Writes docs/results/segmentation.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch

from tta_core.eval.seg_bench import SegBenchConfig, run_seg_bench
from tta_core.sweep.aggregate import mean_ci, paired

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "checkpoints" / "lraspp_mobilenet_v3_large_scenes.json"
CONDITIONS = ("fog", "night", "rain", "snow")
CACHE_RATIO = 0.45  # SURGEON's target: its cache at most this share of Tent's
MIOU_POINTS = 1.0  # ... with its mIoU within this many points of Tent's


def _pct(v: float | None) -> str:
    return "–" if v is None or math.isnan(v) else f"{100 * v:.1f}"


def _ci(values: list[float], k: float = 100) -> str:
    ci = mean_ci(values)
    if math.isnan(ci.mean):
        return "–"
    return f"{k * ci.mean:.1f}" + ("" if math.isnan(ci.half_width)
                                    else f" ± {k * ci.half_width:.1f}")


def _diff(values: list[float], base: list[float]) -> str:
    if not values or len(values) != len(base):
        return ""
    p = paired(values, base)
    return f"{100 * p.diff.mean:+.1f} (p {p.p_value:.3f})"


def _per_seed(runs: dict, method: str, key: str) -> list[float]:
    """`key` of `method` per seed, in seed order (the seeds every method ran)."""
    return [runs[method][s][key] for s in sorted(runs[method])]


def _main_table(data: dict) -> list[str]:
    runs = data["runs"]
    tent = _per_seed(runs, "tent", "cache_mib") if "tent" in runs else []
    lines = ["| method | mean mIoU % | online error % | Δ mIoU vs source (paired) | "
             "cache MiB | cache / Tent | cache peak MiB | ms / batch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    src = _per_seed(runs, "source", "mean_miou") if "source" in runs else []
    for m in runs:
        miou, cache = _per_seed(runs, m, "mean_miou"), _per_seed(runs, m, "cache_mib")
        ratio = (f"{sum(cache) / sum(tent):.2f}" if tent and sum(tent) > 0 else "–")
        lines.append(
            f"| {m} | {_ci(miou)} | {_ci(_per_seed(runs, m, 'online_error'))} | "
            f"{_diff(miou, src) if m != 'source' else ''} | {_ci(cache, 1)} | {ratio} | "
            f"{_ci(_per_seed(runs, m, 'cache_peak_mib'), 1)} | "
            f"{sum(_per_seed(runs, m, 'ms_per_batch')) / len(runs[m]):.0f} |")
    return lines


def _acceptance(data: dict) -> list[str]:
    runs = data["runs"]
    out = []
    if {"tent", "surgeon"} <= set(runs):
        cs, ct = (_per_seed(runs, m, "cache_mib") for m in ("surgeon", "tent"))
        ms, mt = (_per_seed(runs, m, "mean_miou") for m in ("surgeon", "tent"))
        ratio = sum(cs) / sum(ct)
        d = paired(ms, mt)
        within = abs(100 * d.diff.mean) <= MIOU_POINTS
        out.append(f"- SURGEON vs Tent: cache {ratio:.2f} x Tent's (target <= {CACHE_RATIO}: "
                   f"{'met' if ratio <= CACHE_RATIO else 'not met'}); mIoU "
                   f"{100 * d.diff.mean:+.2f} ± {100 * d.diff.half_width:.2f} points "
                   f"(paired p {d.p_value:.3f}; target within {MIOU_POINTS:g}: "
                   f"{'met' if within else 'not met'}).")
    if {"source", "bn_adapt"} <= set(runs):
        d = paired(_per_seed(runs, "bn_adapt", "mean_miou"),
                   _per_seed(runs, "source", "mean_miou"))
        out.append(f"- bn_adapt vs source: {100 * d.diff.mean:+.1f} ± "
                   f"{100 * d.diff.half_width:.1f} mIoU points, paired p {d.p_value:.2g} "
                   f"({'beats source, p < 0.05' if d.p_value < 0.05 and d.diff.mean > 0 else 'no significant gain'}).")  # noqa: E501
    return out


def _detail_tables(data: dict) -> list[str]:
    runs = data["runs"]
    lines = ["mIoU % per condition (mean over seeds and rounds):", "",
             "| method | " + " | ".join(CONDITIONS) + " |", "|---" * (len(CONDITIONS) + 1) + "|"]
    for m in runs:
        lines.append(f"| {m} | " + " | ".join(
            _ci(_per_seed(runs, m, f"miou@{c}")) for c in CONDITIONS) + " |")
    rounds = data["rounds"]
    lines += ["", "Mean mIoU % over the four conditions per round (Table 2's time stamps; "
              "mean over seeds):", "",
              "| method | " + " | ".join(f"round {r + 1}" for r in range(rounds)) + " |",
              "|---" * (rounds + 1) + "|"]
    for m, per_round in data["per_round"].items():
        lines.append(f"| {m} | " + " | ".join(_pct(v) for v in per_round) + " |")
    lines += ["", "Settings each method ran with (eval.seg_bench.SEG_SETTINGS unless set):", "",
              "| method | options |", "|---|---|"]
    lines += [f"| {m} | {', '.join(f'{k}={v}' for k, v in o.items()) or '-'} |"
              for m, o in data["options"].items()]
    return lines


def render(data: dict) -> str:
    """The results page (from the JSON alone)."""
    seeds = sorted({s for r in data["runs"].values() for s in r})
    head = [f"Card `{data['card']}` on `{data['data']}`: {data['rounds']} rounds of "
            f"{' -> '.join(CONDITIONS)} without a reset (CoTTA's ACDC protocol repeats 10; "
            "fewer here for CPU time), "
            f"{data['samples_per_domain']} images per condition, batch {data['batch_size']}, "
            f"seeds {', '.join(map(str, seeds))} (each draws the images and their order), "
            f"1 thread per cell (`{data['sweep']}`). Clean val mIoU (source, "
            f"`cityscapes:`, {data['clean_samples']} images): **{_pct(data['clean_miou'])} %**.",
            "", "Mean ± 95 % CI over seeds (Student t). Online error = 100 − mIoU of the "
            "predictions made while adapting, averaged over every (round, condition) "
            "(SURGEON §5.1). Cache = saved-activation MiB per update, measured (autograd's "
            "saves, plus what SURGEON's codec stored), mean over batches; peak adds "
            "SURGEON's importance pass. source and bn_adapt update nothing: they save "
            "nothing (SURGEON's table counts their forward's largest layer instead).", ""]
    return "\n".join([*head, *_main_table(data), "", *_acceptance(data), "",
                      *_detail_tables(data)]) + "\n"


def _collect(folder: Path) -> dict:
    """Per method and seed the sweep cell's figures, per round the online mIoU, options."""
    sweep = json.loads((folder / "sweep.json").read_text())
    runs: dict[str, dict[str, dict]] = {}  # method -> seed -> figures
    for cell in sweep["cells"]:
        if cell.get("status") != "done":
            continue
        for s in cell["summaries"]:
            runs.setdefault(s["method"], {})[str(cell["options"].get("seed", 0))] = s
    per_round: dict[str, list[list[float]]] = {}
    options: dict[str, dict] = {}
    for path in sorted(folder.glob("cells/*/bench/seg_bench.json")):
        rec = json.loads(path.read_text())
        for r in rec["results"]:
            means = [sum(d.values()) / len(d) for d in r["online_miou"]]
            per_round.setdefault(r["method"], []).append(means)
            options[r["method"]] = {k: v for k, v in r["options"].items() if k != "seed"}
    order = [m for m in dict.fromkeys(str(c["options"]["methods"]) for c in sweep["cells"])
             if m in runs]
    base = sweep["cells"][0]["options"]
    return {"runs": {m: runs[m] for m in order}, "options": {m: options.get(m, {}) for m in order},
            "per_round": {m: [sum(c) / len(c) for c in zip(*per_round[m], strict=True)]
                          for m in order if m in per_round},
            "rounds": int(base.get("rounds", 1)), "batch_size": int(base["batch_size"]),
            "samples_per_domain": int(base["samples_per_domain"]),
            "data": str(base["data"]).partition(":")[2], "card": str(base["model_card"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, default=ROOT / "runs" / "sweep-seg_table2",
                    help="the folder `tta sweep config/sweeps/seg_table2.yaml` wrote")
    ap.add_argument("--clean-samples", type=int, default=250)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    data = _collect(a.sweep)
    clean, _ = run_seg_bench(SegBenchConfig(
        model_card=ROOT / data["card"], data=f"cityscapes:{ROOT / data['data']}",
        methods=("source",), batch_size=data["batch_size"], threads=a.threads,
        samples_per_domain=a.clean_samples), progress=False)
    sweep = a.sweep.relative_to(ROOT) if a.sweep.is_relative_to(ROOT) else a.sweep
    report = {**data, "sweep": f"tta sweep config/sweeps/seg_table2.yaml -> {sweep}",
              "clean_miou": clean[0].miou["clean"], "clean_samples": a.clean_samples,
              "clean_class_iou": clean[0].class_iou["clean"]}
    print(render(report))
    print(f"wrote {harness.save('segmentation', report, options=a)}")


if __name__ == "__main__":
    main()
