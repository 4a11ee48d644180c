"""ElasticDNN surrogate: forward time against the master, accuracy after adaptation.

(a) speed: torchvision ResNet-18 (random weights, 1000 classes), 224 px, batch 4, eval mode,
    no grad. Rows: the dense net (ungated), the gated master (sparsity 0, gates computed),
    the surrogate at keep 0.3 (cut from the first image), each in NCHW and in channels_last
    (NHWC: what methods run on this CPU, tta_core.model.memory_format; oneDNN runs the
    surrogate's odd channel counts slowly in NCHW). Median forward over round-robin
    interleaved repeats (each round runs every model once, in rotating order), at 1 torch
    thread and at torch's default. Goal: surrogate / master <= 0.5.
(b) accuracy: the gated small net (`tta train-elastic`, checkpoints/
    small_resnet_signs32_elastic.json) on the shipped stream (continual, 15 corruptions,
    severity 5, seed 0; tta_core.eval.bench_inputs.build_stream), batch 16, prediction before each
    update (original Tent order). Every row normalises with batch statistics (BN in train
    mode) and updates with SHOT's information-maximisation loss, SGD momentum 0.9:
      master, no update            the full master (sparsity 0, per-sample gates)
      master adapted (BN affine)   Tent-like: every BN gamma/beta of the full master
      surrogate 0.3, no update     re-cut every `period` batches from the batch's highest-
                                   entropy sample (ElasticDNN's representative sample)
      surrogate 0.3 + filters      + the filter-grained update (80 % of the BN-gradient
                                   mass, scored on the first batch of the period) and
                                   write-back into the master before each re-cut
    Goal: the adapted surrogate within 3 points of the adapted master.
Usage: python benchmarks/speed/bench_elastic.py [--part a|b|both] [--repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from torch import Tensor, nn
from torchvision.models import resnet18

from tta_core.elasticdnn.filter_update import (
    filter_optimizer,
    filter_scores,
    im_loss,
    mask_gradients,
    select_filters,
    write_back,
)
from tta_core.elasticdnn.gates import GatedModel, load_gated, make_gated
from tta_core.elasticdnn.surrogate import extract_surrogate, highest_entropy_sample
from tta_core.eval.bench_config import BenchConfig
from tta_core.eval.bench_inputs import build_stream
from tta_core.model.source import load_card

CARD = Path("checkpoints/small_resnet_signs32_elastic.json")


@dataclass
class StreamRun:
    """One adaptation protocol over the stream."""

    name: str
    accuracy: float
    seconds: float


def interleaved_ms(models: dict[str, nn.Module], x: Tensor, repeats: int) -> dict[str, float]:
    """Median forward time (ms) per model over `repeats` rounds; round r runs the models
    in an order rotated by r, so drift of the machine's load hits them alike."""
    with torch.no_grad():
        times = harness.round_robin({n: (lambda m=m: m(x)) for n, m in models.items()},
                                    repeats, rotate=True)
    return {n: t.median for n, t in times.items()}


def part_a(repeats: int, keep: float) -> None:
    torch.manual_seed(0)
    master = make_gated(resnet18(weights=None)).eval()
    x = torch.randn(4, 3, 224, 224)
    sur = extract_surrogate(master, x[:1], keep)
    base = {"dense resnet18": master.plain_base().eval(), "gated master": master,
            f"surrogate {keep:g}": sur.model.eval()}
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in base.items()}
    params["gated master"] = sum(p.numel() for p in master.base.parameters())
    # each model in both memory formats (tta_core.model.memory_format: methods run the
    # faster one); ratios compare within a format
    models = {f"{n} [{tag}]": copy.deepcopy(m).to(memory_format=fmt) for tag, fmt in
              (("nchw", torch.contiguous_format), ("nhwc", torch.channels_last))
              for n, m in base.items()}
    default = torch.get_num_threads()
    print(f"(a) forward, torchvision resnet18, 224 px, batch 4, eval mode, median of "
          f"{repeats} interleaved rounds; ratio to the gated master in the same format")
    print(f"{'model':<24} {'params':>9} " + " ".join(
        f"{f'{t} thr ms':>10} {'ratio':>6}" for t in (1, default)))
    rows = {}
    for threads in (1, default):
        torch.set_num_threads(threads)
        rows[threads] = interleaved_ms(models, x, repeats)
    torch.set_num_threads(default)
    for n in models:
        ref = "gated master [" + n.rsplit("[", 1)[1]
        cells = " ".join(f"{rows[t][n]:>10.1f} {rows[t][n] / rows[t][ref]:>6.2f}"
                         for t in (1, default))
        print(f"{n:<24} {params[n.rsplit(' [', 1)[0]] / 1e6:>8.2f}M {cells}")


def _bn_affine(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, nn.BatchNorm2d)
            for p in (m.weight, m.bias)]


def run_master(master: GatedModel, stream, lr: float, adapt: bool) -> float:
    """Accuracy of the full master over the stream (BN batch statistics), with a Tent-like
    IM update of every BN gamma/beta when `adapt`."""
    m = copy.deepcopy(master).train()
    for p in m.parameters():
        p.requires_grad_(False)
    params = _bn_affine(m.base)
    for p in params:
        p.requires_grad_(adapt)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9) if adapt else None
    hits = total = 0
    for x, y in stream:
        with torch.set_grad_enabled(adapt):
            logits = m(x)
        hits += int((logits.argmax(1) == y).sum())
        total += len(y)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
            im_loss(logits).backward()
            opt.step()
    return hits / total


def run_surrogate(master: GatedModel, stream, keep: float, period: int, lr: float,
                  mass: float, adapt: bool) -> float:
    """Accuracy of surrogates at `keep`, re-cut every `period` batches (module doc)."""
    master = copy.deepcopy(master).eval()
    hits = total = 0
    sur = opt = None
    for i, (x, y) in enumerate(stream):
        if i % period == 0:
            if sur is not None and adapt:
                write_back(master, sur)
            sur = extract_surrogate(master, highest_entropy_sample(master, x), keep)
            sur.model.train()
            if adapt:
                mask_gradients(sur, select_filters(filter_scores(sur, x), mass))
                opt = filter_optimizer(sur, lr)
            else:
                for p in sur.model.parameters():
                    p.requires_grad_(False)
        logits = sur.model(x)
        hits += int((logits.argmax(1) == y).sum())
        total += len(y)
        if adapt:
            opt.zero_grad(set_to_none=True)
            im_loss(logits).backward()
            opt.step()
    return hits / total


def part_b(card_path: Path, keep: float, period: int, lr: float, mass: float,
           samples: int) -> None:
    master = load_gated(card_path)
    card = load_card(card_path)
    cfg = BenchConfig(batch_size=16, samples_per_domain=samples, seed=0)
    stream = [(b.x, torch.as_tensor(b.labels)) for b in build_stream(cfg, card)]
    runs = []
    protocols = [
        ("master, no update", lambda: run_master(master, stream, lr, False)),
        ("master adapted (BN affine, IM)", lambda: run_master(master, stream, lr, True)),
        (f"surrogate {keep:g}, no update",
         lambda: run_surrogate(master, stream, keep, period, lr, mass, False)),
        (f"surrogate {keep:g} + filters + write-back",
         lambda: run_surrogate(master, stream, keep, period, lr, mass, True)),
    ]
    for name, fn in protocols:
        with harness.Stopwatch() as sw:
            acc = fn()
        runs.append(StreamRun(name, acc, sw.s))
    n = sum(len(y) for _, y in stream)
    print(f"\n(b) accuracy after adaptation, {card_path.name}, continual stream, severity 5, "
          f"{n} images, batch 16, lr {lr:g}, re-cut every {period} batches, mass {mass:g}")
    print(f"{'protocol':<40} {'accuracy':>8} {'seconds':>8}")
    for r in runs:
        print(f"{r.name:<40} {100 * r.accuracy:>7.1f}% {r.seconds:>8.1f}")
    gap = 100 * (runs[1].accuracy - runs[3].accuracy)
    print(f"adapted master - adapted surrogate: {gap:+.1f} points (goal <= 3)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("a", "b", "both"), default="both")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--keep", type=float, default=0.3)
    ap.add_argument("--card", type=Path, default=CARD)
    ap.add_argument("--period", type=int, default=8, help="batches per surrogate")
    ap.add_argument("--lr", type=float, default=1.25e-3,
                    help="SGD lr (tent's 5e-3 at batch 64, scaled to 16)")
    ap.add_argument("--mass", type=float, default=0.8)
    ap.add_argument("--samples-per-domain", type=int, default=200)
    args = ap.parse_args()
    if args.part in ("a", "both"):
        part_a(args.repeats, args.keep)
    if args.part in ("b", "both"):
        part_b(args.card, args.keep, args.period, args.lr, args.mass, args.samples_per_domain)


if __name__ == "__main__":
    main()
