"""Gate scope of the ElasticDNN master (issue #31): block-internal convs vs every conv.

tta gates only block-internal convs (tta_core.elasticdnn.gates, scope "block"); the authors'
code gates every conv (scope "all"). Both masters start from the trained gated master
`--gated-card` (the block gates copied; scope "all"'s extra gates fresh, identity) and get
the same short fine-tuning: `--steps` sandwich-rule steps (tta_core.elasticdnn.train.
sandwich_loss, max sparsity `--s-max`, gates by Adam, base by SGD) on clean training signs,
then the BN running statistics re-estimated. Measured on held-out clean signs, BN on batch
statistics (as test-time adaptation serves):

- accuracy of the master at sparsity 1 - keep (per-sample gates), and of the surrogate cut
  for keep from the highest-entropy validation sample (scope "all": its extra gates fixed
  at that sample's values, tta_core.elasticdnn.gates.fold_extra_gates);
- forward ms of one batch (`--batch-eval`, one thread, the fastest of `--reps`,
  interleaved) of each master and surrogate.

Scope "all" before fine-tuning is reported too (its extra gates untrained: ties among
equal gates decide which channels survive). With `--all-card` (a scope-"all" master trained
by `tta train-elastic --gate-scope all`, saved as a card) both cards are also measured as
shipped, without fine-tuning (rows "..., trained cards").

    nice -n 19 python benchmarks/speed/bench_gate_scope.py --results docs/results/gate_scope
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from torch import nn

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.elasticdnn.gates import GatedModel, load_gated, make_gated
from tta_core.elasticdnn.surrogate import extract_surrogate, highest_entropy_sample
from tta_core.elasticdnn.train import ElasticTrainConfig, recalibrate_bn, sandwich_loss

ROOT = Path(__file__).resolve().parents[2]
GATED = ROOT / "checkpoints" / "small_resnet_signs32_elastic.json"


def masters(trained: GatedModel) -> dict[str, GatedModel]:
    """Both scopes on a copy of the trained base, the block gates copied."""
    out = {}
    for scope in ("block", "all"):
        m = make_gated(trained.plain_base(), trained.reduction, scope)
        for key, gate in trained.gates.items():
            m.gates[key].load_state_dict(gate.state_dict())
        out[scope] = m
    return out


def fine_tune(master: GatedModel, x: torch.Tensor, y: torch.Tensor,
              args: argparse.Namespace) -> float:
    """`--steps` sandwich steps; returns the seconds taken."""
    cfg = ElasticTrainConfig()
    gen = torch.Generator().manual_seed(args.seed)
    for p in master.parameters():
        p.requires_grad_(True)
    opts = [torch.optim.Adam(master.gates.parameters(), lr=args.gate_lr),
            torch.optim.SGD(master.base.parameters(), lr=args.lr, momentum=0.9)]
    master.train()
    with harness.Stopwatch() as sw:
        for _ in range(args.steps):
            idx = torch.randint(0, len(x), (args.batch,), generator=gen)
            for o in opts:
                o.zero_grad()
            sandwich_loss(master, x[idx], y[idx], args.s_max, cfg, gen)
            for o in opts:
                o.step()
        recalibrate_bn(master, x[:2048], 128)
    for p in master.parameters():
        p.requires_grad_(False)
    return sw.s


@torch.no_grad()
def batch_stat_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 with BN on batches of 128 (the running statistics restored)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    hits = sum(int((model(x[i:i + 128]).argmax(1) == y[i:i + 128]).sum())
               for i in range(0, len(y), 128))
    model.load_state_dict(state)
    model.eval()
    return hits / len(y)


def surrogate(master: GatedModel, x: torch.Tensor, keep: float) -> nn.Module:
    """The surrogate for keep, cut from x's highest-entropy sample (extra gates folded)."""
    sample = highest_entropy_sample(master.eval(), x)
    return extract_surrogate(master, sample, keep).model.eval()


@torch.no_grad()
def fastest_ms(models: dict[str, nn.Module], x: torch.Tensor, reps: int) -> dict[str, float]:
    """Fastest forward of each model over `reps` interleaved rounds, ms."""
    for m in models.values():
        m.eval()
    times = harness.round_robin({k: (lambda m=m: m(x)) for k, m in models.items()}, reps)
    return {k: min(t.ms) for k, t in times.items()}


def evaluate(ms: dict[str, GatedModel], xv: torch.Tensor, yv: torch.Tensor,
             args: argparse.Namespace) -> dict:
    """Accuracy and forward ms per scope and keep (master and surrogate)."""
    acc, timed = {}, {}
    for scope, m in ms.items():
        for keep in args.keeps:
            with m.sparsity_set_to(min(1.0 - keep, 0.99)):
                acc[f"{scope} master {keep:g}"] = batch_stat_accuracy(m, xv, yv)
                timed[f"{scope} master {keep:g}"] = _Sparse(m, 1.0 - keep)
            sur = surrogate(m, xv, keep)
            acc[f"{scope} surrogate {keep:g}"] = batch_stat_accuracy(sur, xv, yv)
            timed[f"{scope} surrogate {keep:g}"] = sur
    return {"accuracy": acc, "forward_ms": fastest_ms(timed, xv[:args.batch_eval], args.reps)}


class _Sparse(nn.Module):
    """A master run at a fixed sparsity (for timing)."""

    def __init__(self, master: GatedModel, sparsity: float) -> None:
        super().__init__()
        self.master, self.sparsity = master, min(sparsity, 0.99)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.master.sparsity_set_to(self.sparsity):
            return self.master(x)


def markdown(out: dict) -> str:
    """Accuracy % and forward ms per keep, block vs all, master and surrogate."""
    keeps = out["args"]["keeps"]
    lines = [f"Gate scope (`benchmarks/speed/bench_gate_scope.py`, {out['model']}, "
             f"{out['args']['steps']} fine-tuning steps each, clean held-out signs, BN batch "
             f"statistics, forward of a batch of {out['args']['batch_eval']}, 1 thread).", "",
             "| model | " + " | ".join(f"keep {k:g} acc % / ms" for k in keeps) + " |",
             "|---|" + "---|" * len(keeps)]
    sections = [("after fine-tuning", out["tuned"]), ("before (all: fresh gates)",
                                                      out["untuned"])]
    if "cards" in out:
        sections.append((f"trained cards ({out['args']['all_card']})", out["cards"]))
    for name, res in sections:
        for what in ("block master", "all master", "block surrogate", "all surrogate"):
            cells = [f"{100 * res['accuracy'][f'{what} {k:g}']:.1f} / "
                     f"{res['forward_ms'][f'{what} {k:g}']:.2f}" for k in keeps]
            lines.append(f"| {what}, {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gated-card", default=str(GATED))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--s-max", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--gate-lr", type=float, default=1e-3)
    ap.add_argument("--keeps", default="1,0.7,0.5,0.3")
    ap.add_argument("--train-samples", type=int, default=4000)
    ap.add_argument("--val-samples", type=int, default=1000)
    ap.add_argument("--batch-eval", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all-card", default="",
                    help="a trained scope-all gated card, measured as shipped too")
    ap.add_argument("--results", default="", help="write <this>.json and <this>.md")
    args = ap.parse_args(argv)
    args.keeps = [float(k) for k in args.keeps.split(",")]
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    trained = load_gated(args.gated_card)
    card = json.loads(Path(args.gated_card).read_text())
    size, mean, std = card["image_size"], card["mean"], card["std"]
    tr = make_signs(args.train_samples, size, seed=args.seed + 500, progress=False)
    va = make_signs(args.val_samples, size, seed=args.seed + 20_000, progress=False)
    xt, yt = images_to_tensor(tr.images, mean, std), torch.from_numpy(tr.labels)
    xv, yv = images_to_tensor(va.images, mean, std), torch.from_numpy(va.labels)
    ms = masters(trained)
    out = {"model": card.get("name", ""), "args": vars(args)}
    if args.all_card:
        out["cards"] = evaluate({"block": trained, "all": load_gated(args.all_card)}, xv, yv,
                                args)
    out["untuned"] = evaluate(ms, xv, yv, args)
    _write(out, args)  # each phase as it ends (a slow machine may stop the run)
    out["seconds"] = {scope: fine_tune(m, xt, yt, args) for scope, m in ms.items()}
    out["tuned"] = evaluate(ms, xv, yv, args)
    _write(out, args)
    print(json.dumps(out, indent=1))
    print(markdown(out))
    return 0


def _write(out: dict, args: argparse.Namespace) -> None:
    """JSON (and, once fine-tuned, markdown) to --results; progress to stderr."""
    print(f"gate scope: {', '.join(k for k in ('untuned', 'tuned') if k in out)} done",
          file=sys.stderr, flush=True)
    if args.results:
        if "tuned" in out:
            harness.save(Path(args.results).name, out, options=args, out=Path(args.results).parent)
        else:  # the first phase alone: JSON only (no page until the run is complete)
            Path(args.results).with_suffix(".json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
