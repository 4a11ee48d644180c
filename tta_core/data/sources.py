"""The user's data for `tta bench --data KIND:DIR`: the loaders of tta_core.data.loaders
behind one spec, with one-line errors that say which layout was expected.

Kinds and layouts (LAYOUTS, also in `tta bench --help` and the README):
- cifar10c:DIR   — the CIFAR-10-C release: DIR/<corruption>.npy, (5*n, 32, 32, 3) uint8
  with severities 1..5 stacked in blocks of n, and DIR/labels.npy (5*n labels);
- imagenet-c:DIR — the ImageNet-C release: DIR/<corruption>/<severity>/<class>/*.JPEG;
- folder:DIR     — any domains: DIR/<domain>/<class>/*.png|jpg|jpeg.
Corruption streams take the 15 standard corruptions found in DIR, in the standard order,
at one severity (or the corruptions asked for, in their order: `corruptions`, e.g. the 4
held-out ones a benchmark made by `tta make-benchmark` also holds); labels are class
indices (CIFAR-10 order, or meta.json's class names; sorted class folder names).
Images are resized to the model's input size.

Every stream order of tta_core.data.streams works on this data (`order`): continual,
mixed, dirichlet and recurring rearrange the continual stream (streams.arrange); gradual
reads each corruption at severities 1 -> 5 -> 1 (ceil(n / 9) samples per level, the
second visit of a level taking the next rows), so it needs a corruption layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tta_core.data.corruptions import ALL_CORRUPTIONS, CORRUPTIONS, HELD_OUT
from tta_core.data.layouts import DATA_KINDS, LAYOUTS, SEG_DATA_KINDS
from tta_core.data.loaders import load_cifar10c, load_image_folder
from tta_core.data.streams import GRADUAL_LEVELS, ORDERS, Stream, arrange, domain_name
from tta_core.errors import InputError, one_line


@dataclass(frozen=True)
class DataSpec:
    """Which loader reads which folder (`KIND:DIR`)."""

    kind: str
    root: Path

    def __str__(self) -> str:
        return f"{self.kind}:{self.root}"


def parse_data(text: str) -> DataSpec:
    """'cifar10c:DIR' -> DataSpec; ValueError naming `text` and the accepted forms."""
    kind, sep, root = text.partition(":")
    if not sep or kind not in DATA_KINDS or not root:
        raise ValueError(f"--data {text!r}: expected {', '.join(k + ':DIR' for k in DATA_KINDS)}")
    return DataSpec(kind, Path(root).expanduser())  # the shell leaves ~ after ":" as is


def _listing(root: Path, n: int = 6) -> str:
    names = sorted(p.name for p in root.iterdir())
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "") if names else "nothing"


CORRUPTION_SETS: dict[str, tuple[str, ...]] = {"standard": CORRUPTIONS, "held-out": HELD_OUT,
                                               "all": ALL_CORRUPTIONS}


def parse_corruptions(text: str) -> tuple[str, ...]:
    """'' -> () (the standard ones found); 'held-out' / 'standard' / 'all' -> that set;
    'fog,snow' -> those, in that order. ValueError naming an unknown name."""
    text = text.strip()
    if not text:
        return ()
    if text in CORRUPTION_SETS:
        return CORRUPTION_SETS[text]
    names = tuple(c.strip() for c in text.split(",") if c.strip())
    bad = [c for c in names if c not in ALL_CORRUPTIONS]
    if bad or not names or len(set(names)) < len(names):
        raise ValueError(f"--corruptions {text!r}: expected {', '.join(CORRUPTION_SETS)} or "
                         f"distinct names from {', '.join(ALL_CORRUPTIONS)}"
                         + (f" (unknown: {', '.join(bad)})" if bad else ""))
    return names


def _present(spec: DataSpec, wanted: Sequence[str] = ()) -> list[str]:
    """The corruptions to read: `wanted` (each must be in the folder), else the standard
    corruptions found, in the standard order."""
    def found(c: str) -> bool:
        p = spec.root / c
        return p.with_suffix(".npy").is_file() if spec.kind == "cifar10c" else p.is_dir()

    if wanted:
        missing = [c for c in wanted if not found(c)]
        if missing:
            what = "file" if spec.kind == "cifar10c" else "folder"
            raise InputError(f"--data {spec}: no {what} for corruption(s) "
                             f"{', '.join(missing)} (found {_listing(spec.root)})")
        return list(wanted)
    present = [c for c in CORRUPTIONS if found(c)]
    if not present:
        what = "file such as fog.npy" if spec.kind == "cifar10c" else "folder such as fog/"
        raise InputError(f"--data {spec}: no corruption {what} (found "
                         f"{_listing(spec.root)}); expected {LAYOUTS[spec.kind]}")
    return present


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 (N, H, W, 3) resized to (N, size, size, 3), bilinear (as the folder loader)."""
    if images.shape[1:3] == (size, size):
        return images
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.BILINEAR))
                     for im in images])


def _read(spec: DataSpec, image_size: int, severity: int, samples: int, seed: int,
          wanted: Sequence[str] = ()) -> Stream:
    if spec.kind == "cifar10c":
        stream = load_cifar10c(spec.root, _present(spec, wanted), severity, samples, seed)
        stream.images = resize_images(stream.images, image_size)
        return stream
    if spec.kind == "imagenet-c":
        domains = [f"{c}/{severity}" for c in _present(spec, wanted)]
    else:
        domains = None
    return load_image_folder(spec.root, domains, image_size, seed, samples)


def _gradual(spec: DataSpec, image_size: int, samples: int | None, seed: int,
             wanted: Sequence[str] = ()) -> Stream:
    """Each corruption found at severities GRADUAL_LEVELS (1 -> 5 -> 1), ceil(samples / 9)
    per level; a level's second visit takes the next rows (the first again if too few)."""
    if spec.kind in ("folder", "bag"):
        raise InputError(f"--data {spec}: order 'gradual' steps through severities 1-5; "
                         f"{spec.kind} data has none (use cifar10c:DIR or imagenet-c:DIR)")
    present = _present(spec, wanted)
    per = -(-samples // len(GRADUAL_LEVELS)) if samples else None
    pool: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    classes: tuple[str, ...] = ()
    for sev in sorted(set(GRADUAL_LEVELS)):
        take = 2 * per if per else None
        st = _read(spec, image_size, sev, take, seed, present)
        classes = st.class_names
        for d in dict.fromkeys(st.domains.tolist()):
            mask = st.domains == d
            pool[d] = (st.images[mask], st.labels[mask])
    images, labels, domains = [], [], []
    for c in present:
        visits: dict[int, int] = {}
        for sev in GRADUAL_LEVELS:
            d = domain_name(c, sev)
            ims, labs = pool[d]
            n = per or max(1, len(ims) // 2)
            k = visits.get(sev, 0)
            visits[sev] = k + 1
            rows = (np.arange(k * n, (k + 1) * n)) % len(ims)
            images.append(ims[rows])
            labels.append(labs[rows])
            domains += [d] * n
    return Stream(np.concatenate(images), np.concatenate(labels), np.array(domains), classes,
                  "gradual", seed)


def load_data(spec: DataSpec, image_size: int, severity: int = 5,
              samples_per_domain: int | None = None, seed: int = 0,
              order: str = "continual",
              bag_frames: Callable[[Path], Iterable[Any]] | None = None,
              corruptions: Sequence[str] = ()) -> Stream:
    """The stream in `spec`'s folder in `order` (module doc), images at `image_size` px,
    of `corruptions` (default: the standard ones found; not for folder or bag data);
    one-line errors (FileNotFoundError for a missing folder, InputError naming the
    expected layout or why the order does not fit the data). `bag_frames` reads a bag's
    frames (tta_core.io.bag.read_bag; tta_core.io imports this package, not the reverse)."""
    if order not in ORDERS:
        raise ValueError(f"--order {order!r}: choose from {', '.join(ORDERS)}")
    if spec.kind in SEG_DATA_KINDS:
        raise InputError(f"--data {spec}: {spec.kind} holds segmentation masks, not class "
                         "labels (use --task segmentation with a segmentation card)")
    if spec.kind == "bag" and order == "dirichlet":
        raise InputError(f"--data {spec}: order 'dirichlet' regroups by class; a bag's frames "
                         "keep their recorded classes (use continual, mixed or recurring)")
    if not spec.root.is_dir():
        raise FileNotFoundError(f"--data {spec}: folder {str(spec.root)!r} not found")
    if corruptions and spec.kind in ("folder", "bag"):
        raise InputError(f"--data {spec}: --corruptions picks corruption files or folders; "
                         f"{spec.kind} data has domains, not corruptions")
    try:
        if order == "gradual":
            return _gradual(spec, image_size, samples_per_domain, seed, corruptions)
        if spec.kind == "bag":
            from tta_core.data.bag_source import load_bag_stream

            if bag_frames is None:
                raise InputError(f"--data {spec}: no bag reader given (bag_frames)")
            return arrange(load_bag_stream(bag_frames(spec.root), spec.root, image_size,
                                           samples_per_domain), order, seed)
        return arrange(_read(spec, image_size, severity, samples_per_domain, seed,
                             corruptions), order, seed)
    except InputError:
        raise
    except (ValueError, FileNotFoundError) as exc:
        raise InputError(f"--data {spec}: {one_line(exc)}; expected "
                         f"{LAYOUTS[spec.kind]}") from None


# --- labelled images for the offline phases (`tta prepare`, `tta train-* --data`) -------

OFFLINE_KINDS: tuple[str, ...] = ("folder", "cifar10c", "bag")  # besides the built-in signs
SIGNS_SAMPLES = 2000  # built-in signs rendered when no count is given


@dataclass
class LabelledImages:
    """A user's clean labelled images at the model's input size: uint8 (N, H, W, 3),
    labels as indices into `class_names` (the model's), and where they came from."""

    images: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    source: dict[str, Any]

    def take(self, rows: np.ndarray) -> LabelledImages:
        """The images at `rows`."""
        return LabelledImages(self.images[rows], self.labels[rows], self.class_names,
                              self.source)

    def split(self, held: int, seed: int = 0) -> tuple[LabelledImages, LabelledImages]:
        """(fitting, held-out) parts: `held` images drawn by `seed`, at least one of each
        class present when there are enough; InputError when fewer than held + 1 images."""
        if held < 1 or len(self.labels) <= held:
            raise InputError(f"--data {self.source.get('data', '')}: {len(self.labels)} "
                             f"labelled images; {held} held out need at least {held + 1}")
        perm = np.random.default_rng([seed, 7]).permutation(len(self.labels))
        return self.take(np.sort(perm[held:])), self.take(np.sort(perm[:held]))


def class_map(found: Sequence[str], names: Sequence[str], data: str) -> np.ndarray:
    """Index in the model's `names` of each class `found` in the data: by name, or by
    position when the data's names are not the model's but as many (a folder's sorted
    class names are then the model's classes in order)."""
    if not names:
        return np.arange(len(found))
    if all(c in names for c in found):
        return np.array([list(names).index(c) for c in found], dtype=np.int64)
    if len(found) == len(names):
        return np.arange(len(found))
    unknown = [c for c in found if c not in names]
    raise InputError(f"--data {data}: class(es) {', '.join(unknown[:4])} are not among the "
                     f"model's {len(names)} class names ({', '.join(list(names)[:4])}, ...)")


def _cap(li: LabelledImages, samples: int, seed: int) -> LabelledImages:
    if samples <= 0 or samples >= len(li.labels):
        return li
    rows = np.random.default_rng([seed, 5]).permutation(len(li.labels))[:samples]
    return li.take(np.sort(rows))


def load_labelled(text: str, image_size: int, class_names: Sequence[str] = (),
                  samples: int = 0, seed: int = 0,
                  bag_frames: Callable[[Path], Iterable[Any]] | None = None) -> LabelledImages:
    """The clean labelled images of `text` for an offline phase, resized to `image_size`,
    labels in the model's `class_names` order; at most `samples` (0: all) drawn by `seed`:
    - '' or 'signs': the built-in synthetic signs (SIGNS_SAMPLES when `samples` is 0);
    - 'folder:DIR': every image of DIR/<domain>/<class>/* (e.g. one domain 'clean');
    - 'cifar10c:DIR': DIR/train.npy and train_labels.npy (`tta make-benchmark` writes them;
      the release's corruption files hold no clean images);
    - 'bag:DIR': the labelled frames of a rosbag2 folder (`bag_frames` reads them).
    One-line InputError naming the data and what was expected."""
    if text in ("", "signs"):
        from tta_core.data.signs import make_signs

        signs = make_signs(samples or SIGNS_SAMPLES, image_size, seed=seed,
                           num_classes=len(class_names) or None)
        found = signs.class_names
        return LabelledImages(signs.images, class_map(found, class_names, "signs")[
            signs.labels], tuple(class_names) or found, {"data": "signs", "seed": seed})
    spec = parse_data(text)
    if spec.kind not in OFFLINE_KINDS:
        raise InputError(f"--data {text!r}: the offline phases read clean labelled images "
                         f"from {', '.join(k + ':DIR' for k in OFFLINE_KINDS)} or the signs")
    if not spec.root.is_dir():
        raise FileNotFoundError(f"--data {spec}: folder {str(spec.root)!r} not found")
    try:
        images, labels, found = _labelled_arrays(spec, image_size, seed, bag_frames)
    except (InputError, FileNotFoundError):
        raise
    except ValueError as exc:
        raise InputError(f"--data {spec}: {one_line(exc)}; expected {LAYOUTS[spec.kind]}"
                         ) from None
    keep = labels >= 0  # a bag's unlabelled frames
    if not keep.any():
        raise InputError(f"--data {spec}: no labelled image (a bag needs /ground_truth)")
    mapping = class_map(found, class_names, str(spec)) if found else np.arange(
        int(labels.max()) + 1)
    li = LabelledImages(images[keep], mapping[labels[keep]],
                        tuple(class_names) or tuple(found),
                        {"data": str(spec), "kind": spec.kind, "root": str(spec.root.resolve()),
                         "images": int(keep.sum())})
    return _cap(li, samples, seed)


def _labelled_arrays(spec: DataSpec, image_size: int, seed: int,
                     bag_frames: Callable[[Path], Iterable[Any]] | None
                     ) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(images, labels, the data's class names) of one offline data folder."""
    if spec.kind == "folder":
        st = load_image_folder(spec.root, None, image_size, seed, None)
        return st.images, st.labels, st.class_names
    if spec.kind == "bag":
        from tta_core.data.bag_source import load_bag_stream

        if bag_frames is None:
            raise InputError(f"--data {spec}: no bag reader given (bag_frames)")
        st = load_bag_stream(bag_frames(spec.root), spec.root, image_size)
        return st.images, st.labels, ()
    from tta_core.data.loaders import cifar_class_names

    paths = [spec.root / "train.npy", spec.root / "train_labels.npy"]
    if not all(p.is_file() for p in paths):
        raise InputError(f"--data {spec}: no train.npy and train_labels.npy (the clean "
                         "labelled images `tta make-benchmark` writes; a CIFAR-10-C release "
                         "holds corrupted images only)")
    images = np.load(paths[0], mmap_mode="r", allow_pickle=False)
    labels = np.load(paths[1], allow_pickle=False).astype(np.int64)
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8 \
            or len(images) != len(labels):
        raise InputError(f"--data {spec}: train.npy {images.shape} {images.dtype} with "
                         f"{len(labels)} labels; expected (N, H, W, 3) uint8 and N labels")
    return resize_images(np.asarray(images), image_size), labels, cifar_class_names(spec.root)


def training_corruptions(corruptions: Sequence[str] = (), held_out: Sequence[str] = HELD_OUT
                         ) -> tuple[str, ...]:
    """The corruptions an offline phase makes labelled images with: `corruptions` (default:
    the 15 standard ones) less `held_out` (default: the 4 held-out ones, never seen
    offline); ValueError naming an unknown one or when fewer than 2 are left."""
    wanted = tuple(corruptions) or CORRUPTIONS
    bad = [c for c in (*wanted, *held_out) if c not in ALL_CORRUPTIONS]
    if bad:
        raise ValueError(f"unknown corruption {bad[0]!r}; choose from "
                         f"{', '.join(ALL_CORRUPTIONS)}")
    left = tuple(c for c in wanted if c not in held_out)
    if len(left) < 2:
        raise ValueError(f"corruptions {', '.join(wanted)} less the held-out "
                         f"{', '.join(held_out) or 'none'} leave {len(left)}; need >= 2")
    return left


def corrupted_copies(images: np.ndarray, corruptions: Sequence[str], severity: int,
                     seed: int, progress: Callable[[str], None] | None = None
                     ) -> list[np.ndarray]:
    """`images` under each corruption at `severity` (the corruption library, per-image
    seeds from `seed` and the corruption), one array per corruption; `progress` is called
    after each with its name."""
    from tta_core.data.corruptions import corrupt_batch

    out = []
    for c in corruptions:
        out.append(corrupt_batch(images, c, severity, seed))
        if progress is not None:
            progress(c)
    return out
