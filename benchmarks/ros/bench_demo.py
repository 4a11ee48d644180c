"""`tta demo` as a results page: runs the demo (the shipped sample bag through the three
ROS 2 nodes, source and AdaShadow) and keeps what README's demo section shows: per method
the accuracy per domain, how often it adapted and held its budget, the layers updated and
the gain over source. Writes docs/results/demo.{json,md} (and README's demo block through
`python benchmarks/results.py`).

    python benchmarks/ros/bench_demo.py [--max-frames N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness

KEEP = ("method", "n_frames", "n_batches", "accuracy", "mean_accuracy", "within_budget",
        "adapted")


def slim(report: dict) -> dict:
    """The figures README shows, out of a demo's report.json (no per-frame records)."""
    return {"summaries": [{k: s[k] for k in KEEP} for s in report["summaries"]],
            "gain_over_source": report["gain_over_source"],
            "layer_updates": {r["method"]: r["meta"]["layer_updates"] for r in report["runs"]
                              if r["meta"].get("layer_updates", {}).get("adapted")}}


def render(data: dict) -> str:
    """Per method: mean accuracy, adapted and in-budget shares; then AdaShadow's layers."""
    lines = ["| method | mean accuracy % | gain over source, points | adapted % of batches "
             "| within budget % |", "|---|---:|---:|---:|---:|"]
    for s in data["summaries"]:
        gain = data["gain_over_source"].get(s["method"], {}).get("mean")
        budget = s["within_budget"]
        lines.append(f"| {s['method']} | {100 * s['mean_accuracy']:.1f} | "
                     f"{'–' if gain is None else f'{gain:+.1f}'} | {100 * s['adapted']:.0f} | "
                     f"{'–' if budget is None else f'{100 * budget:.0f}'} |")
    for method, lu in data["layer_updates"].items():
        units = ", ".join(f"`{u}` {k}" for u, k in lu["units"].items())
        lines += ["", f"{method} updated {lu['units_updated_mean']:.1f} units per batch on "
                  f"{lu['adapted']} of {lu['batches']} batches; layers (batches): {units}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-frames", type=int, default=0, help="only the first N images")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "tta_core.cli", "demo", "--out", tmp]
        if args.max_frames:
            cmd += ["--max-frames", str(args.max_frames)]
        done = subprocess.run(cmd, check=False)
        if done.returncode != 0:
            return done.returncode
        data = slim(json.loads((Path(tmp) / "report.json").read_text()))
    path = harness.save("demo", data, options=args)
    print(render(data))
    print(f"wrote {path} and its page")
    return 0


if __name__ == "__main__":
    sys.exit(main())
