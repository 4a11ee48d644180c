"""Load-adaptive serving under a deadline below the master's forward (issue #22, Acceptance 3).

Streams the shipped shift stream through `tta bench`'s streaming schedule
(tta_core.eval.bench_stream.stream_method: the perception node's keep-latest queue and batching,
each method's measured step time) at rates whose batch deadline (batch / rate) is below
the gated master's measured forward, and prints per method and rate: frames answered in
time, strict and streaming accuracy, batches within their deadline, the sizes served.

Methods: `elastic` (load-adaptive: the largest surrogate whose predicted forward fits),
`elastic@master` (the same method with sizes (1.0,): master-only, adapting when it fits),
`bn_adapt` on the same gated master (master-only, no update), and optionally AdaShadow on
the ungated source (`--source-card`: it cannot decompose a gated master, and when the
forward misses the deadline it can only stop updating).

Every method is warmed up first as the perception node does (api.WarmsUp: elastic cuts its
surrogates and learns its times on noise before the stream).

Usage (README figures; a timing run wants a quiet machine):
    python benchmarks/speed/bench_elastic_streaming.py \\
        --model-card runs/elastic/r18_untrained_gates.json \\
        --deadline-x 0.8,0.7,0.6 --samples-per-domain 100 --batch-size 4 --threads 1
(runs/elastic/r18_untrained_gates.json: checkpoints/resnet18_cifar_w32_signs64.json through
tta_core.elasticdnn.gates.make_gated + save_gated, gates untrained; or a `tta train-elastic`
card such as checkpoints/small_resnet_signs32_elastic.json; --source-card
checkpoints/resnet18_cifar_w32_signs64.json adds AdaShadow on the ungated source.)
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch

from tta_core.eval.bench_config import BenchConfig
from tta_core.eval.bench_inputs import bench_inputs
from tta_core.eval.bench_stream import stream_method
from tta_core.model.source import load_card, load_model

MASTER_ONLY = {"elastic@master": {"sizes": (1.0,)}}


def master_forward_ms(model: torch.nn.Module, x: torch.Tensor, runs: int = 20) -> float:
    """Median no-grad forward of `model` on `x` (batch-statistics BN, in the memory format
    the methods choose: tta_core.model.memory_format "auto", as they run)."""
    from tta_core.model.memory_format import apply_memory_format
    from tta_core.model.norms import set_bn_mode

    apply_memory_format(model, "auto", tuple(x.shape[1:]), batch_stats=True)
    set_bn_mode(model, "batch")
    with torch.no_grad():
        return harness.repeat(lambda: model(x), runs).median


def row(name: str, hz: float, batch: int, summary, served: Counter) -> str:
    """One markdown row: method, rate, deadline, in time, strict, streaming, batches in
    time, sizes served (share of batches) and the share of batches that adapted."""
    n = max(summary.batches, 1)
    sizes = ", ".join(f"{k:g}: {100 * v / n:.0f}%" for k, v in sorted(
        ((k, v) for k, v in served.items() if isinstance(k, float)), reverse=True))
    return (f"| {name} | {hz:g} | {batch * 1000.0 / hz:.1f} | {100 * summary.answered:.1f} | "
            f"{100 * summary.strict:.1f} | {100 * summary.streaming:.1f} | "
            f"{100 * summary.deadline_met:.1f} | {sizes} | "
            f"{100 * served['adapted'] / n:.0f} |")


def stream_row(name: str, cfg: BenchConfig, model: torch.nn.Module, stream, hz: float) -> str:
    served: Counter = Counter()

    def count(res) -> None:
        served[float(res.stats.get("size", 1.0))] += 1
        served["adapted"] += int(res.adapted)

    summary = stream_method(name, model, stream, cfg, hz, on_step=count).summary
    return row(name, hz, cfg.batch_size, summary, served)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-card", type=Path, required=True, help="gated master's card")
    p.add_argument("--source-card", type=Path, default=None,
                   help="ungated source card: adds AdaShadow on it (same stream)")
    p.add_argument("--stream-hz", default="",
                   help="frame rates (Hz); default: from --deadline-x")
    p.add_argument("--deadline-x", default="0.8,0.6",
                   help="batch deadlines as multiples of the master's forward measured at "
                        "the start (a loaded machine's forward is not the idle one's)")
    p.add_argument("--samples-per-domain", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default="elastic,elastic@master,bn_adapt")
    a = p.parse_args(argv)
    methods = tuple(a.methods.split(","))
    cfg = BenchConfig(methods=methods, model_card=a.model_card, batch_size=a.batch_size,
                      samples_per_domain=a.samples_per_domain, threads=a.threads,
                      method_options={k: v for k, v in MASTER_ONLY.items() if k in methods})
    torch.set_num_threads(a.threads)
    _, fresh, stream = bench_inputs(cfg)
    fwd = master_forward_ms(fresh(), stream[0].x)
    rates = ([float(v) for v in a.stream_hz.split(",")] if a.stream_hz else
             [round(a.batch_size * 1000.0 / (float(r) * fwd), 1)
              for r in a.deadline_x.split(",")])
    frames = sum(len(b.labels) for b in stream)
    print(f"gated master {a.model_card}: forward {fwd:.2f} ms per batch of {a.batch_size} "
          f"(median, {a.threads} thread(s), the methods' memory format); {frames} frames; "
          "batch deadlines "
          + ", ".join(f"{h:g} Hz: {a.batch_size * 1000 / h:.1f} ms "
                      f"({a.batch_size * 1000 / h / fwd:.2f}x the forward)" for h in rates))
    print("\n| method | Hz | deadline ms/batch | frames in time % | strict % | streaming % | "
          "batches in time % | sizes served | adapted % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hz in rates:
        for name in methods:
            print(stream_row(name, cfg, fresh(), stream, hz), flush=True)
        if a.source_card is not None:
            src = BenchConfig(methods=("adashadow",), model_card=a.source_card,
                              batch_size=a.batch_size, samples_per_domain=a.samples_per_domain,
                              threads=a.threads)
            model = load_model(load_card(a.source_card), a.source_card.parent)
            print(stream_row("adashadow", src, model, stream, hz).replace(
                "| adashadow |", "| adashadow (ungated source) |"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
