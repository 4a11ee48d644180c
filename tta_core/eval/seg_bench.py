"""`tta bench --task segmentation`: TTA methods on a segmentation card over a continual
stream of conditions (ACDC: fog -> night -> rain -> snow, the model never reset between
them, repeated `rounds` times: CoTTA's and SURGEON's Cityscapes -> ACDC protocol), scored
online by mIoU per (round, condition).

Each method starts from the card's weights and steps through the stream batch by batch;
its per-batch logits (N x C x H x W) feed one confusion matrix per round and condition
(tta_core.eval.miou). The seed draws each condition's images (`samples_per_domain` of
them) and their order, the same in every round, and seeds the methods that take one.
The online error is SURGEON's (§5.1, after MECTA): 1 - mIoU of the predictions made while
adapting, per (round, condition), and its mean over the sequence. The cache is the
measured saved-activation bytes of each update (eval.saved_memory: autograd's saves, plus
what a method's own codec stored: SURGEON), averaged over the batches.

The methods that run on segmentation nets are `SEG_METHODS`; any other is refused in one
line naming it and why (`SEG_REFUSALS`). The gradient methods run with the optimizer of
CoTTA's ACDC code unless set (`SEG_SETTINGS`): their classification presets, scaled to
batch 2 (SGD 2.5e-4 per 64 images), leave the weights where they were. AdaShadow
normalises by a batch's statistics wherever it gives a channel 4096 values (robust BN is
for the noisy statistics of a few small frames). A variant label (`adashadow@robust`)
runs its method with its own `--set` options, as in `tta bench`; every method learns its
run-time costs on noise before its stream (api.WarmsUp), as the perception node does.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.segmentation import SegmentationSet, load_segmentation, mask_tensor
from tta_core.errors import InputError
from tta_core.eval.bench_config import method_base
from tta_core.eval.bench_stream import start_method
from tta_core.eval.miou import ConfusionMeter
from tta_core.eval.saved_memory import ActivationMeter
from tta_core.io.strict_json import dumps as json_dumps
from tta_core.model.source import ModelCard, load_source
from tta_core.registry import method_class

# the methods whose losses and forwards take N x C x H x W logits
SEG_METHODS: tuple[str, ...] = ("source", "bn_adapt", "tent", "eata", "sar", "cotta",
                                "surgeon", "adashadow")
SEG_REFUSALS: dict[str, str] = {
    "lame": "a classifier-output method: its Laplacian runs over one feature vector per "
            "sample (the input of the last nn.Linear); N x C x H x W logits have none",
    "darda": "its corruption bundle is fitted on a classification card (tta train-darda)",
    "elastic": "it needs a gated classification master (tta train-elastic)",
}
# Adam at 6e-5 per 8 images: CoTTA's ACDC code for Tent and CoTTA (qinenergy/cotta
# acdc/mmseg/apis/test.py: Adam(lr=0.00006/8) at batch 1, "was 8 during cityscapes
# training"), the protocol SURGEON follows (§5.1); CoTTA's ACDC restore 0.01 and anchor
# threshold 0.69 ("0.74 was the 5% quantile for cityscapes"); SURGEON's official code has
# no segmentation configuration: it gets the same all-layer rate as CoTTA
ACDC_ADAM: dict[str, Any] = {"optimizer": "adam", "lr": 6e-5, "lr_ref_batch": 8}
SEG_SETTINGS: dict[str, dict[str, Any]] = {
    "tent": ACDC_ADAM, "eata": ACDC_ADAM, "sar": ACDC_ADAM,
    "cotta": {**ACDC_ADAM, "restore_prob": 0.01, "anchor_threshold": 0.69},
    "surgeon": {"lr": 6e-5, "lr_ref_batch": 8},
    # robust BN is for the noisy statistics of a few frames; a scene gives each channel
    # height x width values per frame, so the layers where a batch gives 4096 of them
    # normalise by its statistics, the coarsest ones stay on robust BN (EngineConfig.
    # bn_batch_values; measured by config/sweeps/seg_adashadow_bn.yaml)
    "adashadow": {"bn_batch_values": 4096},
}
SCHEMA = "tta.seg_bench/2"
MIB = 2**20


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
    rounds: int = 1  # the condition sequence repeated (CoTTA's ACDC protocol: 10)
    measure_activations: bool = False  # the cache column (saved-tensor hooks: slower)
    method_options: dict = field(default_factory=dict)


@dataclass
class MethodScores:
    """One method's mIoU per condition (fractions, the mean over rounds), their mean, the
    online mIoU per round and condition, per-class IoU (last round), time and cache."""

    method: str
    miou: dict[str, float]
    mean_miou: float
    class_iou: dict[str, dict[str, float]]
    ms_per_batch: float
    options: dict = field(default_factory=dict)
    online_miou: list[dict[str, float]] = field(default_factory=list)  # per round
    online_error: float = math.nan  # SURGEON's mean online error: 1 - mean_miou
    cache_mib: float = math.nan  # saved activations per batch, mean (NaN: not measured)
    cache_mib_max: float = math.nan
    cache_peak_mib: float = math.nan  # with a method's own extra pass (SURGEON's importance)


def check_methods(methods: tuple[str, ...]) -> None:
    """InputError naming the first method that does not segment, and why."""
    for label in methods:
        name = method_base(label)  # a variant (tent@slow) is its method's
        method_class(name)  # an unknown name: the registry's own error
        if name not in SEG_METHODS:
            why = SEG_REFUSALS.get(name, "its losses take N x C logits only")
            raise InputError(f"method {name!r} does not support segmentation: {why} (the "
                             f"methods that do: {', '.join(SEG_METHODS)})")


def method_options(name: str, cfg: SegBenchConfig, card: ModelCard) -> dict[str, Any]:
    """The options `name` (a method, or a variant `method@label`: its own --set options)
    is built with: the user's, over SEG_SETTINGS, with the card's input shape and the
    bench's seed where the method takes them."""
    base = method_base(name)
    fields = method_class(base).config_cls.__dataclass_fields__
    opts = {**SEG_SETTINGS.get(base, {}), **cfg.method_options.get(name, {})}
    if "input_shape" in fields:
        opts.setdefault("input_shape", (3, *card.input_hw))
    if "seed" in fields:
        opts.setdefault("seed", cfg.seed)
    return opts


def _load(cfg: SegBenchConfig) -> tuple[ModelCard, SegmentationSet]:
    _, card = load_source(cfg.model_card)
    if card.task != "segmentation":
        raise InputError(f"model card {cfg.model_card}: task {card.task!r}; --task "
                         "segmentation needs a segmentation card (tta train-source --task "
                         "segmentation)")
    data = load_segmentation(cfg.data, "val", card.input_hw, cfg.samples_per_domain or None,
                             cfg.conditions, seed=cfg.seed)
    return card, data


def _round_scores(meters: dict[tuple[int, str], ConfusionMeter], card: ModelCard
                  ) -> tuple[list[dict[str, float]], dict[str, dict[str, float]]]:
    """mIoU per round and domain, and the last round's per-class IoU per domain."""
    rounds = 1 + max(r for r, _ in meters)
    online: list[dict[str, float]] = [{} for _ in range(rounds)]
    last: dict[str, dict[str, float]] = {}
    for (r, dom), meter in meters.items():
        s = meter.scores(card.class_names)
        online[r][dom] = s.miou
        if r == rounds - 1:
            last[dom] = s.named_iou()
    return online, last


def run_method(name: str, card: ModelCard, data: SegmentationSet, cfg: SegBenchConfig,
               progress: Callable[[int], object] | None = None) -> MethodScores:
    """Stream `data` (`cfg.rounds` times) through method `name` on a fresh copy of the
    card's model."""
    model, _ = load_source(cfg.model_card, cfg.device)
    opts = method_options(name, cfg, card)
    meth = start_method(name, model, opts, torch.randn(
        (cfg.batch_size, 3, *card.input_hw), device=cfg.device))  # as the node starts it
    meter = ActivationMeter(model, cfg.measure_activations)
    meters: dict[tuple[int, str], ConfusionMeter] = {}
    seconds, batches = 0.0, 0
    for rnd in range(max(cfg.rounds, 1)):
        for images, masks, domain in data.batches(cfg.batch_size):
            x = images_to_tensor(images, card.mean, card.std).to(cfg.device)
            t0 = time.perf_counter()
            with meter.step():
                res = meth.step(x)
            seconds += time.perf_counter() - t0
            meth.finish()  # between batches (adashadow: the next plan), as tta bench
            meter.note(res.stats)
            batches += 1
            meters.setdefault((rnd, domain), ConfusionMeter(card.num_classes)).update(
                res.logits, mask_tensor(masks))
            if progress:
                progress(len(masks))
    online, class_iou = _round_scores(meters, card)
    domains = list(online[0])
    miou = {d: sum(r[d] for r in online) / len(online) for d in domains}
    mean = sum(miou.values()) / len(miou)
    scores = MethodScores(name, miou, mean, class_iou, 1000 * seconds / max(batches, 1),
                          {k: v for k, v in opts.items() if k != "input_shape"}, online,
                          1.0 - mean)
    _cache(scores, meter)
    return scores


def _cache(scores: MethodScores, meter: ActivationMeter) -> None:
    """The measured cache figures of a run (left NaN when not measured)."""
    summary = meter.meta()
    if summary is None:
        return
    scores.cache_mib = summary["saved_mib_mean"]
    scores.cache_mib_max = summary["saved_mib_max"]
    scores.cache_peak_mib = max(summary["saved_mib_max"],
                                summary.get("method_peak_saved_mib_max", 0.0))


def _cell(v: float, k: float = 100) -> str:
    return "–" if math.isnan(v) else f"{k * v:.1f}"


def markdown(card: ModelCard, results: list[MethodScores]) -> str:
    """The mIoU table (%, one row per method, one column per condition: the mean over
    rounds), the mean online error and the cache."""
    domains = list(results[0].miou) if results else []
    rounds = len(results[0].online_miou) if results else 1
    clean = "–" if math.isnan(card.clean_accuracy) else f"{100 * card.clean_accuracy:.1f}"
    lines = [f"# Segmentation TTA: {card.name or card.arch} (clean val mIoU {clean} %)", "",
             f"{rounds} round(s) of {' -> '.join(domains)}; mIoU per condition averaged over "
             "the rounds; online error = 100 - mIoU while adapting (SURGEON §5.1).", "",
             "| method | " + " | ".join(domains) + " | mean mIoU % | online err % | "
             "cache MiB | ms / batch |",
             "|---" * (len(domains) + 5) + "|"]
    for r in results:
        cells = " | ".join(f"{100 * r.miou[d]:.1f}" for d in domains)
        lines.append(f"| {r.method} | {cells} | {100 * r.mean_miou:.1f} | "
                     f"{_cell(r.online_error)} | {_cell(r.cache_mib, 1)} | "
                     f"{r.ms_per_batch:.0f} |")
    return "\n".join(lines) + "\n"


def run_seg_bench(cfg: SegBenchConfig, out: Path | None = None, progress: bool = True
                  ) -> tuple[list[MethodScores], str]:
    """Every method of `cfg` on the stream; writes seg_bench.json and .md into `out`."""
    check_methods(cfg.methods)
    if cfg.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {cfg.rounds}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    card, data = _load(cfg)
    from tqdm import tqdm

    results = []
    with tqdm(total=len(data) * len(cfg.methods) * cfg.rounds, desc="seg-bench", unit="img",
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


def config_from_args(args: argparse.Namespace) -> SegBenchConfig:
    """The SegBenchConfig of `tta bench --task segmentation`'s parsed options (also what a
    `tta sweep` segmentation cell runs)."""
    if args.model_card is None or not args.data:
        raise ValueError("--task segmentation needs --model-card (a segmentation card) and "
                         "--data acdc:DIR or cityscapes:DIR")
    from tta_core.model.source import find_card

    options: dict[str, dict] = {}
    for method, key, value in args.options:
        options.setdefault(method, {})[key] = value
    return SegBenchConfig(model_card=find_card(args.model_card), data=args.data,
                          methods=args.methods or SEG_METHODS, batch_size=args.batch_size,
                          samples_per_domain=args.samples_per_domain, threads=args.threads,
                          device=args.device, seed=args.seed,
                          rounds=getattr(args, "rounds", 1),
                          measure_activations=bool(getattr(args, "measure_activations", False)),
                          method_options=options)


def sweep_summaries(results: list[MethodScores]) -> list[dict[str, Any]]:
    """The figures a `tta sweep` cell keeps per method (fractions; cache in MiB)."""
    out = []
    for r in results:
        row = {"method": r.method, "mean_miou": r.mean_miou, "online_error": r.online_error,
               "cache_mib": r.cache_mib, "cache_peak_mib": r.cache_peak_mib,
               "ms_per_batch": r.ms_per_batch}
        row.update({f"miou@{d}": v for d, v in r.miou.items()})
        out.append(row)
    return out
