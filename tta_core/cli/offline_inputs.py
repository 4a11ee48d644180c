"""The offline phases' inputs made from a user's clean labelled images
(tta_core.data.sources.load_labelled): DARDA's per-corruption labelled sets, ElasticDNN's
training set (clean and corrupted images) and the corruption encoder's images. Labelled
corrupted images come from the corruption library (`corrupted_copies`) at one severity,
over the training corruptions (the held-out ones never). Fitting and held-out images are
disjoint clean images (`LabelledImages.split`). Imported inside command run()s only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tta_core.darda.offline_data import Labelled, OfflineData
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.sources import LabelledImages, corrupted_copies, load_labelled
from tta_core.elasticdnn.train import ElasticData
from tta_core.model.source import ModelCard


def _bag_frames(root: Path) -> Iterable[Any]:
    from tta_core.io.bag import read_bag

    return read_bag(root, require_ground_truth=False)


def labelled_images(data: str, card: ModelCard, samples: int = 0, seed: int = 0
                    ) -> LabelledImages:
    """`data`'s clean labelled images at the card's input size, in its class order."""
    return load_labelled(data, card.image_size, tuple(card.class_names), samples, seed,
                         _bag_frames)


def _norm(images: np.ndarray, card: ModelCard) -> torch.Tensor:
    return images_to_tensor(np.ascontiguousarray(images), tuple(card.mean), tuple(card.std))


def timed_batch(data: str, card: ModelCard, batch: int, seed: int = 0) -> torch.Tensor:
    """`batch` of `data`'s clean images (cycled when it has fewer), normalised as the card
    says: the batch the offline timings (`tta profile`, `tta calibrate`) run on."""
    return batch_of(labelled_images(data, card, batch, seed), card, batch)


def batch_of(li: LabelledImages, card: ModelCard, batch: int) -> torch.Tensor:
    """The first `batch` images of `li` (cycled when fewer), normalised."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return _norm(li.images[np.arange(batch) % len(li.labels)], card)


def _per_corruption(li: LabelledImages, n: int, corruptions: Sequence[str], severity: int,
                    seed: int, card: ModelCard,
                    progress: Callable[[str], None] | None) -> Labelled:
    """The first `n` images of `li` (cycled when fewer) under each corruption, normalised;
    d = the corruption's index."""
    rows = np.arange(n) % len(li.labels)
    images = li.images[rows]
    copies = corrupted_copies(images, corruptions, severity, seed, progress)
    x = _norm(np.concatenate(copies), card)
    y = torch.as_tensor(np.tile(li.labels[rows], len(corruptions)), dtype=torch.long)
    d = torch.arange(len(corruptions)).repeat_interleave(n)
    return Labelled(x, y, d)


def darda_data(li: LabelledImages, corruptions: Sequence[str], samples: int,
               eval_samples: int, severity: int, seed: int, card: ModelCard,
               progress: Callable[[str], None] | None = None) -> OfflineData:
    """DARDA's offline images: `samples` fitting images per corruption from the fitting
    part, `eval_samples` from the held-out part (other clean images), each corrupted."""
    fit, held = li.split(eval_samples, seed)
    source = {**li.source, "severity": severity, "corruptions": list(corruptions),
              "fit_images": min(samples, len(fit.labels)), "eval_images": eval_samples,
              "made_by": "the corruption library from clean labelled images"}
    return OfflineData(
        _per_corruption(fit, samples, corruptions, severity, seed, card, progress),
        _per_corruption(held, eval_samples, corruptions, severity, seed + 1, card, progress),
        source)


def elastic_data(li: LabelledImages, corruptions: Sequence[str], severity: int, val: int,
                 seed: int, card: ModelCard,
                 progress: Callable[[str], None] | None = None) -> ElasticData:
    """ElasticDNN's pre-training set: the fitting images clean and once corrupted (image i
    by corruption i mod C: every image seen clean and under one training corruption);
    held out: `val` other images, clean."""
    fit, held = li.split(val, seed)
    n = len(fit.labels)
    shifted = np.empty_like(fit.images)
    for j, c in enumerate(corruptions):
        rows = np.arange(j, n, len(corruptions))
        if len(rows):
            shifted[rows] = corrupted_copies(fit.images[rows], (c,), severity, seed + j)[0]
        if progress is not None:
            progress(c)
    x = _norm(np.concatenate([fit.images, shifted]), card)
    y = torch.as_tensor(np.concatenate([fit.labels, fit.labels]), dtype=torch.long)
    return ElasticData(x, y, _norm(held.images, card),
                       torch.as_tensor(held.labels, dtype=torch.long),
                       {**li.source, "corruptions": list(corruptions), "severity": severity})


def encoder_data(li: LabelledImages, corruptions: Sequence[str], samples: int, severity: int,
                 seed: int, card: ModelCard,
                 progress: Callable[[str], None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The corruption encoder's images: `samples` images per corruption, labels the
    corruption's index (the encoder learns corruptions, not classes)."""
    lab = _per_corruption(li, samples, corruptions, severity, seed, card, progress)
    return lab.x, lab.d
