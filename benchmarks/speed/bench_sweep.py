"""`tta sweep` on a local Ray with 2 workers against the sequential loop of the same
`tta bench` commands, on the same machine, and the README's accuracy table from a sweep.

Speed-up (default): a 16-cell grid (methods source, bn_adapt, tent, eata x batch 4, 16 x
seeds 0, 1; shipped 32 px card, --samples-per-domain N, 1 thread per cell). First the
sequential loop (one `python -m tta_core.cli bench ...` process per cell, one at a time),
then `tta sweep` of the same cells (one process, Ray started by it, --workers 2), each cell
computed (fresh folders, no cache); between them, the same cells one after another in this
process (no start-up per cell: the part of the speed-up that is parallelism). Figures:
the wall times, their ratios, the load average around each; every cell's per-method
figures compared with its sequential run (asserted identical for deterministic methods).
    python benchmarks/speed/bench_sweep.py [--samples 32] [--workers 2]
Writes docs/results/sweep_speedup.{json,md}.

README table (--readme): the report of a finished `tta sweep config/sweeps/readme.yaml`
(default folder runs/sweep-readme) as docs/results/sweep_readme.{json,md}.
    tta sweep config/sweeps/readme.yaml && python benchmarks/speed/bench_sweep.py --readme
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import results
import yaml

GRID = {"methods": ["source", "bn_adapt", "tent", "eata"], "batch-size": [4, 16],
        "seed": [0, 1]}
#: methods whose result is a function of the inputs (1 thread, fixed seed)
DETERMINISTIC = ("source", "bn_adapt", "tent", "eata")
FIGURES = ("n_frames", "mean_accuracy", "overall_accuracy")


def _tta(*args: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tta_core.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"tta {' '.join(args)} failed: {proc.stderr.strip()[-500:]}")


def _figures(summaries: list[dict]) -> dict[str, dict]:
    return {s["method"]: {k: s[k] for k in FIGURES} for s in summaries}


def _in_process(cells: list, out: Path) -> float:
    """The same cells one after another in this process (no process start per cell): the
    part of the speed-up that is parallelism alone."""
    from tta_core.cli.commands import bench
    from tta_core.sweep.run import BenchCLI, run_cell

    cli = BenchCLI(bench.add_arguments, bench.config_from_args)
    run_cell(cli, cells[0].argv(), str(out / "warm"), str(results.ROOT))  # imports, caches
    with harness.Stopwatch() as sw:
        for i, cell in enumerate(cells):
            res = run_cell(cli, cell.argv(), str(out / str(i)), str(results.ROOT))
            assert res["status"] == "done", res.get("error")
    return sw.s


def speedup(samples: int, workers: int) -> dict:
    """Sequential loop, then the sweep; wall times, loads, per-cell comparison."""
    sys.path.insert(0, str(results.ROOT))
    from tta_core.cli.commands import bench
    from tta_core.sweep.run import BenchCLI
    from tta_core.sweep.spec import parse_spec

    spec_raw = {"name": "speedup", "base": {"samples-per-domain": samples, "threads": 1},
                "grid": GRID}
    cells = parse_spec(spec_raw, BenchCLI(bench.add_arguments,
                                          bench.config_from_args).options()).cells()
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        work = Path(tmp)
        load0 = os.getloadavg()
        seq = []
        with harness.Stopwatch() as sw:
            for i, cell in enumerate(cells):
                out = work / "seq" / str(i)
                _tta("bench", *cell.argv(), "--out", str(out), "--no-progress",
                     cwd=results.ROOT)
                seq.append(_figures(json.loads((out / "report.json").read_text())["summaries"]))
        seq_s = sw.s
        inproc_s = _in_process(cells, work / "inproc")
        load1 = os.getloadavg()
        spec = work / "speedup.yaml"
        spec.write_text(yaml.safe_dump(spec_raw, sort_keys=False))
        with harness.Stopwatch() as sw:
            _tta("sweep", str(spec), "--out", str(work / "sweep"), "--workers", str(workers),
                 "--no-progress", cwd=results.ROOT)
        sweep_s = sw.s
        load2 = os.getloadavg()
        swept = {tuple(c["argv"]): c for c in
                 json.loads((work / "sweep" / "sweep.json").read_text())["cells"]}
    rows, identical = [], True
    for cell, ref in zip(cells, seq, strict=True):
        got = swept[tuple(cell.argv())]
        assert got["status"] == "done", got.get("error")
        mine = _figures(got["summaries"])
        same = mine == ref
        identical &= same or cell.method not in DETERMINISTIC
        rows.append({"argv": cell.argv(), "method": cell.method, "identical": same,
                     "sequential": ref[cell.method], "sweep": mine[cell.method]})
    assert identical, [r for r in rows if not r["identical"]]
    return {"cells": len(cells), "samples_per_domain": samples, "workers": workers,
            "cores": os.cpu_count(), "sequential_s": seq_s, "sweep_s": sweep_s,
            "ratio": seq_s / sweep_s, "in_process_s": inproc_s,
            "ratio_in_process": inproc_s / sweep_s,
            "load_1min": {"before": load0[0], "after_sequential": load1[0],
                          "after_sweep": load2[0]},
            "identical_cells": sum(r["identical"] for r in rows), "rows": rows}


def render_speedup(data: dict) -> str:
    """Wall times and ratio, the load, and the per-cell comparison."""
    load = data["load_1min"]
    lines = [f"{data['cells']} cells (`tta bench` on the shipped 32 px card, "
             f"--samples-per-domain {data['samples_per_domain']}, 1 thread per cell) on a "
             f"{data['cores']}-core machine shared with other jobs (1-min load average "
             f"{load['before']:.1f} before, {load['after_sequential']:.1f} after the loop, "
             f"{load['after_sweep']:.1f} after the sweep).", "",
             "| run | wall s |", "|---|---:|",
             f"| sequential loop of `tta bench` processes | {data['sequential_s']:.1f} |",
             f"| `tta sweep`, local Ray, {data['workers']} workers (Ray start included) | "
             f"{data['sweep_s']:.1f} |",
             f"| **speed-up** | **{data['ratio']:.2f}×** |",
             f"| same cells one after another in one process (no start-up per cell) | "
             f"{data['in_process_s']:.1f} |",
             f"| speed-up from parallelism alone | {data['ratio_in_process']:.2f}× |", "",
             "The loop pays a process start (Python, torch, the card) per cell; the sweep's "
             "Ray workers pay it once each and then take cell after cell.", "",
             f"Per-cell figures identical to the sequential run: {data['identical_cells']} of "
             f"{data['cells']} cells (asserted for {', '.join(DETERMINISTIC)}).", "",
             "| cell | mean accuracy, sequential | sweep |", "|---|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| `{' '.join(r['argv'])}` | {r['sequential']['mean_accuracy']:.4f} | "
                     f"{r['sweep']['mean_accuracy']:.4f} |")
    return "\n".join(lines) + "\n"


def _cell(rows: dict, method: str, metric: str) -> str:
    r = rows.get((method, metric))
    if r is None:
        return "–"
    ci, text = r["ci"], f"{100 * r['ci']['mean']:.1f}"
    if ci["half_width"] is not None and not math.isnan(ci["half_width"]):
        text += f" ± {100 * ci['half_width']:.1f}"
    return text


def _diff(rows: dict, method: str, metric: str) -> str:
    vs = (rows.get((method, metric)) or {}).get("vs_baseline")
    if not vs:
        return ""
    hw = vs["half_width"]
    text = f"{100 * vs['diff']:+.1f}"
    if hw is not None and not math.isnan(hw):
        text += f" ± {100 * hw:.1f}"
    return text + (f" {vs['marker']}" if vs["marker"] else "")


def render_readme(data: dict) -> str:
    """One row per method: mean accuracy and streaming accuracy per rate, mean ± 95 % CI
    over seeds, and the paired difference to the baseline in mean accuracy."""
    rows = {(r["method"], r["metric"]): r for r in data["rows"]}
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    rates = sorted({r["metric"].split("@")[1] for r in data["rows"]
                    if r["metric"].startswith("streaming@")}, key=lambda h: float(h[:-2]))
    base = data["baseline"]
    head = ["method", "mean accuracy %", f"Δ accuracy vs {base}"]
    head += [f"streaming @ {h} %" for h in rates]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in methods:
        vals = [_cell(rows, m, "mean_accuracy"), _diff(rows, m, "mean_accuracy")]
        vals += [_cell(rows, m, f"streaming@{h}") for h in rates]
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    seeds = sorted({r["ci"]["n"] for r in data["rows"]})
    lines += ["", f"{data['description']} Mean ± 95 % confidence interval over "
              f"{'/'.join(map(str, seeds))} seeds (Student t); Δ: paired difference by seed "
              f"to {base}, `*` p < 0.05 (paired t-test). "
              f"Spec: `{data['spec']}`."]
    return "\n".join(lines) + "\n"


def readme(folder: Path, spec: str) -> dict:
    """The finished readme sweep's rows, base options and spec, for the results page."""
    report = json.loads((folder / "sweep.json").read_text())
    cells = report["cells"]
    done = [c for c in cells if c.get("status") == "done"]
    if not done or len(done) < len(cells):
        raise SystemExit(f"{folder}: {len(cells) - len(done)} of {len(cells)} cells not done")
    raw = yaml.safe_load((results.ROOT / spec).read_text()) if (results.ROOT / spec).is_file() \
        else {}
    base = {k: v for k, v in done[0]["options"].items() if k not in ("methods", "seed")}
    desc = ("Shipped 32 px card, continual stream, "
            + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in base.items()) + ".")
    conditions = {json.dumps(r["condition"], sort_keys=True) for r in report["rows"]}
    if len(conditions) != 1:
        raise SystemExit(f"{folder}: README's table takes one condition, the sweep has "
                         f"{len(conditions)}")
    return {"name": report["name"], "baseline": report["baseline"], "spec": spec,
            "spec_base": raw.get("base", {}), "options": base, "description": desc,
            "cells": len(cells), "rows": report["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32, help="--samples-per-domain per cell")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--readme", action="store_true",
                    help="write the README table's page from a finished readme sweep")
    ap.add_argument("--sweep-dir", type=Path, default=results.ROOT / "runs" / "sweep-readme")
    ap.add_argument("--spec", default="config/sweeps/readme.yaml")
    args = ap.parse_args()
    if args.readme:
        path = harness.save("sweep_readme", readme(args.sweep_dir, args.spec), options=args)
    else:
        data = speedup(args.samples, args.workers)
        print(f"sequential {data['sequential_s']:.1f} s, in-process {data['in_process_s']:.1f}"
              f" s, sweep {data['sweep_s']:.1f} s, ratio {data['ratio']:.2f}x (in-process "
              f"{data['ratio_in_process']:.2f}x), load {data['load_1min']}")
        path = harness.save("sweep_speedup", data, options=args)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
