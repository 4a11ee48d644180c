"""`tta make-bag OUT`: write a rosbag2 of a shifting synthetic camera stream (traffic signs
under corruptions, one domain after the other) with ground truth on side topics."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from tta_core.io.bag import BagInfo

NAME = "make-bag"
HELP = "write a rosbag2 of a shifting synthetic camera stream with ground-truth labels"
DEFAULT_DOMAINS = "clean,gaussian_noise/5,fog/5,contrast/5,clean"


def parse_domains(text: str) -> list[tuple[str | None, int]]:
    """"clean,fog/5,snow/3" -> [(None, 0), ("fog", 5), ("snow", 3)] (ValueError if bad)."""
    out: list[tuple[str | None, int]] = []
    for item in (t.strip() for t in text.split(",")):
        if item == "clean":
            out.append((None, 0))
            continue
        name, sep, sev = item.partition("/")
        if not name or not sep or not sev.isdigit() or not 1 <= int(sev) <= 5:
            raise ValueError(f"domain {item!r}: expected 'clean' or '<corruption>/<1..5>'")
        out.append((name, int(sev)))
    return out


def stream_frames(n: int, image_size: int, domains: Sequence[tuple[str | None, int]],
                  seed: int) -> Iterator[tuple[np.ndarray, int, str]]:
    """`n` sign images split evenly over `domains` in order, each domain's images corrupted
    at its severity; yields (image, label, domain name)."""
    import numpy as np

    from tta_core.data.corruptions import corrupt_batch
    from tta_core.data.signs import make_signs
    from tta_core.data.streams import domain_name

    if n < len(domains):
        raise ValueError(f"--frames {n} is fewer than the {len(domains)} domains")
    ds = make_signs(n, image_size, seed=seed)
    bounds = np.linspace(0, n, len(domains) + 1).round().astype(int)
    for k, (corruption, severity) in enumerate(domains):
        lo, hi = bounds[k], bounds[k + 1]
        imgs = ds.images[lo:hi]
        if corruption:
            imgs = corrupt_batch(imgs, corruption, severity, seed=seed + k)
        for img, label in zip(imgs, ds.labels[lo:hi], strict=True):
            yield img, int(label), domain_name(corruption, severity)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """OUT and the stream's frames, size, domains, seed, rate and storage."""
    parser.add_argument("out", type=Path, help="bag directory to create (must not exist)")
    parser.add_argument("--frames", type=int, default=240, help="images in the stream")
    parser.add_argument("--image-size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--domains", default=DEFAULT_DOMAINS,
                        help="comma-separated 'clean' or '<corruption>/<severity>', in order")
    parser.add_argument("--seed", type=int, default=0, help="seed of images and corruptions")
    parser.add_argument("--rate", type=float, default=30.0, help="camera rate in Hz")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")


def make_bag(out: Path, frames: int, image_size: int, domains: str, seed: int,
             rate: float = 30.0, storage: str = "mcap", progress: bool = True) -> BagInfo:
    """Write the bag; returns its tta_core.io.bag.BagInfo."""
    from tqdm import tqdm

    from tta_core.data.signs import CLASS_NAMES
    from tta_core.io.bag import BagWriter, bag_info

    doms = parse_domains(domains)
    if frames < 1:
        raise ValueError(f"--frames must be >= 1, got {frames}")
    with BagWriter(out, rate, class_names=CLASS_NAMES, storage=storage) as w:
        it = stream_frames(frames, image_size, doms, seed)
        for img, label, dom in tqdm(it, total=frames, desc="make-bag", unit="img",
                                    disable=not progress):
            w.add(img, label, dom)
    return bag_info(out)


def run(args: argparse.Namespace) -> int:
    """Write the bag; 2 with a one-line message on bad options or an existing OUT."""
    try:
        info = make_bag(args.out, args.frames, args.image_size, args.domains, args.seed,
                        args.rate, args.storage)
    except (ValueError, FileExistsError) as exc:
        print(f"tta make-bag: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in Path(args.out).rglob("*") if p.is_file())
    print(f"wrote {args.out}: {info.n_images} images, {info.duration_s:.1f} s, "
          f"{size / 1e6:.2f} MB")
    return 0
