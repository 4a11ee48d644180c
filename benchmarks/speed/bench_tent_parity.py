"""tta's tent against a reference Tent written here from the paper's algorithm.

The reference is Wang et al.'s Tent (ICLR 2021, Algorithm 1 and its code's CIFAR setting):
BatchNorm layers normalise by the batch's statistics (no running statistics), only their
affine parameters train, Adam at 1e-3 (betas 0.9 / 0.999), one step per batch on the
batch's mean prediction entropy, and the prediction is the pre-update forward's. It is
written in this file, not taken from the product, so the two are independent.

Against it, on the same model and the same batches, round-robin per batch (each method
steps batch k before any steps batch k+1; the order rotates), one thread:
- "tent (original)": tta's `tent` at its defaults (the published preset for the input
  scale: Adam 1e-3 at CIFAR scale; the prediction from the pre-update forward);
- "tent (with reforward)": `tent` with `reforward=True` (the forward-backward-reforward
  step AdaShadow's paper counts as Tent);
- source, bn_adapt and adashadow for scale.
Per method: median ms per batch, the ratio to the reference (per batch, then the median),
accuracy on the stream, and the share of predictions equal to the reference's.

    python benchmarks/speed/bench_tent_parity.py [--batch-sizes 16,64] [--samples-per-domain 200]
        [--sweep runs/sweep-tent_parity] [--label-sweep runs/sweep-adashadow_bn_rule]

With `--sweep` (a finished `tta sweep config/sweeps/tent_parity.yaml`: the same stream,
three seeds) the page adds the sweep's accuracy per batch size, mean ± 95 % t-interval
over the seeds, and each method's paired difference to tent (by seed, paired t-test);
with `--label-sweep` (a finished `tta sweep config/sweeps/adashadow_bn_rule.yaml`) the same
for robust BN's rules per order (Dirichlet, i.i.d.) and batch size, against adashadow.
Writes docs/results/tent_parity.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from torch import Tensor, nn
from tqdm import tqdm

from tta_core.eval.bench_config import BenchConfig, method_options
from tta_core.eval.bench_inputs import bench_inputs
from tta_core.registry import build_method
from tta_core.sweep.aggregate import mean_ci, paired

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = "reference Tent"
METHODS = {"source": ("source", {}), "bn_adapt": ("bn_adapt", {}),
           "tent (original)": ("tent", {}),
           "tent (with reforward)": ("tent", {"reforward": True}),
           "adashadow": ("adashadow", {}),
           # robust BN's batch-statistics rule by values per channel (off by default)
           "adashadow@batch_values": ("adashadow", {"bn_batch_values": 4096}),
           # robust BN's momentum per batch, as RoTTA (the default: per 8 frames)
           "adashadow@per_batch": ("adashadow", {"bn_momentum_batch": 0})}


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
    preds: dict[str, list[int]] = {n: [] for n in names}
    labels = [int(v) for b in stream for v in b.labels]
    times = harness.round_robin(
        steppers, warmup=0, inputs=[b.x for b in stream], rotate=True,
        on_result=lambda n, logits, _: preds[n].extend(logits.argmax(1).tolist()),
        progress=lambda rounds: tqdm(rounds, desc=f"batch {cfg.batch_size}",
                                     disable=not progress))
    ms = {n: t.ms for n, t in times.items()}
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


SWEEP_LABELS = {"tent": "tent (original)", "tent@reforward": "tent (with reforward)"}


def collect_sweep(sweep: Path, by_order: bool = False) -> dict:
    """Per batch size (per order and batch size with `by_order`) and method of a finished
    sweep: accuracy % mean ± 95 % CI over the seeds and the paired difference to the
    sweep's baseline."""
    data = json.loads((sweep / "sweep.json").read_text())
    base = data.get("baseline", "tent")
    acc: dict[str, dict[str, dict[int, float]]] = {}
    adapted: dict[tuple[str, str], list[float]] = {}
    cells = [c for c in data["cells"] if c.get("status") == "done"]
    cells.sort(key=lambda c: (c["options"].get("order", ""), -int(c["options"]["batch_size"])
                              if by_order else int(c["options"]["batch_size"])))
    for cell in cells:
        opt = cell["options"]
        group = (f"{opt['order']}, batch {opt['batch_size']}" if by_order
                 else str(int(opt["batch_size"])))
        for s in cell["summaries"]:
            acc.setdefault(group, {}).setdefault(s["method"], {})[
                int(opt["seed"])] = 100.0 * s["mean_accuracy"]
            adapted.setdefault((group, s["method"]), []).append(100.0 * s["adapted"])
    out: dict[str, Any] = {"sweep": Path(sweep).relative_to(ROOT).as_posix()
                           if Path(sweep).is_relative_to(ROOT) else str(sweep),
                           "baseline": base, "batch_sizes": {}}
    for group, methods in acc.items():
        rows = {}
        for method, runs in methods.items():
            seeds = sorted(runs)
            ci = mean_ci([runs[k] for k in seeds])
            shares = adapted[group, method]
            row = {"seeds": seeds, "accuracy": ci.mean, "accuracy_ci": ci.half_width,
                   "adapted": sum(shares) / len(shares)}
            common = [k for k in seeds if k in methods.get(base, {})]
            if method != base and len(common) >= 2:
                p = paired([runs[k] for k in common], [methods[base][k] for k in common])
                row |= {"minus_base": p.diff.mean, "minus_base_ci": p.diff.half_width,
                        "p_value": p.p_value}
            rows[method] = row
        out["batch_sizes"][group] = rows
    return out


def _pm(mean: float, half: float | None, fmt: str = ".1f") -> str:
    if half is None or half != half:  # NaN: one seed
        return f"{mean:{fmt}}"
    return f"{mean:{fmt}} ± {half:{fmt}}"


LABEL_SWEEP = ("## Robust BN's rules under label correlation (`tta sweep "
               "config/sweeps/adashadow_bn_rule.yaml`)",
               "the CIFAR-scale benchmark's 4 held-out corruptions at severity 5, 2,000 images "
               "each, Dirichlet delta 0.1 (a camera's stream: few classes for many frames) "
               "and i.i.d. within each corruption, one method per cell, seeds 0-2")


def render_sweep(sw: dict, title: str = "## Accuracy over three seeds (`tta sweep "
                 "config/sweeps/tent_parity.yaml`)",
                 stream: str = "the stream above, one method per cell, seeds 0-2") -> list[str]:
    """A sweep's section of the page."""
    base = SWEEP_LABELS.get(sw["baseline"], sw["baseline"])
    # source scores alike at every seed: the seeds streamed the same images
    same = all(rows.get("source", {}).get("accuracy_ci") == 0.0
               for rows in sw["batch_sizes"].values())
    seeds = ("the seeds streamed the same images (source scores alike at each): they vary "
             "what a method draws, and AdaShadow's plans, which follow the times it "
             "measures" if same else "each seed draws its own images")
    lines = [title, "", f"Sweep `{sw['sweep']}`: {stream}; {seeds}. Accuracy % mean ± 95 % "
             f"t-interval over the seeds; the difference to {base} paired by seed (t-test; "
             f"* p < 0.05).", ""]
    for group, rows in sw["batch_sizes"].items():
        head = f"batch {group}" if group.isdigit() else group
        lines += [f"### {head}", "", f"| method | seeds | accuracy % | − {base} "
                  "(points) | p | batches adapted % |", "|---|---:|---:|---:|---:|---:|"]
        for method, r in rows.items():
            diff = (_pm(r["minus_base"], r["minus_base_ci"], ".2f") if "minus_base" in r
                    else "-")
            p = (f"{r['p_value']:.3f}{'*' if r['p_value'] < 0.05 else ''}"
                 if "p_value" in r else "-")
            lines.append(f"| {SWEEP_LABELS.get(method, method)} | {len(r['seeds'])} | "
                         f"{_pm(r['accuracy'], r['accuracy_ci'])} | {diff} | {p} | "
                         f"{r['adapted']:.1f} |")
        lines.append("")
    return lines


def render(data: dict) -> str:
    """The page's markdown from the JSON this script writes."""
    lines = [f"Card `{data['card']}`, data `{data['data']}`, the 15 corruptions at severity "
             f"5 in a continual stream, {data['samples_per_domain']} images each, seed "
             f"{data['seed']}, {data['threads']} thread; every method on the same batches, "
             "round-robin per batch. Reference: Tent as its paper describes it, written in "
             "the benchmark (batch statistics, BN affine, Adam 1e-3, pre-update "
             "prediction). Tent (original) is tta's `tent` at its defaults (the CIFAR-scale "
             "preset: Adam 1e-3, the pre-update prediction); Tent (with reforward) is `tent` "
             "with `reforward=True`, the forward-backward-reforward AdaShadow's paper counts "
             "as Tent.", ""]
    for r in data["runs"]:
        lines += [f"## batch {r['batch_size']} ({r['batches']} batches)", "",
                  "| method | ms per batch (median) | × reference Tent | accuracy % | "
                  "same prediction as the reference % |", "|---|---:|---:|---:|---:|"]
        for n, m in r["methods"].items():
            lines.append(f"| {n} | {m['ms_median']:.2f} | {m['x_reference']:.3f} | "
                         f"{100 * m['accuracy']:.1f} | {100 * m['agreement']:.1f} |")
        lines.append("")
    if data.get("sweep"):
        lines += render_sweep(data["sweep"])
    if data.get("label_sweep"):
        lines += render_sweep(data["label_sweep"], *LABEL_SWEEP)
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
    ap.add_argument("--sweep", type=Path, default=None,
                    help="a finished sweep of config/sweeps/tent_parity.yaml to add")
    ap.add_argument("--label-sweep", type=Path, default=None,
                    help="a finished sweep of config/sweeps/adashadow_bn_rule.yaml to add")
    a = ap.parse_args()
    for sweep, spec in ((a.sweep, "tent_parity"), (a.label_sweep, "adashadow_bn_rule")):
        if sweep is not None and not (sweep / "sweep.json").is_file():
            raise SystemExit(f"{sweep}/sweep.json not found: run "
                             f"`tta sweep config/sweeps/{spec}.yaml` first")
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
    if a.sweep is not None:
        report["sweep"] = collect_sweep(a.sweep)
    if a.label_sweep is not None:
        report["label_sweep"] = collect_sweep(a.label_sweep, by_order=True)
    print(render(report))
    print(f"wrote {harness.save('tent_parity', report, options=a)}")


if __name__ == "__main__":
    main()
