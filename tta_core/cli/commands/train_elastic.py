"""`tta train-elastic`: train ElasticDNN's gated master from a source checkpoint (gate
warm-up, sandwich rule over staged max sparsity, L1 on the gates) with its domain knowledge
Θ* tied to the filters by the paper's second loss (tta_core.elasticdnn.train), and write
`<out>.safetensors` + the model card `<out>.json`, which loads like any card
(`tta bench --model-card <out>.json`, the elastic method). `--knowledge-only` instead fits
Θ* to an existing gated master (`--source-card` a gated card; by default rewritten in
place), its weights unchanged.

`--data KIND:DIR` trains on your own clean labelled images instead of the signs (a user's
model: `--model-card` is the card `tta model-card` wrote): every fitting image clean and
under one of the training corruptions (`--corruptions` less `--held-out`, at `--severity`,
made by the corruption library), `--val-samples` other images held out clean (at most a
fifth of them), at most `--train-samples` images read."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tta_core.cli.offline_args import add_offline_data, data_given
from tta_core.io.strict_json import dumps as json_dumps

if TYPE_CHECKING:
    from tta_core.elasticdnn.train import ElasticData

NAME = "train-elastic"
HELP = "train ElasticDNN's gated master (FBS gates, sandwich rule) from a source checkpoint"
# ElasticTrainConfig's defaults of the options below (tta_core.elasticdnn.train imports
# torch); test/system/test_cli_fast.py checks that they are equal
DEFAULTS: dict[str, object] = {
    "source_card": Path("checkpoints/small_resnet_signs32.json"), "stages": (0.2, 0.5, 0.8),
    "warmup_epochs": 1, "stage_epochs": 2, "train_samples": 8000, "val_samples": 1000,
    "batch_size": 128, "lr": 0.005, "gate_lr": 1e-3, "l1": 1e-3, "clip": 5.0, "distill": 0.5,
    "reduction": 4, "seed": 0, "threads": 2, "knowledge": 0.25, "tie": 1.0,
    "knowledge_lr": 0.1, "knowledge_init": "similarity", "gate_scope": "block", "teacher": 0.0,
    "checkpoint_dir": "", "init_checkpoint": "", "hard_tie_epochs": 0}


def _sparsities(text: str) -> tuple[float, ...]:
    """'0.2,0.5' -> (0.2, 0.5)."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sparsities, got "
                                         f"{text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Source card, output stem, stages and the training options (the config's defaults)."""
    d = argparse.Namespace(**DEFAULTS)
    parser.add_argument("--source-card", "--model-card", type=Path, default=d.source_card,
                        dest="source_card",
                        help="the trained source model to gate (a card of `tta model-card` "
                             "for your own model)")
    add_offline_data(parser)
    parser.add_argument("--severity", type=int, default=5, choices=range(1, 6),
                        help="severity of the corrupted training images (with --data)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output stem (default checkpoints/<source name>_elastic)")
    parser.add_argument("--stages", type=_sparsities, default=d.stages,
                        help="max sparsity of each joint-training stage, e.g. 0.2,0.5,0.8")
    for name in ("warmup_epochs", "stage_epochs", "train_samples", "val_samples",
                 "batch_size", "lr", "gate_lr", "l1", "clip", "distill", "reduction", "seed",
                 "threads", "knowledge", "tie", "knowledge_lr", "knowledge_init",
                 "gate_scope", "teacher", "checkpoint_dir", "init_checkpoint",
                 "hard_tie_epochs"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(getattr(d, name)),
                            default=getattr(d, name))
    parser.add_argument("--knowledge-only", action="store_true",
                        help="fit Θ* (share --knowledge) to the gated master --source-card "
                        "names, no training (converts a checkpoint written before Θ*)")
    parser.add_argument("--final-decay", action="store_true",
                        help="cosine-anneal the base lr to 0 over the last stage")
    parser.add_argument("--half", action="store_true",
                        help="store float16 tensors (they load into the float32 model)")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Train the gated master, save it with its card and print accuracy by sparsity."""
    from tta_core.elasticdnn.knowledge import save_master
    from tta_core.elasticdnn.train import ElasticTrainConfig, train_master
    from tta_core.model.source import find_card

    args.source_card = find_card(args.source_card)
    cfg = ElasticTrainConfig(
        source_card=args.source_card, stages=args.stages, warmup_epochs=args.warmup_epochs,
        stage_epochs=args.stage_epochs, train_samples=args.train_samples,
        val_samples=args.val_samples, batch_size=args.batch_size, lr=args.lr,
        gate_lr=args.gate_lr, l1=args.l1, clip=args.clip, distill=args.distill,
        reduction=args.reduction, seed=args.seed, threads=args.threads,
        knowledge=args.knowledge, tie=args.tie, knowledge_lr=args.knowledge_lr,
        knowledge_only=args.knowledge_only, knowledge_init=args.knowledge_init,
        gate_scope=args.gate_scope, teacher=args.teacher, final_decay=args.final_decay,
        checkpoint_dir=args.checkpoint_dir, init_checkpoint=args.init_checkpoint,
        hard_tie_epochs=args.hard_tie_epochs)
    try:
        cfg.validate()
    except ValueError as exc:
        raise SystemExit(f"train-elastic: {exc}") from None
    res = train_master(cfg, progress=not args.no_progress, data=_data(args))
    default = (args.source_card.with_suffix("") if cfg.knowledge_only
               else Path("checkpoints") / f"{res.card.name or res.card.arch}_elastic")
    out = args.out or default
    record = {"seconds": round(res.seconds, 1), "steps": res.steps,
              "source_accuracy": res.source_accuracy, "tie_loss": res.tie_loss,
              "accuracy_by_sparsity": {f"{s:g}": a for s, a in res.accuracy.items()},
              "batch_stat_accuracy_by_sparsity": {f"{s:g}": a
                                                  for s, a in res.batch_accuracy.items()},
              "config": {k: str(v) for k, v in vars(cfg).items()},
              "data": args.data if data_given(args) else "signs"}
    card_path = save_master(res.master, out, res.card, clean_accuracy=res.accuracy[0.0],
                            metadata=_metadata(args.source_card, cfg.knowledge_only, record),
                            half=args.half)
    table = ", ".join(f"{s:g}: {a:.3f} / {res.batch_accuracy[s]:.3f}"
                      for s, a in res.accuracy.items())
    print(f"source accuracy {res.source_accuracy:.3f}; master by sparsity (running / batch "
          f"BN statistics) {table}; second loss (master-knowledge tie) {res.tie_loss:.3g} "
          f"({res.steps} steps, {res.seconds:.0f} s); wrote {out.with_suffix('.safetensors')} "
          f"and {card_path}")
    return 0


def _data(args: argparse.Namespace) -> ElasticData | None:
    """The ElasticData of --data (None: the signs, train_master's default)."""
    if not data_given(args):
        return None
    from tta_core.cli.offline_inputs import elastic_data, labelled_images
    from tta_core.data.sources import training_corruptions
    from tta_core.model.source import load_card

    card = load_card(args.source_card)  # a gated card's base reads images the same way
    li = labelled_images(args.data, card, args.train_samples, args.seed)
    held = min(args.val_samples, max(1, len(li.labels) // 5))
    corr = training_corruptions(args.corruptions, args.held_out)
    return elastic_data(li, corr, args.severity, held, args.seed, card)


def _metadata(source_card: Path, knowledge_only: bool, record: dict) -> dict[str, str]:
    """Checkpoint metadata: this run's record; a knowledge-only fit keeps the gated
    master's training record and adds its own."""
    if not knowledge_only:
        return {"train_elastic": json_dumps(record)}
    import safetensors

    from tta_core.model.source import load_card

    weights = source_card.parent / load_card(source_card).checkpoint
    with safetensors.safe_open(str(weights), "pt") as f:
        old = dict(f.metadata() or {})
    return {**old, "knowledge_fit": json_dumps(record)}
