"""A recorded rosbag2 as a bench stream (`--data bag:DIR`), read offline with rosbags (no
ROS running): the images of the camera topic in recorded order, each with its label and
domain from the ground-truth topics when the bag has them. A bag without ground truth
gets label -1 on every frame; the bench then scores agreement with the unadapted model
(tta_core.eval.bench_inputs.label_by_source). The frames are handed in (tta_core.io.bag.read_bag,
by the caller) since tta_core.io imports tta_core.data."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tta_core.data.streams import Stream

UNLABELLED = -1
RECORDED = "recorded"  # the domain of frames without a domain label


def _resized(image: np.ndarray, size: int) -> np.ndarray:
    if image.shape[:2] == (size, size):
        return image
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))


def load_bag_stream(frames: Iterable[Any], root: Path, image_size: int,
                    samples_per_domain: int | None = None) -> Stream:
    """The bag's `frames` (BagFrame: image, label, domain) at `image_size` px, at most
    `samples_per_domain` of each visit of a domain (the first ones of each run of frames
    with one domain); class names are the model's (empty here)."""
    images, labels, domains = [], [], []
    last, taken = None, 0
    for f in frames:
        d = f.domain or RECORDED
        last, taken = d, (taken if d == last else 0)
        if samples_per_domain and taken >= samples_per_domain:
            continue
        taken += 1
        images.append(_resized(f.image, image_size))
        labels.append(f.label if f.label >= 0 else UNLABELLED)
        domains.append(d)
    if not images:
        raise ValueError(f"bag {root}: no images on the camera topic")
    return Stream(np.stack(images), np.asarray(labels, np.int64), np.asarray(domains), (),
                  "continual", 0)
