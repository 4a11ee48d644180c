"""Segmentation data: `--data cityscapes:DIR` and `--data acdc:DIR` (the public layouts,
or what `tta make-benchmark --scenes` writes), images with train-id masks (255 = ignore).

- cityscapes:DIR — DIR/leftImg8bit/<split>/<city>/<name>_leftImg8bit.png with
  DIR/gtFine/<split>/<city>/<name>_gtFine_labelTrainIds.png; one domain, 'clean';
- acdc:DIR — DIR/rgb_anon/<condition>/<split>/<seq>/<name>_rgb_anon.png with
  DIR/gt/<condition>/<split>/<seq>/<name>_gt_labelTrainIds.png; one domain per condition
  (fog, night, rain, snow: those present, in that order, or the ones asked for).

Images are resized to the model's (H, W) bilinearly, masks by nearest neighbour. Masks must
hold train ids (0-18) or 255: a labelIds file (Cityscapes' 34 ids) is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tta_core.data.scenes import CITYSCAPES_CLASSES, IGNORE

SEG_KINDS: tuple[str, ...] = ("cityscapes", "acdc")
ACDC_CONDITIONS: tuple[str, ...] = ("fog", "night", "rain", "snow")
CLEAN = "clean"


@dataclass
class SegmentationSet:
    """Images with masks held in memory, in stream order (a domain after another)."""

    images: np.ndarray  # (N, H, W, 3) uint8
    masks: np.ndarray  # (N, H, W) uint8 train ids, 255 = ignore
    domains: np.ndarray  # (N,) str
    class_names: tuple[str, ...] = CITYSCAPES_CLASSES

    def __len__(self) -> int:
        return int(self.masks.shape[0])

    def batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray, str]]:
        """(images, masks, domain) batches that never straddle a domain change."""
        start = 0
        while start < len(self):
            end = min(start + batch_size, len(self))
            same = np.flatnonzero(self.domains[start:end] != self.domains[start])
            end = start + int(same[0]) if len(same) else end
            yield self.images[start:end], self.masks[start:end], str(self.domains[start])
            start = end


def _pairs(image_dir: Path, label_dir: Path, image_suffix: str,
           label_suffix: str) -> list[tuple[Path, Path]]:
    """(image, mask) files under a split folder's sub-folders, sorted; FileNotFoundError
    naming the first image without its mask."""
    out = []
    for img in sorted(image_dir.glob(f"*/*{image_suffix}")):
        lab = label_dir / img.parent.name / (img.name[: -len(image_suffix)] + label_suffix)
        if not lab.is_file():
            raise FileNotFoundError(f"mask {str(lab)!r} of image {str(img)!r} not found")
        out.append((img, lab))
    if not out:
        raise FileNotFoundError(f"no *{image_suffix} files in the sub-folders of "
                                f"{str(image_dir)!r}")
    return out


def _read_pair(img: Path, lab: Path, hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    import cv2

    image = cv2.imread(str(img), cv2.IMREAD_COLOR)
    mask = cv2.imread(str(lab), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError(f"{str(img)!r} is not a readable image")
    if mask is None or mask.ndim != 2 or mask.dtype != np.uint8:
        raise ValueError(f"{str(lab)!r} is not a single-channel 8-bit train-id mask")
    bad = np.setdiff1d(np.unique(mask), np.r_[np.arange(len(CITYSCAPES_CLASSES)), IGNORE])
    if len(bad):
        raise ValueError(f"{str(lab)!r} holds value(s) {bad[:5].tolist()}, not train ids "
                         "0-18 or 255 (a labelIds file? use *_labelTrainIds.png)")
    h, w = hw
    if image.shape[:2] != (h, w):
        image = cv2.resize(image, (w, h), interpolation=cv2.INTER_LINEAR)
        mask = cv2.resize(mask, (w, h), interpolation=cv2.INTER_NEAREST)
    return image[..., ::-1], mask


def _read_all(pairs: Sequence[tuple[Path, Path]], hw: tuple[int, int]
              ) -> tuple[np.ndarray, np.ndarray]:
    images = np.empty((len(pairs), *hw, 3), np.uint8)
    masks = np.empty((len(pairs), *hw), np.uint8)
    for k, (img, lab) in enumerate(pairs):
        images[k], masks[k] = _read_pair(img, lab, hw)
    return images, masks


def _take(pairs: list, limit: int | None, seed: int | None) -> list:
    if seed is not None:
        pairs = [pairs[i] for i in np.random.default_rng(seed).permutation(len(pairs))]
    return pairs[:limit] if limit else pairs


def load_cityscapes(root: str | Path, split: str = "val", hw: tuple[int, int] = (128, 256),
                    limit: int | None = None, seed: int | None = None) -> SegmentationSet:
    """The `split` of a Cityscapes-layout folder (the first `limit` files, shuffled by
    `seed` when given); FileNotFoundError naming the missing folder or mask."""
    root = Path(root)
    image_dir, label_dir = root / "leftImg8bit" / split, root / "gtFine" / split
    for d in (image_dir, label_dir):
        if not d.is_dir():
            raise FileNotFoundError(f"cityscapes:{root}: folder {str(d)!r} not found "
                                    "(expected leftImg8bit/<split>/<city>/*_leftImg8bit.png "
                                    "and gtFine/<split>/<city>/*_gtFine_labelTrainIds.png)")
    pairs = _take(_pairs(image_dir, label_dir, "_leftImg8bit.png",
                         "_gtFine_labelTrainIds.png"), limit, seed)
    images, masks = _read_all(pairs, hw)
    return SegmentationSet(images, masks, np.array([CLEAN] * len(pairs)))


def load_acdc(root: str | Path, conditions: Sequence[str] = (), split: str = "val",
              hw: tuple[int, int] = (128, 256), limit: int | None = None,
              seed: int | None = None) -> SegmentationSet:
    """The `split` of each condition of an ACDC-layout folder, one domain after another
    (`limit` images per condition); FileNotFoundError naming what is missing."""
    root = Path(root)
    if not (root / "rgb_anon").is_dir() or not (root / "gt").is_dir():
        raise FileNotFoundError(f"acdc:{root}: folders {str(root / 'rgb_anon')!r} and "
                                f"{str(root / 'gt')!r} not found (expected rgb_anon/<condition>"
                                "/<split>/<seq>/*_rgb_anon.png, gt/<condition>/<split>/<seq>/"
                                "*_gt_labelTrainIds.png)")
    names = list(conditions) or [c for c in ACDC_CONDITIONS if (root / "rgb_anon" / c).is_dir()]
    if not names:
        raise FileNotFoundError(f"acdc:{root}: no condition folder ({', '.join(ACDC_CONDITIONS)}) "
                                f"in {str(root / 'rgb_anon')!r}")
    images, masks, domains = [], [], []
    for c in names:
        image_dir, label_dir = root / "rgb_anon" / c / split, root / "gt" / c / split
        if not image_dir.is_dir() or not label_dir.is_dir():
            raise FileNotFoundError(f"acdc:{root}: condition {c!r} has no folders "
                                    f"{str(image_dir)!r} and {str(label_dir)!r}")
        pairs = _take(_pairs(image_dir, label_dir, "_rgb_anon.png",
                             "_gt_labelTrainIds.png"), limit, seed)
        ims, ms = _read_all(pairs, hw)
        images.append(ims)
        masks.append(ms)
        domains += [c] * len(pairs)
    return SegmentationSet(np.concatenate(images), np.concatenate(masks), np.array(domains))


def load_segmentation(text: str, split: str = "val", hw: tuple[int, int] = (128, 256),
                      limit: int | None = None, conditions: Sequence[str] = (),
                      seed: int | None = None) -> SegmentationSet:
    """'cityscapes:DIR' or 'acdc:DIR' read; ValueError naming a spec of another form."""
    kind, sep, root = text.partition(":")
    if not sep or kind not in SEG_KINDS or not root:
        raise ValueError(f"--data {text!r}: segmentation data is "
                         f"{' or '.join(k + ':DIR' for k in SEG_KINDS)}")
    path = Path(root).expanduser()
    if kind == "cityscapes":
        if conditions:
            raise ValueError(f"--data {text!r}: conditions are ACDC's; cityscapes has none")
        return load_cityscapes(path, split, hw, limit, seed)
    return load_acdc(path, conditions, split, hw, limit, seed)


def mask_tensor(masks: np.ndarray):
    """uint8 (N, H, W) masks -> LongTensor (255 stays the ignore index)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(masks)).long()
