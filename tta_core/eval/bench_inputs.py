"""What a bench runs on: the source model and the shift stream as model-ready batches
(the synthetic signs, or the user's data or bag; source predictions as labels where a bag
has no ground truth).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tta_core.data.preprocess import images_to_tensor
from tta_core.errors import InputError
from tta_core.eval.bench_config import BenchConfig


@dataclass
class Batch:
    """One batch of the stream: images [N, C, H, W] (model input), labels, domain."""

    x: torch.Tensor
    labels: np.ndarray
    domain: str


def card_field(card: object, key: str, default: object = None) -> object:
    """A model card's field, from a ModelCard or its dict form."""
    if isinstance(card, dict):
        return card.get(key, default)
    return getattr(card, key, default)


def images_to_input(images: np.ndarray, card: object, device: str = "cpu") -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, 3, H, W], normalised by the card's mean/std (what
    the source model was trained on; [0, 1] when the card has none)."""
    mean = card_field(card, "mean") or (0.0, 0.0, 0.0)
    std = card_field(card, "std") or (1.0, 1.0, 1.0)
    return images_to_tensor(images, tuple(mean), tuple(std)).to(device)


def batches_from_arrays(x: torch.Tensor, labels: np.ndarray, domains: Sequence[str],
                        batch_size: int) -> list[Batch]:
    """Cut a stream into batches that never straddle a domain change. Each batch owns its
    memory (contiguous copy), as a camera batch does: a slice would share the whole
    stream's storage, and saved-activation accounting (by storage) would charge a method
    that saves its input (surgeon's first conv) for the entire stream (measured: 18.4 MB
    instead of 48 KB at 100 frames per domain)."""
    if not len(x) == len(labels) == len(domains):
        raise ValueError(f"lengths differ: x {len(x)}, labels {len(labels)}, "
                         f"domains {len(domains)}")
    out: list[Batch] = []
    start = 0
    for i in range(1, len(x) + 1):
        if i == len(x) or domains[i] != domains[start] or i - start == batch_size:
            out.append(Batch(x[start:i].clone(memory_format=torch.contiguous_format),
                             np.asarray(labels[start:i]), str(domains[start])))
            start = i
    return out


def build_stream(cfg: BenchConfig, card: object, progress: bool = False,
                 track_length: int = 1) -> list[Batch]:
    """The shift stream of `cfg` as model-ready batches (tta_core.data.streams), each
    object seen over `track_length` frames."""
    from tta_core.data import streams

    extra = {"corruptions": cfg.corruptions} if cfg.corruptions else {}
    spec = streams.StreamSpec(order=cfg.order, severity=cfg.severity, **extra,
                              samples_per_domain=cfg.samples_per_domain,
                              image_size=int(card_field(card, "image_size", 32)), seed=cfg.seed,
                              num_classes=int(card_field(card, "num_classes", 16)),
                              track_length=track_length)
    stream = streams.build_stream(spec, progress=progress)
    x = images_to_input(stream.images, card, cfg.device)
    return batches_from_arrays(x, stream.labels, stream.domains.tolist(), cfg.batch_size)


def _card(cfg: BenchConfig, classes: Sequence[str]) -> tuple[Any, Path]:
    """(model card, the folder its checkpoint is relative to): `cfg.model_card`, or one
    made for `cfg.user_model` (classes: its own, else `classes`, the user data's)."""
    from tta_core.model.source import find_card, load_card
    from tta_core.model.user_card import make_card

    um = cfg.user_model
    if um is None:
        path = find_card(cfg.model_card)  # relative: looked up (tta_core.io.shipped)
        return load_card(path), path.parent
    if not (um.class_names or um.num_classes) and classes:
        um = replace(um, class_names=tuple(classes))
    return make_card(um), Path(".")


def bench_inputs(cfg: BenchConfig, progress: bool = False
                 ) -> tuple[Any, Callable[[], nn.Module], list[Batch]]:
    """(card, a maker of fresh source models, the stream's batches) of `cfg`: the card's
    or the user's model, the synthetic stream or the user's data at the model's input
    size; the weights are loaded and run once first, so a bad file fails before the stream."""
    from tta_core.data.signs import CLASS_NAMES
    from tta_core.data.sources import class_map, load_data, parse_data
    from tta_core.model.source import load_card, load_model
    from tta_core.model.user_card import check_card_model

    size = (load_card(cfg.model_card).image_size if cfg.user_model is None
            else cfg.user_model.input_size)
    data = (load_data(parse_data(cfg.data), size, cfg.severity, cfg.samples_per_domain,
                      cfg.seed, cfg.order, _bag_frames, cfg.corruptions) if cfg.data else None)
    card, base = _card(cfg, data.class_names if data is not None else ())
    check_card_model(card, base)
    if data is None and card.num_classes > len(CLASS_NAMES):
        raise InputError(f"the model has {card.num_classes} classes; the synthetic signs "
                         f"stream has at most {len(CLASS_NAMES)}: give --data KIND:DIR")
    if data is None:
        stream = build_stream(cfg, card, progress)
    elif data.class_names and card.num_classes != len(data.class_names):
        raise InputError(f"the model has {card.num_classes} classes, --data {cfg.data} "
                         f"has {len(data.class_names)} ({', '.join(data.class_names[:5])}"
                         f"{', ...' if len(data.class_names) > 5 else ''})")
    else:
        labels = data.labels
        if data.class_names and (labels >= 0).all():  # the data's classes by the card's names
            labels = class_map(data.class_names, card.class_names, cfg.data)[labels]
        stream = batches_from_arrays(images_to_input(data.images, card, cfg.device),
                                     labels, data.domains.tolist(), cfg.batch_size)
        if (data.labels < 0).all():  # a recorded bag without ground truth
            stream = label_by_source(stream, load_model(card, base))
    return card, (lambda: load_model(card, base)), stream


def _bag_frames(root: Path) -> Iterable[Any]:
    """A recorded bag's frames, ground truth optional (`--data bag:DIR`)."""
    from tta_core.io.bag import read_bag

    return read_bag(root, require_ground_truth=False)


def label_by_source(stream: list[Batch], model: nn.Module) -> list[Batch]:
    """The stream with the unadapted model's predictions as labels: on data without ground
    truth, accuracy becomes agreement with the source model (report.json meta.ran.data
    says so)."""
    model.eval()
    with torch.no_grad():
        for b in stream:
            b.labels = model(b.x).argmax(1).cpu().numpy().astype(np.int64)
    return stream
