"""Backward feedback on the real clock: measured / predicted backward with and without it.

The AdaShadow engine on small_resnet 32 px, batch 4, with a MAC profile whose backward
times are `--underpredict` x too small (the scenario of test_engine's
test_backward_feedback_learns_a_profile_that_underpredicts_the_backward, which checks the
arithmetic on a fake clock). For backward_feedback alpha 0 (off) and 0.5, per adapted
batch: measured backward ms / the plan's predicted backward ms; the median of the last
`--tail` batches, and the ratio off / on (how much closer the feedback brings the
prediction; the factor clips at 4). `tta predictor-bench` measures the same correction
under competing processes.

Usage: python benchmarks/speed/bench_backward_feedback.py [--batches 12] [--threads 2]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.adashadow.planning import UnitLayout, mac_profile
from tta_core.model.norms import set_bn_mode
from tta_core.model.units import decompose
from tta_core.model.zoo import build_model


def _staged():
    torch.manual_seed(0)
    model = build_model("small_resnet", 10)
    set_bn_mode(model, "batch")
    return decompose(model, (3, 32, 32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--tail", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--underpredict", type=float, default=20.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prof = mac_profile(UnitLayout.from_staged(_staged()), 1.0, 4)
    prof.w_ms, prof.x_ms = prof.w_ms / args.underpredict, prof.x_ms / args.underpredict
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 32, 32, generator=gen) * (1 + i % 3) for i in range(args.batches)]
    out: dict[str, dict] = {}
    for alpha in (0.0, 0.5):
        eng = AdaShadowEngine(_staged(), EngineConfig(
            sigma=0.9, backward_feedback=alpha, fixed_cost_feedback=0.0), profile=prof)
        ratios = []
        for x in xs:
            res = eng.step(x)
            if res.adapted:
                ratios.append(res.times.backward_ms / res.planning.predicted_backward_ms)
        eng.close()
        tail = ratios[-args.tail:]
        out[f"alpha_{alpha:g}"] = {
            "adapted_batches": len(ratios), "factor": round(eng.planning.backward_fb.factor, 4),
            "measured_over_predicted": [round(r, 3) for r in ratios],
            "median_tail": round(statistics.median(tail), 3) if tail else None}
    off, on = out["alpha_0"]["median_tail"], out["alpha_0.5"]["median_tail"]
    print(json.dumps({
        "model": "small_resnet 32 px, batch 4", "threads": args.threads,
        "underpredict": args.underpredict, **out,
        "median_tail_off_over_on": round(off / on, 3) if off and on else None,
    }, indent=2))


if __name__ == "__main__":
    main()
