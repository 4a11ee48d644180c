"""AdaShadow's batch time when no unit fits the budget, against bn_adapt (issue #18).

When no plan can fit, AdaShadow updates nothing and should cost what bn_adapt costs (a
forward with batch-statistics BN), no more: goal <= 1.05x bn_adapt. Runs on the shipped
small net (checkpoints/small_resnet_signs32.json) over the `tta bench` stream (continual,
severity 5), batch 16, 1 thread, and times per batch what `tta bench` times (step +
argmax). Variants, all built once and run round-robin per batch (the order rotates every
round, so machine load and order hit all of them alike):
  * bn_adapt;
  * adashadow_sigma: sigma tiny (--sigma), no unit fits sigma*T;
  * adashadow_deadline: fixed deadline below the forward (--deadline-ms), the forward alone
    misses it.
Prints JSON, for the wall time and for the thread's CPU time (robust to other processes
on a shared machine): median ms per variant, the ratios of medians to bn_adapt and the
median of the per-round ratios (each round: the median batch time of every variant over
the same batches).
Usage: python benchmarks/speed/bench_empty_plan_overhead.py [--rounds 30] [--batch-size 16]
(`--variants bn_adapt,adashadow_sigma` runs on code without deadline modes, for a before/after.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch

from tta_core.eval.bench_config import DEFAULT_CARD, BenchConfig
from tta_core.eval.bench_inputs import build_stream
from tta_core.model.source import load_source
from tta_core.registry import build_method
from tta_core.runtime.malloc_tuning import keep_freed_memory

VARIANTS = ("bn_adapt", "adashadow_sigma", "adashadow_deadline")
WHAT = ("walls", "cpus")


def _variants(card: Path, shape: tuple[int, ...], sigma: float, deadline_ms: float,
              keys: tuple[str, ...]) -> dict:
    opts = {"input_shape": shape}
    specs = {"bn_adapt": ("bn_adapt", {}),
             "adashadow_sigma": ("adashadow", {"sigma": sigma}),
             "adashadow_deadline": ("adashadow", {"deadline_mode": "fixed",
                                                  "deadline_ms": deadline_ms})}
    out = {}
    for key in keys:
        name, cfg = specs[key]
        torch.manual_seed(0)
        out[key] = build_method(name, load_source(card)[0], **opts, **cfg)
    return out


def _time_round(methods: dict, xs: list[torch.Tensor], order: list[str]) -> dict:
    adapted = {k: 0 for k in methods}

    def answer(method, x: torch.Tensor):
        res = method.step(x)
        res.logits.argmax(1)
        return res

    def note(key: str, res, _counted: bool) -> None:
        adapted[key] += bool(res.adapted)

    t = harness.round_robin({k: (lambda x, m=methods[k]: answer(m, x)) for k in order},
                            warmup=0, inputs=xs, clocks=("wall", "thread"), on_result=note)
    return {"walls": {k: t[k].times["wall"] for k in methods},
            "cpus": {k: t[k].times["thread"] for k in methods}, "adapted": adapted}


def _ratios(per_round: dict[str, list[float]], pooled: dict[str, list[float]]) -> dict:
    """Ratios to bn_adapt: of the pooled medians and the median of the per-round ones."""
    base = statistics.median(pooled["bn_adapt"])
    return {"median_ms": {k: round(statistics.median(v), 4) for k, v in pooled.items()},
            "ratio_to_bn_adapt": {k: round(statistics.median(v) / base, 4)
                                  for k, v in pooled.items() if k != "bn_adapt"},
            "ratio_to_bn_adapt_per_round_median": {
                k: round(statistics.median(a / b for a, b in zip(
                    v, per_round["bn_adapt"], strict=True)), 4)
                for k, v in per_round.items() if k != "bn_adapt"}}


def main(argv: list[str] | None = None) -> dict:
    keep_freed_memory()  # as the tta CLI
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batches", type=int, default=20, help="batches per round")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sigma", type=float, default=0.01)
    ap.add_argument("--deadline-ms", type=float, default=0.5)
    ap.add_argument("--model-card", type=Path, default=DEFAULT_CARD)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list out of " + ",".join(VARIANTS) + " (bn_adapt always)")
    args = ap.parse_args(argv)
    keys = tuple(dict.fromkeys(["bn_adapt", *(v.strip() for v in args.variants.split(",")
                                              if v.strip())]))
    if set(keys) - set(VARIANTS):
        ap.error(f"--variants {args.variants!r}: unknown {sorted(set(keys) - set(VARIANTS))}")
    torch.set_num_threads(args.threads)
    cfg = BenchConfig(batch_size=args.batch_size, samples_per_domain=4 * args.batch_size,
                      model_card=args.model_card)
    _, card = load_source(args.model_card)
    stream = [b.x for b in build_stream(cfg, card) if len(b.x) == args.batch_size]
    xs = (stream * (1 + args.batches // max(len(stream), 1)))[:args.batches]
    methods = _variants(args.model_card, tuple(xs[0].shape[1:]), args.sigma, args.deadline_ms,
                        keys)
    _time_round(methods, xs, list(keys))  # warm-up
    rounds: dict[str, dict[str, list[float]]] = {w: {k: [] for k in keys} for w in WHAT}
    pooled: dict[str, dict[str, list[float]]] = {w: {k: [] for k in keys} for w in WHAT}
    adapted = {k: 0 for k in keys}
    for r in range(args.rounds):
        order = list(keys[r % len(keys):] + keys[:r % len(keys)])
        out = _time_round(methods, xs, order)
        for what in WHAT:
            for k in keys:
                rounds[what][k].append(statistics.median(out[what][k]))
                pooled[what][k].extend(out[what][k])
        for k in keys:
            adapted[k] += out["adapted"][k]
    report = {
        "model_card": str(args.model_card), "batch_size": args.batch_size,
        "threads": args.threads, "rounds": args.rounds, "batches_per_round": len(xs),
        "sigma": args.sigma, "deadline_ms": args.deadline_ms, "batches_adapted": adapted,
        # wall time per batch (what `tta bench` reports) and the thread's CPU time (not
        # inflated by other processes on a shared machine; 1 torch thread = this thread)
        "wall": _ratios(rounds["walls"], pooled["walls"]),
        "cpu": _ratios(rounds["cpus"], pooled["cpus"]),
    }
    for m in methods.values():
        m.close()
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
