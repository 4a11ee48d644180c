"""The synthetic driving-scene benchmark on disk: Cityscapes and ACDC layouts, no download.

`generate(root, cfg)` writes

    leftImg8bit/{train,val}/<city>/<city>_<i>_000019_leftImg8bit.png       clean scenes
    gtFine/{train,val}/<city>/<city>_<i>_000019_gtFine_labelTrainIds.png   their masks
    rgb_anon/<condition>/val/<seq>/<seq>_frame_<i>_rgb_anon.png            fog, night, ...
    gt/<condition>/val/<seq>/<seq>_frame_<i>_gt_labelTrainIds.png
    meta.json                        config, class names and every file's SHA-256

so `--data cityscapes:DIR` and `--data acdc:DIR` read it as they read the real datasets.
Scene i of split s is rendered from (seed, s, i) alone (the conditions from scenes of their
own, not the clean val scenes: ACDC's frames are not Cityscapes' either); the work is cut
into units of `CHUNK` scenes (one city or sequence folder each), each recorded in `.parts/`
with its files' SHA-256 when written, so a stopped run resumes at the first missing unit and
a finished folder is skipped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import cv2
import numpy as np

from tta_core.data.benchmark import sha256, write_strict
from tta_core.data.scene_conditions import CONDITIONS, render_condition
from tta_core.data.scenes import CITYSCAPES_CLASSES, HEIGHT, SCENE_CLASSES, WIDTH, render_scene

SCHEMA = "tta.scenes/1"
META = "meta.json"
PARTS = ".parts"
CHUNK = 250
_SPLITS = {"train": 1, "val": 2}  # rng stream of each clean split; condition c: 10 + c


@dataclass(frozen=True)
class SceneSetConfig:
    """Sizes, seed and the severity (1-5) of each condition."""

    train: int = 5000
    val: int = 500
    per_condition: int = 500
    seed: int = 0
    severity: dict = field(default_factory=lambda: {"fog": 4, "night": 4, "rain": 4,
                                                    "snow": 3})

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for name in ("train", "val", "per_condition"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if set(self.severity) != set(CONDITIONS) or not all(
                isinstance(v, int) and 1 <= v <= 5 for v in self.severity.values()):
            raise ValueError(f"severity must give each of {', '.join(CONDITIONS)} a level "
                             f"1-5, got {self.severity}")


@dataclass(frozen=True)
class _Unit:
    kind: str  # 'train', 'val' or a condition
    index: int  # chunk number: city or sequence folder
    lo: int
    hi: int

    @property
    def name(self) -> str:
        return f"{self.kind}.{self.index:03d}"


def _paths(unit: _Unit, i: int) -> tuple[str, str]:
    """(image, mask) paths of scene i, relative to the root."""
    if unit.kind in _SPLITS:
        city = f"synth{unit.index:02d}"
        stem = f"{city}_{i:06d}_000019"
        return (f"leftImg8bit/{unit.kind}/{city}/{stem}_leftImg8bit.png",
                f"gtFine/{unit.kind}/{city}/{stem}_gtFine_labelTrainIds.png")
    seq = f"SYN{CONDITIONS.index(unit.kind)}{unit.index:03d}"
    stem = f"{seq}_frame_{i:06d}"
    return (f"rgb_anon/{unit.kind}/val/{seq}/{stem}_rgb_anon.png",
            f"gt/{unit.kind}/val/{seq}/{stem}_gt_labelTrainIds.png")


def _write_png(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ok, buf = cv2.imencode(".png", arr[..., ::-1] if arr.ndim == 3 else arr)
    if not ok:
        raise OSError(f"cannot encode {path}")
    path.write_bytes(buf.tobytes())


def _work(root: str, unit: _Unit, cfg: SceneSetConfig) -> tuple[_Unit, dict[str, str]]:
    """Render and write one unit; record its files' digests in .parts/ (a worker)."""
    stream = _SPLITS.get(unit.kind, 10 + CONDITIONS.index(unit.kind)
                         if unit.kind in CONDITIONS else -1)
    digests: dict[str, str] = {}
    for i in range(unit.lo, unit.hi):
        scene = render_scene((cfg.seed, stream, i))
        image = scene.image
        if unit.kind in CONDITIONS:
            image = render_condition(scene, unit.kind, cfg.severity[unit.kind],
                                     int(np.random.SeedSequence([cfg.seed, stream, i])
                                         .generate_state(1)[0]))
        for rel, arr in zip(_paths(unit, i), (image, scene.label), strict=True):
            _write_png(Path(root) / rel, arr)
            digests[rel] = sha256(Path(root) / rel)
    write_strict(Path(root) / PARTS / f"{unit.name}.json", digests, indent=None)
    return unit, digests


def _units(cfg: SceneSetConfig) -> list[_Unit]:
    sizes = {"train": cfg.train, "val": cfg.val} | {c: cfg.per_condition for c in CONDITIONS}
    return [_Unit(kind, k, lo, min(lo + CHUNK, n)) for kind, n in sizes.items()
            for k, lo in enumerate(range(0, n, CHUNK))]


def read_meta(root: str | Path) -> dict | None:
    """meta.json of a scene folder, None when absent; ValueError when it is not JSON."""
    path = Path(root) / META
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not JSON ({exc}); delete it to regenerate") from None


@dataclass
class SceneSetReport:
    """What `generate` did: units made and kept, seconds."""

    root: str
    made: int = 0
    kept: int = 0
    seconds: float = 0.0
    complete_before: bool = False


def generate(root: str | Path, cfg: SceneSetConfig = SceneSetConfig(), workers: int = 1,
             progress: bool = True) -> SceneSetReport:
    """Write (or finish) the scene benchmark in `root`; a finished folder with the same
    configuration is kept as it is, one made with another is refused (ValueError)."""
    cfg.validate()
    root = Path(root)
    want = {"schema": SCHEMA, "config": asdict(cfg), "height": HEIGHT, "width": WIDTH}
    old = read_meta(root)
    if old is not None and any(old.get(k) != v for k, v in want.items()):
        raise ValueError(f"{str(root)!r} holds scenes made with another configuration "
                         f"({old.get('config')}); use another folder or delete it")
    report = SceneSetReport(str(root))
    if old is not None and old.get("files"):
        report.complete_before = True
        return report
    (root / PARTS).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    units = _units(cfg)
    files: dict[str, str] = {}
    todo = []
    for u in units:
        done = root / PARTS / f"{u.name}.json"
        if done.is_file():
            files.update(json.loads(done.read_text()))
            report.kept += 1
        else:
            todo.append(u)
    from tqdm import tqdm

    with tqdm(total=sum(u.hi - u.lo for u in todo), desc="scenes", unit="scene",
              disable=not progress) as bar:
        for unit, digests in _map(str(root), todo, cfg, workers):
            files.update(digests)
            report.made += 1
            bar.update(unit.hi - unit.lo)
    meta = {**want, "class_names": list(CITYSCAPES_CLASSES),
            "scene_classes": list(SCENE_CLASSES), "files": dict(sorted(files.items()))}
    write_strict(root / META, meta, indent=0)
    shutil.rmtree(root / PARTS, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    return report


def _map(root: str, todo: list[_Unit], cfg: SceneSetConfig,
         workers: int) -> Iterator[tuple[_Unit, dict[str, str]]]:
    if workers <= 1:
        for u in todo:
            yield _work(root, u, cfg)
        return
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(_work, [root] * len(todo), todo, [cfg] * len(todo))


def fingerprint(root: str | Path) -> str:
    """One SHA-256 over meta.json's sorted (file, SHA-256) pairs: the folder's identity."""
    meta = read_meta(root) or {}
    pairs = "".join(f"{k}:{v}\n" for k, v in sorted(meta.get("files", {}).items()))
    return hashlib.sha256(pairs.encode()).hexdigest()


def verify(root: str | Path) -> list[str]:
    """The files whose bytes differ from meta.json's SHA-256 (missing ones included)."""
    root = Path(root)
    meta = read_meta(root)
    if meta is None or not meta.get("files"):
        raise ValueError(f"{str(root)!r} has no finished scene set ({META} lists no files)")
    return [rel for rel, digest in meta["files"].items()
            if not (root / rel).is_file() or sha256(root / rel) != digest]


# fingerprints of scene sets made with the pinned requirements, by 'train/val/per/seed'
PUBLISHED: dict[str, str] = {
    "5000/500/500/0": "3104a0bd63c5982bb7a14fd4873b1eb9d436d1e6a1ff382aad75a4e798418911",
}
