"""Real-data loaders that yield the same `Stream` as the synthetic benchmark.

- CIFAR-10-C (Hendrycks & Dietterich 2019), public layout: `<root>/<corruption>.npy` of
  shape (5 * n, 32, 32, 3) uint8 holding severities 1..5 in consecutive blocks of n
  (n = 10000 in the release; smaller files are accepted when the length divides by 5),
  and `<root>/labels.npy` with the matching labels. The class names are CIFAR-10's unless
  `<root>/meta.json` lists others (`class_names`: the benchmark tta makes,
  tta_core.data.benchmark, writes one).
- Image-folder domains (NICO++ style): `<root>/<domain>/<class>/*.{png,jpg,jpeg}`; classes
  are the union of class folder names, sorted; domains in the order given (or sorted).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tta_core.data.corruptions import CORRUPTIONS, check
from tta_core.data.streams import Stream, domain_name

CIFAR10_CLASSES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer", "dog",
                                    "frog", "horse", "ship", "truck")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def _load_npy(path: Path) -> np.ndarray:
    """The array in `path`, memory-mapped (only the rows a stream takes are read: a
    release file holds 150 MB); never unpickled."""
    if not path.is_file():
        raise FileNotFoundError(f"CIFAR-10-C file {str(path)!r} not found")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)  # never unpickle
    except (ValueError, OSError) as exc:
        raise ValueError(f"{str(path)!r} is not a .npy array file "
                         f"({' '.join(str(exc).split())[:120]})") from None


def load_cifar10c(root: str | Path, corruptions: Sequence[str] = CORRUPTIONS,
                  severity: int = 5, samples_per_domain: int | None = None,
                  seed: int = 0) -> Stream:
    """Continual stream over `corruptions` at `severity` from a CIFAR-10-C folder. Seed 0
    takes each corruption's first `samples_per_domain` rows in file order (the published
    protocol's stream); another seed draws them at random (seed, corruption index), so
    the seeds of a sweep see different images, not one stream again."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"CIFAR-10-C folder {str(root)!r} not found")
    labels_all = _load_npy(root / "labels.npy").astype(np.int64)
    images, labels, domains = [], [], []
    for k, name in enumerate(corruptions):
        check(name, severity)
        arr = _load_npy(root / f"{name}.npy")
        if arr.ndim != 4 or arr.shape[1:] != (32, 32, 3) or arr.dtype != np.uint8:
            raise ValueError(f"{name}.npy has shape {arr.shape} {arr.dtype}; expected "
                             "(5*n, 32, 32, 3) uint8")
        if len(arr) % 5 or len(arr) != len(labels_all):
            raise ValueError(f"{name}.npy has {len(arr)} rows and labels.npy "
                             f"{len(labels_all)}: need equal lengths divisible by 5")
        n = len(arr) // 5
        take = n if samples_per_domain is None else min(n, samples_per_domain)
        rows = np.arange(take) if seed == 0 else \
            np.random.default_rng([seed, k, 0xC10C]).permutation(n)[:take]
        rows = rows + (severity - 1) * n
        images.append(arr[rows])
        labels.append(labels_all[rows])
        domains += [domain_name(name, severity)] * take
    return Stream(np.concatenate(images), np.concatenate(labels), np.array(domains),
                  cifar_class_names(root), "continual", seed)


META = "meta.json"  # what tta make-benchmark writes beside the CIFAR-10-C layout


def read_meta(root: str | Path) -> dict | None:
    """A CIFAR-10-C layout folder's meta.json as a dict, None where it has none;
    ValueError when it is not a JSON object."""
    path = Path(root) / META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not JSON ({exc}); delete it to regenerate") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{str(path)!r} is not a JSON object")
    return meta


def cifar_class_names(root: str | Path) -> tuple[str, ...]:
    """The class names of a CIFAR-10-C layout folder: meta.json's `class_names` when the
    folder has one (a benchmark made by tta), else CIFAR-10's."""
    meta = read_meta(root)
    if meta is None:
        return CIFAR10_CLASSES
    names = meta.get("class_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not names:
        raise ValueError(f"{str(Path(root) / META)!r}: class_names must be a list of strings")
    return tuple(names)


def _read_image(path: Path, image_size: int) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB").resize((image_size, image_size), Image.BILINEAR)
    except OSError as exc:
        raise ValueError(f"{str(path)!r} is not a readable image ({exc})") from None
    return np.asarray(rgb, dtype=np.uint8)


def load_image_folder(root: str | Path, domains: Sequence[str] | None = None,
                      image_size: int = 64, shuffle_seed: int | None = 0,
                      samples_per_domain: int | None = None) -> Stream:
    """Continual stream over domain folders, images resized to `image_size` (RGB uint8);
    within a domain the files are shuffled by `shuffle_seed` (None keeps sorted order) and
    the first `samples_per_domain` (None: all) are read."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image-folder root {str(root)!r} not found")
    names = list(domains) if domains else sorted(p.name for p in root.iterdir() if p.is_dir())
    if not names:
        raise ValueError(f"no domain folders under {str(root)!r}")
    missing = [d for d in names if not (root / d).is_dir()]
    if missing:
        raise FileNotFoundError(f"domain folder(s) {missing} not found under {str(root)!r}")
    classes = sorted({c.name for d in names for c in (root / d).iterdir() if c.is_dir()})
    images, labels, doms = [], [], []
    for d in names:
        files = sorted(f for c in classes if (root / d / c).is_dir()
                       for f in (root / d / c).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"domain {d!r} has no images ({', '.join(IMAGE_SUFFIXES)})")
        if shuffle_seed is not None:
            perm = np.random.default_rng([shuffle_seed, len(doms)]).permutation(len(files))
            files = [files[i] for i in perm]
        for f in files[:samples_per_domain]:
            images.append(_read_image(f, image_size))
            labels.append(classes.index(f.parent.name))
            doms.append(d)
    return Stream(np.stack(images), np.array(labels, dtype=np.int64), np.array(doms),
                  tuple(classes), "continual", 0)
