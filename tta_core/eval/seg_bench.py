"""`tta bench --task segmentation`: TTA methods on a segmentation card over a continual
stream of conditions (ACDC: fog -> night -> rain -> snow, the model never reset between
them, as in SURGEON's Cityscapes -> ACDC table), scored by mIoU per condition.

Each method starts from the card's weights and steps through the stream batch by batch;
its per-batch logits (N x C x H x W) feed one confusion matrix per condition
(tta_core.eval.miou). The methods that run on segmentation nets are `SEG_METHODS`; any
other is refused in one line naming it. The report (JSON and markdown) lists the mIoU per
condition, its mean, the per-class IoU and the mean step time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.segmentation import SegmentationSet, load_segmentation, mask_tensor
from tta_core.errors import InputError
from tta_core.eval.miou import ConfusionMeter
from tta_core.io.strict_json import dumps as json_dumps
from tta_core.model.source import ModelCard, load_source
from tta_core.registry import build_method, method_class

# the methods whose losses and forwards take N x C x H x W logits
SEG_METHODS: tuple[str, ...] = ("source", "bn_adapt", "tent")
SCHEMA = "tta.seg_bench/1"


@dataclass
class SegBenchConfig:
    """What to run: methods on a card over `data` (acdc:DIR or cityscapes:DIR)."""

    model_card: Path
    data: str
    methods: tuple[str, ...] = SEG_METHODS
    batch_size: int = 4
    samples_per_domain: int = 0  # 0: every image
    conditions: tuple[str, ...] = ()  # ACDC conditions, in order (): those present
    threads: int = 1
    device: str = "cpu"
    seed: int = 0
    method_options: dict = field(default_factory=dict)


@dataclass
class MethodScores:
    """One method's mIoU per condition (fractions), their mean, per-class IoU, time."""

    method: str
    miou: dict[str, float]
    mean_miou: float
    class_iou: dict[str, dict[str, float]]
    ms_per_batch: float
    options: dict = field(default_factory=dict)


def check_methods(methods: tuple[str, ...]) -> None:
    """InputError naming the first method that does not segment yet."""
    for name in methods:
        method_class(name)  # an unknown name: the registry's own error
        if name not in SEG_METHODS:
            raise InputError(f"method {name!r} does not support segmentation yet (it does: "
                             f"{', '.join(SEG_METHODS)})")


def _load(cfg: SegBenchConfig) -> tuple[ModelCard, SegmentationSet]:
    _, card = load_source(cfg.model_card)
    if card.task != "segmentation":
        raise InputError(f"model card {cfg.model_card}: task {card.task!r}; --task "
                         "segmentation needs a segmentation card (tta train-source --task "
                         "segmentation)")
    data = load_segmentation(cfg.data, "val", card.input_hw, cfg.samples_per_domain or None,
                             cfg.conditions)
    return card, data


def run_method(name: str, card: ModelCard, data: SegmentationSet, cfg: SegBenchConfig,
               progress: Callable[[int], object] | None = None) -> MethodScores:
    """Stream `data` through method `name` on a fresh copy of the card's model."""
    model, _ = load_source(cfg.model_card, cfg.device)
    opts = dict(cfg.method_options.get(name, {}))
    fields = method_class(name).config_cls.__dataclass_fields__
    if "input_shape" in fields:
        opts.setdefault("input_shape", (3, *card.input_hw))
    meth = build_method(name, model, **opts)
    meters: dict[str, ConfusionMeter] = {}
    seconds, batches = 0.0, 0
    for images, masks, domain in data.batches(cfg.batch_size):
        x = images_to_tensor(images, card.mean, card.std).to(cfg.device)
        t0 = time.perf_counter()
        logits = meth.step(x).logits
        seconds += time.perf_counter() - t0
        batches += 1
        meters.setdefault(domain, ConfusionMeter(card.num_classes)).update(logits,
                                                                           mask_tensor(masks))
        if progress:
            progress(len(masks))
    scores = {d: m.scores(card.class_names) for d, m in meters.items()}
    miou = {d: s.miou for d, s in scores.items()}
    return MethodScores(name, miou, sum(miou.values()) / len(miou),
                        {d: s.named_iou() for d, s in scores.items()},
                        1000 * seconds / max(batches, 1),
                        {k: v for k, v in opts.items() if k != "input_shape"})


def markdown(card: ModelCard, results: list[MethodScores]) -> str:
    """The mIoU table (%, one row per method, one column per condition)."""
    domains = list(results[0].miou) if results else []
    clean = "–" if math.isnan(card.clean_accuracy) else f"{100 * card.clean_accuracy:.1f}"
    lines = [f"# Segmentation TTA: {card.name or card.arch} (clean val mIoU {clean} %)", "",
             "| method | " + " | ".join(domains) + " | mean mIoU % | ms / batch |",
             "|---" * (len(domains) + 3) + "|"]
    for r in results:
        cells = " | ".join(f"{100 * r.miou[d]:.1f}" for d in domains)
        lines.append(f"| {r.method} | {cells} | {100 * r.mean_miou:.1f} | "
                     f"{r.ms_per_batch:.0f} |")
    return "\n".join(lines) + "\n"


def run_seg_bench(cfg: SegBenchConfig, out: Path | None = None, progress: bool = True
                  ) -> tuple[list[MethodScores], str]:
    """Every method of `cfg` on the stream; writes seg_bench.json and .md into `out`."""
    check_methods(cfg.methods)
    if cfg.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    card, data = _load(cfg)
    from tqdm import tqdm

    results = []
    with tqdm(total=len(data) * len(cfg.methods), desc="seg-bench", unit="img",
              disable=not progress) as bar:
        for name in cfg.methods:
            torch.manual_seed(cfg.seed)
            results.append(run_method(name, card, data, cfg, bar.update))
    text = markdown(card, results)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        record = {"schema": SCHEMA, "config": {**asdict(cfg), "model_card": str(cfg.model_card)},
                  "card": asdict(card), "results": [asdict(r) for r in results]}
        (out / "seg_bench.json").write_text(json_dumps(record, indent=1) + "\n")
        (out / "seg_bench.md").write_text(text)
    return results, text
