"""`tta make-bag OUT`: write a rosbag2 of a shifting synthetic camera stream (traffic signs
under corruptions, one domain after the other) with ground truth on side topics.

`--task segmentation` writes driving scenes instead (tta_core.data.scenes, 128 x 256)
under ACDC-style conditions (fog, night, rain, snow: tta_core.data.scene_conditions), with
each frame's train-id mask on /ground_truth/segmentation (tta_core.io.bag)."""

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
#: --task segmentation's default: the scene benchmark's conditions at its severities
SEG_DOMAINS = "clean,fog/4,night/4,rain/4,snow/3"
TASKS = ("classification", "segmentation")
#: the rng stream of the bag's scenes (the benchmark's splits use 1, 2 and 10-13)
SCENE_STREAM = 20


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


def scene_frames(n: int, domains: Sequence[tuple[str | None, int]], seed: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, str]]:
    """`n` driving scenes split evenly over `domains` (clean or a scene condition), each
    rendered from (seed, SCENE_STREAM, index) alone; yields (image, mask, domain name)."""
    import numpy as np

    from tta_core.data.scene_conditions import CONDITIONS, render_condition
    from tta_core.data.scenes import render_scene
    from tta_core.data.streams import domain_name

    if n < len(domains):
        raise ValueError(f"--frames {n} is fewer than the {len(domains)} domains")
    bad = [c for c, _ in domains if c is not None and c not in CONDITIONS]
    if bad:
        raise ValueError(f"domain {bad[0]!r}: segmentation conditions are "
                         f"{', '.join(CONDITIONS)} (or clean)")
    bounds = np.linspace(0, n, len(domains) + 1).round().astype(int)
    for k, (condition, severity) in enumerate(domains):
        for i in range(bounds[k], bounds[k + 1]):
            scene = render_scene((seed, SCENE_STREAM, i))
            image = scene.image if condition is None else render_condition(
                scene, condition, severity, seed + 1000 * k + i)
            yield image, scene.label, domain_name(condition, severity)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """OUT and the stream's frames, size, domains, seed, rate and storage."""
    parser.add_argument("out", type=Path, help="bag directory to create (must not exist)")
    parser.add_argument("--task", choices=TASKS, default="classification",
                        help="classification: traffic signs with labels; segmentation: "
                        "driving scenes (128 x 256) with train-id masks")
    parser.add_argument("--frames", type=int, default=240, help="images in the stream")
    parser.add_argument("--image-size", type=int, default=32,
                        help="image side in pixels (classification)")
    parser.add_argument("--domains", default=None,
                        help="comma-separated 'clean' or '<corruption>/<severity>', in order "
                        f"(default: {DEFAULT_DOMAINS}; segmentation: {SEG_DOMAINS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of images and corruptions")
    parser.add_argument("--rate", type=float, default=30.0, help="camera rate in Hz")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")


def make_bag(out: Path, frames: int, image_size: int, domains: str | None, seed: int,
             rate: float = 30.0, storage: str = "mcap", progress: bool = True,
             task: str = "classification") -> BagInfo:
    """Write the bag (`task` segmentation: driving scenes with masks; `image_size` is then
    unused); returns its tta_core.io.bag.BagInfo."""
    from tqdm import tqdm

    from tta_core.data.scenes import CITYSCAPES_CLASSES
    from tta_core.data.signs import CLASS_NAMES
    from tta_core.io.bag import BagWriter, bag_info

    seg = task == "segmentation"
    doms = parse_domains(domains or (SEG_DOMAINS if seg else DEFAULT_DOMAINS))
    if frames < 1:
        raise ValueError(f"--frames must be >= 1, got {frames}")
    names = CITYSCAPES_CLASSES if seg else CLASS_NAMES
    with BagWriter(out, rate, class_names=names, storage=storage, task=task) as w:
        it = (scene_frames(frames, doms, seed) if seg else
              stream_frames(frames, image_size, doms, seed))
        for img, label, dom in tqdm(it, total=frames, desc="make-bag", unit="img",
                                    disable=not progress):
            w.add(img, label, dom)
    return bag_info(out)


def run(args: argparse.Namespace) -> int:
    """Write the bag; 2 with a one-line message on bad options or an existing OUT."""
    try:
        info = make_bag(args.out, args.frames, args.image_size, args.domains, args.seed,
                        args.rate, args.storage, task=args.task)
    except (ValueError, FileExistsError) as exc:
        print(f"tta make-bag: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in Path(args.out).rglob("*") if p.is_file())
    print(f"wrote {args.out}: {info.n_images} images, {info.duration_s:.1f} s, "
          f"{size / 1e6:.2f} MB")
    return 0
