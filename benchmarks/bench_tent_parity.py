"""tta's tent against a reference Tent written here from the paper's algorithm.

The reference is Wang et al.'s Tent (ICLR 2021, Algorithm 1 and its code's CIFAR setting):
BatchNorm layers normalise by the batch's statistics (no running statistics), only their
affine parameters train, Adam at 1e-3 (betas 0.9 / 0.999), one step per batch on the
batch's mean prediction entropy, and the prediction is the pre-update forward's. It is
written in this file, not taken from the product, so the two are independent.

Against it, on the same model and the same batches, round-robin per batch (each method
steps batch k before any steps batch k+1; the order rotates), one thread:
- tta's `tent` at its defaults (SGD, the reforward of the updated model as the prediction:
  the forward-backward-reforward step AdaShadow's paper counts);
- `tent` with `reforward=False` (the prediction from the pre-update forward, as the
  original);
- source, bn_adapt and adashadow for scale.
Per method: median ms per batch, the ratio to the reference (per batch, then the median),
accuracy on the stream, and the share of predictions equal to the reference's.

    python benchmarks/bench_tent_parity.py [--batch-sizes 16,64] [--samples-per-domain 200]

Writes docs/results/tent_parity.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import results
import torch
from torch import Tensor, nn
from tqdm import tqdm

from tta_core.eval.bench import BenchConfig, bench_inputs, method_options
from tta_core.registry import build_method

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "reference Tent"
METHODS = {"source": ("source", {}), "bn_adapt": ("bn_adapt", {}), "tent": ("tent", {}),
           "tent reforward=False": ("tent", {"reforward": False}),
           "adashadow": ("adashadow", {})}


class ReferenceTent:
    """Tent as its paper describes it (module docstring); `step` returns the logits."""

    def __init__(self, model: nn.Module, lr: float = 1e-3) -> None:
        self.model = model.train().requires_grad_(False)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.requires_grad_(True)
                m.track_running_stats, m.running_mean, m.running_var = False, None, None
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)

    def step(self, x: Tensor) -> Tensor:
        out = self.model(x)
        loss = -(out.softmax(1) * out.log_softmax(1)).sum(1).mean(0)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return out.detach()


def run(cfg: BenchConfig, progress: bool) -> dict[str, Any]:
    """Every method over the stream, round-robin per batch."""
    _, fresh, stream = bench_inputs(cfg)
    shape = tuple(stream[0].x.shape[1:])
    steppers: dict[str, Any] = {REFERENCE: ReferenceTent(fresh()).step}
    for label, (name, extra) in METHODS.items():
        opts = {**method_options(name, cfg, shape), **extra}
        meth = build_method(name, fresh(), **opts)
        steppers[label] = lambda x, m=meth: m.step(x).logits
    names = list(steppers)
    ms: dict[str, list[float]] = {n: [] for n in names}
    preds: dict[str, list[int]] = {n: [] for n in names}
    labels: list[int] = []
    for k, b in enumerate(tqdm(stream, desc=f"batch {cfg.batch_size}", disable=not progress)):
        order = names[k % len(names):] + names[:k % len(names)]
        for n in order:
            t0 = time.perf_counter()
            logits = steppers[n](b.x)
            ms[n].append((time.perf_counter() - t0) * 1e3)
            preds[n] += logits.argmax(1).tolist()
        labels += [int(v) for v in b.labels]
    ref = preds[REFERENCE]
    rows = {}
    for n in names:
        ratio = statistics.median(a / r for a, r in zip(ms[n], ms[REFERENCE], strict=True))
        rows[n] = {"ms_median": statistics.median(ms[n]), "x_reference": ratio,
                   "accuracy": sum(p == y for p, y in zip(preds[n], labels, strict=True))
                   / len(labels),
                   "agreement": sum(p == q for p, q in zip(preds[n], ref, strict=True))
                   / len(ref)}
    return {"batch_size": cfg.batch_size, "batches": len(stream), "frames": len(labels),
            "methods": rows}


def render(data: dict) -> str:
    """The page's markdown from the JSON this script writes."""
    lines = [f"Card `{data['card']}`, data `{data['data']}`, the 15 corruptions at severity "
             f"5 in a continual stream, {data['samples_per_domain']} images each, seed "
             f"{data['seed']}, {data['threads']} thread; every method on the same batches, "
             "round-robin per batch. Reference: Tent as its paper describes it, written in "
             "the benchmark (batch statistics, BN affine, Adam 1e-3, pre-update "
             "prediction). tta's `tent` at its defaults predicts from the reforward of the "
             "updated model (SGD at lr 5e-3 for batch 64, linearly scaled).", ""]
    for r in data["runs"]:
        lines += [f"## batch {r['batch_size']} ({r['batches']} batches)", "",
                  "| method | ms per batch (median) | × reference Tent | accuracy % | "
                  "same prediction as the reference % |", "|---|---:|---:|---:|---:|"]
        for n, m in r["methods"].items():
            lines.append(f"| {n} | {m['ms_median']:.2f} | {m['x_reference']:.3f} | "
                         f"{100 * m['accuracy']:.1f} | {100 * m['agreement']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", default=str(ROOT / "checkpoints" / "resnet26_signs32c.json"))
    ap.add_argument("--data", default="cifar10c:data/signs32c")
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--samples-per-domain", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    report: dict[str, Any] = {"card": Path(a.card).relative_to(ROOT).as_posix()
                              if Path(a.card).is_relative_to(ROOT) else a.card,
                              "data": a.data, "samples_per_domain": a.samples_per_domain,
                              "seed": a.seed, "threads": a.threads, "runs": []}
    for bs in (int(v) for v in a.batch_sizes.split(",")):
        cfg = BenchConfig(methods=("source", "bn_adapt", "tent", "adashadow"),
                          batch_size=bs, model_card=Path(a.card),
                          samples_per_domain=a.samples_per_domain, seed=a.seed,
                          threads=a.threads, data=a.data)
        report["runs"].append(run(cfg, not a.no_progress))
    print(render(report))
    print(f"wrote {results.save('tent_parity', report)}")


if __name__ == "__main__":
    main()
