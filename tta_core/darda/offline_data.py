"""The labelled images of DARDA's offline phase (tta_core.darda.offline): the built-in
signs rendered under the training corruptions (the small default), or a folder in the
CIFAR-10-C layout (`tta train-darda --data cifar10c:DIR`).

From a folder, for each training corruption at the configured severity (its block of n
rows in `<corruption>.npy`, labels in `labels.npy`):
- fitting rows: the block's first `samples` rows (the sub-networks, the encoders, the
  centroids);
- evaluation rows (the accuracy matrix a_ij, the Eq. 16 probe): the next `eval_samples`
  images, i.e. images whose content no fitting row holds under any corruption. When the
  block ends before them and the folder is a benchmark made by tta
  (tta_core.data.benchmark: `test.npy`, `test_labels.npy`, meta.json's config), they are
  the clean test images n.. corrupted here with the benchmark's own per-image seeds: the
  bytes a larger benchmark holds at those rows. A release folder without `test.npy` needs
  a block of `samples + eval_samples` rows.
The held-out corruptions (`corruptions.HELD_OUT`, the evaluation's unseen ones) are never
read: asking for one raises before any file is opened. Images are resized to the model's
input size and normalised with its mean / std.

`OfflineData.source` says where the images came from (stored in the bundle's metadata):
kind, folder, meta.json's fingerprint (SHA-256 over its recorded file hashes) and
benchmark config when present, severity, the rows used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tta_core.data.corruptions import HELD_OUT, SEVERITIES, corrupt_image
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.sources import resize_images
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.errors import InputError


@dataclass
class Labelled:
    """Normalised images, class labels and corruption indices."""

    x: Tensor
    y: Tensor
    d: Tensor

    def only(self, j: int) -> Labelled:
        """The images of corruption j."""
        sel = self.d == j
        return Labelled(self.x[sel], self.y[sel], self.d[sel])


@dataclass
class OfflineData:
    """Fitting images (`train`), evaluation images (`held`) and where they came from."""

    train: Labelled
    held: Labelled
    source: dict[str, Any] = field(default_factory=dict)


def check_training_corruptions(corruptions: tuple[str, ...] | list[str]) -> None:
    """ValueError when a held-out corruption is asked for offline."""
    held = [c for c in corruptions if c in HELD_OUT]
    if held:
        raise ValueError(f"train-darda: held-out corruption {held[0]!r} asked for offline "
                         f"(the held-out {', '.join(HELD_OUT)} are the evaluation's unseen "
                         "corruptions)")


def render(corruptions: tuple[str, ...], n: int, severity: int, seed: int, size: int,
           mean: tuple[float, ...], std: tuple[float, ...]) -> Labelled:
    """n built-in sign images per corruption at `severity`, normalised."""
    check_training_corruptions(corruptions)
    stream = build_stream(StreamSpec(order="continual", corruptions=corruptions,
                                     samples_per_domain=n, severity=severity, seed=seed,
                                     image_size=size))
    names = [d.split("/")[0] for d in stream.domains.tolist()]
    d = torch.tensor([corruptions.index(k) for k in names])
    return Labelled(images_to_tensor(stream.images, mean, std),
                    torch.as_tensor(stream.labels, dtype=torch.long), d)


def rendered_data(corruptions: tuple[str, ...], samples: int, eval_samples: int,
                  severity: int, seed: int, size: int, mean: tuple[float, ...],
                  std: tuple[float, ...]) -> OfflineData:
    """The default: built-in signs rendered under the corruptions (fitting seed `seed`,
    evaluation seed `seed + 1`)."""
    return OfflineData(render(corruptions, samples, severity, seed, size, mean, std),
                       render(corruptions, eval_samples, severity, seed + 1, size, mean, std),
                       {"kind": "rendered", "severity": severity, "seed": seed})


def _npy(path: Path, data: str) -> np.ndarray:
    if not path.is_file():
        raise InputError(f"--data {data}: {path.name} not found in {str(path.parent)!r} "
                         "(the offline phase reads <corruption>.npy and labels.npy of each "
                         "training corruption)")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise InputError(f"--data {data}: {path.name} is not a .npy array file "
                         f"({' '.join(str(exc).split())[:120]})") from None


def _meta(root: Path, data: str) -> dict[str, Any]:
    path = root / "meta.json"
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise InputError(f"--data {data}: meta.json is not JSON") from None
    if not isinstance(meta, dict):
        raise InputError(f"--data {data}: meta.json is not a JSON object")
    return meta


def meta_fingerprint(meta: dict[str, Any]) -> str:
    """SHA-256 over meta.json's sorted (file, SHA-256) pairs ('' without files): the
    benchmark's identity (as tta_core.data.benchmark.fingerprint)."""
    files = meta.get("files") or {}
    if not isinstance(files, dict) or not files:
        return ""
    pairs = "".join(f"{k}:{v}\n" for k, v in sorted(files.items()))
    return hashlib.sha256(pairs.encode()).hexdigest()


class _Folder:
    """One CIFAR-10-C layout folder, read a block at a time (held-out files refused)."""

    def __init__(self, root: Path, severity: int) -> None:
        self.root, self.severity = root, severity
        self.data = f"cifar10c:{root}"
        if not root.is_dir():
            raise InputError(f"--data {self.data}: folder not found")
        self.labels = _npy(root / "labels.npy", self.data).astype(np.int64)
        self.meta = _meta(root, self.data)

    def block(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(images, labels) of `name`'s severity block (memory-mapped)."""
        if name in HELD_OUT:  # never read offline, whatever the caller checked
            raise ValueError(f"train-darda: refusing to read held-out corruption {name!r}")
        arr = _npy(self.root / f"{name}.npy", self.data)
        if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8 or len(arr) % 5 \
                or len(arr) != len(self.labels):
            raise InputError(f"--data {self.data}: {name}.npy is {arr.shape} {arr.dtype} "
                             f"with {len(self.labels)} labels; expected (5 n, H, W, 3) uint8 "
                             "and as many labels")
        n = len(arr) // 5
        sl = slice((self.severity - 1) * n, self.severity * n)
        return arr[sl], self.labels[sl]

    def extension(self, name: str, n: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Images lo..hi (>= n) of `name` at the severity as a larger benchmark holds them:
        the clean test images corrupted with the benchmark's per-image seeds."""
        from tta_core.data.benchmark import corruption_seeds

        cfg = self.meta.get("config")
        test_path = self.root / "test.npy"
        if not isinstance(cfg, dict) or "seed" not in cfg or not test_path.is_file():
            raise InputError(f"--data {self.data}: {name}.npy holds {n} rows per severity; "
                             f"{hi} are needed (fitting + evaluation) and the folder is no "
                             "benchmark made by tta (test.npy, meta.json's config) to take "
                             "the evaluation rows from; lower --samples or --eval-samples")
        test = _npy(test_path, self.data)
        test_labels = _npy(self.root / "test_labels.npy", self.data).astype(np.int64)
        if hi > len(test) or len(test_labels) != len(test):
            raise InputError(f"--data {self.data}: test.npy holds {len(test)} images; rows "
                             f"up to {hi} are needed for the evaluation of {name}")
        seeds = corruption_seeds(name, hi, int(cfg["seed"]))[self.severity - 1]
        sev = SEVERITIES[self.severity - 1]
        images = np.stack([corrupt_image(np.asarray(test[i]), name, sev, int(seeds[i]))
                           for i in range(lo, hi)])
        return images, test_labels[lo:hi]


def folder_rows(root: str | Path, corruptions: tuple[str, ...]) -> int:
    """The fewest rows per severity among the corruptions' files in a CIFAR-10-C layout
    folder (InputError for a missing or bad file; ValueError for a held-out one)."""
    check_training_corruptions(corruptions)
    folder = _Folder(Path(root).expanduser(), 1)
    return min(len(folder.block(name)[0]) for name in corruptions)


def folder_samples(root: str | Path, corruptions: tuple[str, ...], eval_samples: int,
                   cap: int) -> int:
    """The most fitting images per corruption up to `cap` that the folder gives with
    `eval_samples` evaluation images besides: all of a block's rows when the evaluation rows
    can come from past it (a benchmark made by tta), else the rows before them."""
    n = folder_rows(root, corruptions)
    root = Path(root).expanduser()
    extends = (root / "test.npy").is_file() and \
        isinstance(_meta(root, f"cifar10c:{root}").get("config"), dict)
    take = min(cap, n if extends else n - eval_samples)
    if take < 1:
        raise InputError(f"--data cifar10c:{root}: {n} rows per severity leave none to fit "
                         f"on besides --eval-samples {eval_samples}")
    return take


def folder_data(root: str | Path, corruptions: tuple[str, ...], samples: int,
                eval_samples: int, severity: int, size: int, mean: tuple[float, ...],
                std: tuple[float, ...],
                class_names: Sequence[str] | None = None) -> OfflineData:
    """The fitting and evaluation images of a CIFAR-10-C layout folder (module doc);
    InputError (one line) for a folder without the corruption files, too few rows for
    `samples`, class names (meta.json's) other than the model's `class_names` or labels
    beyond them; ValueError for a held-out corruption."""
    check_training_corruptions(corruptions)
    root = Path(root).expanduser()
    folder = _Folder(root, severity)
    names = folder.meta.get("class_names")
    if class_names is not None and isinstance(names, list) and list(names) != list(class_names):
        raise InputError(f"--data {folder.data}: meta.json's {len(names)} class names differ "
                         f"from the model's {len(class_names)} ({names[:3]} vs "
                         f"{list(class_names)[:3]} ...)")
    fit_x, fit_y, ev_x, ev_y, fit_d, ev_d = [], [], [], [], [], []
    ev_from, n_rows = "file", 0
    for j, name in enumerate(corruptions):
        images, labels = folder.block(name)
        n = n_rows = len(images)
        if samples > n:
            raise InputError(f"--data {folder.data}: --samples {samples} but {name}.npy "
                             f"holds {n} rows per severity")
        fit_x.append(resize_images(np.asarray(images[:samples]), size))
        fit_y.append(labels[:samples])
        hi = samples + eval_samples
        if hi <= n:
            ex, ey = np.asarray(images[samples:hi]), labels[samples:hi]
        else:
            ex, ey = folder.extension(name, n, samples, hi)
            ev_from = "test.npy corrupted with the benchmark's seeds"
        ev_x.append(resize_images(ex, size))
        ev_y.append(ey)
        fit_d += [j] * samples
        ev_d += [j] * eval_samples
    y_all = np.concatenate(fit_y + ev_y)
    if class_names is not None and (y_all.min() < 0 or y_all.max() >= len(class_names)):
        raise InputError(f"--data {folder.data}: labels reach {int(y_all.max())}, the model "
                         f"has {len(class_names)} classes")

    def labelled(xs: list[np.ndarray], ys: list[np.ndarray], ds: list[int]) -> Labelled:
        return Labelled(images_to_tensor(np.concatenate(xs), mean, std),
                        torch.as_tensor(np.concatenate(ys), dtype=torch.long),
                        torch.tensor(ds, dtype=torch.long))

    source = {"kind": "cifar10c", "root": str(root.resolve()), "severity": severity,
              "rows_per_severity": n_rows, "fit_rows": [0, samples],
              "eval_rows": [samples, samples + eval_samples], "eval_from": ev_from,
              "meta_fingerprint": meta_fingerprint(folder.meta)}
    if isinstance(folder.meta.get("config"), dict):
        source["benchmark_config"] = folder.meta["config"]
    return OfflineData(labelled(fit_x, fit_y, fit_d), labelled(ev_x, ev_y, ev_d), source)
