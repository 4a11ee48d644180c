"""AdaShadow on the segmentation card: adapted share, budget, step against source inference.

The shipped LR-ASPP MobileNetV3 card over the ACDC-style conditions (fog -> night -> rain ->
snow, `--samples-per-domain` scenes each, continual), at the card's 128 x 256 and batch 2.
Per batch, in one process and round-robin (benchmarks/harness.py, the order rotated): the
source model's plain inference, bn_adapt's step and AdaShadow's step (its between-batch
work, `finish`, untimed: `tta bench` and the perception node run it in the frame gap).
Reported: AdaShadow's share of adapted batches and of batches within its budget sigma*T,
the units it updated (how many, on what share of batches, which), its phases, the step
over the source inference (per batch, and the medians' ratio), and each method's online
mIoU per condition (the logits it answered with), scored as `tta bench --task
segmentation` does.

    python benchmarks/speed/bench_seg_adashadow.py --threads 2 --samples-per-domain 24

`--clock wall` (default) times on perf_counter, as `tta bench`; `--clock cpu` on the
process's CPU time (every thread), `--clock thread` on the main thread's (what a loaded
machine's preemption does not inflate; with 2 threads the second thread's share is not
counted), for the harness and for AdaShadow's own phases and planning. The load average
before and after the run is recorded. Writes `docs/results/seg_adashadow.json` (another
clock: `seg_adashadow_<clock>.json`) and its page (`--out FILE`: that JSON file instead,
no page). `--sweep runs/sweep-seg_adashadow_bn` (a finished `tta sweep
config/sweeps/seg_adashadow_bn.yaml`) adds the accuracy of AdaShadow's BN-statistics rules
over three seeds, paired against its default.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "domains"))  # the sweep reader
import bench_segmentation as seg_pages
import harness
import numpy as np
import results
import torch
from tqdm import tqdm

from tta_core.api import PhaseClock, WarmsUp
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.segmentation import load_segmentation, mask_tensor
from tta_core.eval.miou import ConfusionMeter
from tta_core.eval.seg_bench import SegBenchConfig, method_options
from tta_core.model.source import load_source
from tta_core.registry import build_method

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "checkpoints" / "lraspp_mobilenet_v3_large_scenes.json"
METHODS = ("source", "bn_adapt", "adashadow")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", default=str(CARD))
    ap.add_argument("--data", default=f"acdc:{ROOT / 'data' / 'scenes'}")
    ap.add_argument("--samples-per-domain", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="batches not counted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu", "thread"), default="wall")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an adashadow option (JSON value), e.g. sigma=0.5")
    ap.add_argument("--out", default="", help="JSON file ('': docs/results/)")
    ap.add_argument("--sweep", type=Path, default=None,
                    help="a finished sweep of config/sweeps/seg_adashadow_bn.yaml to add")
    return ap.parse_args(argv)


def _median(v: list[float]) -> float:
    return round(statistics.median(v), 3) if v else float("nan")


def _options(sets: list[str]) -> dict:
    import json

    out = {}
    for kv in sets:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--set {kv!r}: expected KEY=VALUE")
        out[key] = json.loads(value)
    return out


def _cases(card, methods: dict, meters: dict) -> dict:
    """The round-robin's callables: each runs one batch (index i) and scores its logits."""
    def case(name: str):
        meth = methods[name]

        def run(item: tuple[torch.Tensor, torch.Tensor, str]):
            x, masks, dom = item
            if name == "source":
                with torch.no_grad():
                    logits = meth(x)
                res = None
            else:
                res = meth.step(x)
                logits = res.logits
            meters[name].setdefault(dom, ConfusionMeter(card.num_classes)).update(
                logits, masks)
            return res
        return run
    return {name: case(name) for name in methods}


def adashadow_summary(steps: list, unit_names: list[str]) -> dict:
    """Shares, units and phases of AdaShadow's counted steps."""
    n = len(steps)
    adapted = [r for r in steps if r.adapted]
    units = collections.Counter(r.units_updated for r in steps)
    which = collections.Counter(unit_names[i] for r in adapted
                                for i in np.flatnonzero(r.plan.update))
    reasons = collections.Counter(r.planning.no_room.split(":")[0] for r in steps
                                  if not r.adapted and r.planning.no_room)
    t, ta = [r.times for r in steps], [r.times for r in adapted]
    return {
        "batches": n, "adapted": len(adapted) / n,
        "within_budget": sum(r.times.total_ms <= r.budget_ms for r in steps) / n,
        "units_share": {str(k): v / n for k, v in sorted(units.items())},
        "units_updated": dict(which.most_common()),
        "no_room": dict(reasons.most_common(3)),
        "forward_ms": _median([x.forward_ms for x in t]),
        "plan_ms": _median([x.plan_ms for x in t]),
        "backward_ms": _median([x.backward_ms for x in ta]),
        "reforward_ms": _median([x.reforward_ms for x in ta]),
        "post_ms": _median([x.post_ms for x in t]),
        "budget_ms": _median([r.budget_ms for r in steps]),
    }


def run(a: argparse.Namespace) -> dict:
    torch.set_num_threads(a.threads)
    _, card = load_source(a.card)
    data = load_segmentation(a.data, "val", card.input_hw, a.samples_per_domain, (),
                             seed=a.seed)
    items = [(images_to_tensor(im, card.mean, card.std), mask_tensor(m), dom)
             for im, m, dom in data.batches(a.batch_size)]
    cfg = SegBenchConfig(model_card=Path(a.card), data=a.data, batch_size=a.batch_size,
                         seed=a.seed, method_options={"adashadow": _options(a.set)})
    torch.manual_seed(a.seed)
    methods = {"source": load_source(a.card)[0]}
    for name in METHODS[1:]:
        methods[name] = build_method(name, load_source(a.card)[0],
                                     **method_options(name, cfg, card))
        if isinstance(methods[name], WarmsUp):  # as a node at start and tta bench
            methods[name].warm_up(torch.randn_like(items[0][0]))
    meters: dict[str, dict[str, ConfusionMeter]] = {n: {} for n in METHODS}
    steps: list = []

    def seen(name: str, res, counted: bool) -> None:
        if name != "source":
            methods[name].finish()  # between batches, untimed (tta bench does the same)
        if name == "adashadow" and counted:
            steps.append(res)
    load0 = os.getloadavg()
    times = harness.round_robin(_cases(card, methods, meters),
                                inputs=items, warmup=a.warmup, rotate=True, on_result=seen,
                                clocks=(a.clock,), progress=lambda r: tqdm(r, desc="batches"))
    load1 = os.getloadavg()
    src, ada, bn = (times[n].ms for n in ("source", "adashadow", "bn_adapt"))
    ratios = [s / b for s, b in zip(ada, src, strict=True)]
    miou = {}
    for name, per in meters.items():
        doms = {d: m.scores(card.class_names).miou for d, m in per.items()}
        miou[name] = {**doms, "mean": sum(doms.values()) / len(doms)}
    return {
        "card": Path(a.card).name, "data": Path(a.data.partition(":")[2]).name,
        "input_hw": list(card.input_hw), "batch_size": a.batch_size, "threads": a.threads,
        "samples_per_domain": a.samples_per_domain, "clock": a.clock,
        "load_before": [round(v, 2) for v in load0], "load_after": [round(v, 2) for v in load1],
        "cpus": os.cpu_count(), "adashadow_options": _options(a.set),
        "ms": {n: times[n].stats() for n in METHODS},
        "step_over_source": {"per_batch_median": _median(ratios),
                             "per_batch_p90": round(harness.percentile(ratios, 90), 3),
                             "medians": round(statistics.median(ada) / statistics.median(src), 3),
                             "bn_adapt_medians": round(statistics.median(bn)
                                                       / statistics.median(src), 3)},
        "adashadow": adashadow_summary(steps, methods["adashadow"].unit_names),
        "miou": miou,
    }


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def render(data: dict) -> str:
    """The page: AdaShadow's shares and ratio, its phases, the units, mIoU per method."""
    s, r = data["adashadow"], data["step_over_source"]
    h, w = data["input_hw"]
    units = ", ".join(f"{k} units on {_pct(v)} %" for k, v in s["units_share"].items())
    lines = [
        f"Card `{data['card']}` on `{data['data']}` (ACDC-style conditions, "
        f"{data['samples_per_domain']} scenes each, continual), {h} x {w}, batch "
        f"{data['batch_size']}, {data['threads']} threads, {data['clock']} clock; source, "
        "bn_adapt and AdaShadow round-robin per batch in one process. Load average "
        f"(1/5/15 min) on {data['cpus']} CPUs: {data['load_before']} before, "
        f"{data['load_after']} after. AdaShadow options over its defaults: "
        f"`{data['adashadow_options'] or {}}`.", "",
        "| batches | adapted % | within budget % | step / source (per-batch median) | "
        "p90 | medians' ratio | bn_adapt / source |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['batches']} | {_pct(s['adapted'])} | {_pct(s['within_budget'])} | "
        f"{r['per_batch_median']:.3f} | {r['per_batch_p90']:.3f} | {r['medians']:.3f} | "
        f"{r['bn_adapt_medians']:.3f} |", "",
        f"Units updated per batch: {units}. Most updated: " + ", ".join(
            f"`{k}` ({v})" for k, v in list(s["units_updated"].items())[:6]) + ".", "",
        "AdaShadow's phases (medians, ms; backward and reforward over the adapted batches): "
        f"forward {s['forward_ms']:.1f}, plan {s['plan_ms']:.1f}, backward "
        f"{s['backward_ms']:.1f}, reforward {s['reforward_ms']:.1f}, between batches "
        f"{s['post_ms']:.1f}; budget sigma*T {s['budget_ms']:.1f}. Step medians: " + ", ".join(
            f"{n} {data['ms'][n]['median']:.1f}" for n in data["ms"]) + " ms.", ""]
    doms = [d for d in next(iter(data["miou"].values())) if d != "mean"]
    lines += ["| method | " + " | ".join(doms) + " | mean mIoU % |",
              "|---" + "|---:" * (len(doms) + 1) + "|"]
    for name, m in data["miou"].items():
        lines.append(f"| {name} | " + " | ".join(_pct(m[d]) for d in doms)
                     + f" | {_pct(m['mean'])} |")
    lines += ["", "Online mIoU: the predictions each method answered with while adapting, "
              "one pass over the conditions, one seed. bn_adapt / source is the clock's "
              "yardstick: bn_adapt's step is one forward on batch statistics, about an "
              "inference's work; far from 1 the load (above) dominates the times."]
    if data.get("sweep"):
        lines += ["", *render_sweep(data["sweep"])]
    return "\n".join(lines) + "\n"


def render_sweep(sw: dict) -> list[str]:
    """The sweep's table: mean mIoU per method and condition over the seeds, paired
    against adashadow's default."""
    runs, doms = sw["runs"], seg_pages.CONDITIONS
    keys = ["mean_miou", *(f"miou@{d}" for d in doms)]
    lines = [f"## BN statistics on segmentation over {len(runs['adashadow'])} seeds "
             f"(`{sw['sweep']}`)", "",
             f"{sw['samples_per_domain']} scenes per condition, {sw['rounds']} rounds, batch "
             f"{sw['batch_size']}, 1 thread per cell; mIoU % mean ± 95 % t-interval; the "
             "difference to adashadow paired by seed (t-test). Options over the "
             "defaults: " + "; ".join(f"{m} `{o}`" for m, o in sw["options"].items()
                                      if m.startswith("adashadow")) + ".", "",
             "| method | mean mIoU % | − adashadow (p) | " + " | ".join(doms) + " |",
             "|---|---:|---:|" + "---:|" * len(doms)]
    base = seg_pages._per_seed(runs, "adashadow", "mean_miou")
    for m in runs:
        vals = {k: seg_pages._per_seed(runs, m, k) for k in keys}
        diff = "" if m == "adashadow" else seg_pages._diff(vals["mean_miou"], base)
        lines.append(f"| {m} | {seg_pages._ci(vals['mean_miou'])} | {diff} | "
                     + " | ".join(seg_pages._ci(vals[f"miou@{d}"]) for d in doms) + " |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    if a.clock != "wall":
        clock = harness.CLOCKS[a.clock]
        PhaseClock.now = lambda self: clock()  # AdaShadow's phases and planning too
    data = run(a)
    if a.sweep is not None:
        sw = seg_pages._collect(a.sweep)
        at = a.sweep.relative_to(ROOT) if a.sweep.is_relative_to(ROOT) else a.sweep
        data["sweep"] = {**sw, "sweep": f"tta sweep config/sweeps/seg_adashadow_bn.yaml -> {at}"}
    print(render(data))
    if a.out:
        Path(a.out).write_text(results.dumps(data))
    else:
        stem = "seg_adashadow" + ("" if a.clock == "wall" else f"_{a.clock}")
        print(f"wrote {harness.save(stem, data, options=a)}")
    return data


if __name__ == "__main__":
    main()
