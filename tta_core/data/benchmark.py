"""The CIFAR-scale shift benchmark (signs32-C): made here, no download, CIFAR-10-C layout.

`generate` writes into one folder

    train.npy, train_labels.npy    N_train clean training images (N, 32, 32, 3) uint8
    test.npy, test_labels.npy      N_test clean test images
    <corruption>.npy               the first n test images under one corruption at
                                   severities 1..5, in blocks of n: (5 n, 32, 32, 3) uint8
    labels.npy                     their 5 n labels (the test labels tiled five times)
    meta.json                      class names, sizes, seed, style and every file's SHA-256

for the 15 standard corruptions and the 4 held-out ones (`corruptions.ALL_CORRUPTIONS`), so
`tta bench --data cifar10c:DIR` reads it exactly as it reads CIFAR-10-C (the class names
come from meta.json; a real CIFAR-10-C folder has none and gets CIFAR-10's), and `tta
train-source --data cifar10c:DIR` trains on its training split.

Images are the synthetic signs in `signs.BENCHMARK_STYLE`: image i of split s is drawn with
rng([seed, s, i]) only, and test image i under corruption c at severity v with the i-th seed
of SeedSequence([seed, c, v]); so the bytes depend on (seed, sizes) and not on how the work
is split over processes. The work is cut into chunks of `CHUNK` images, each written to
`.parts/` as it finishes: a stopped run resumes at the first missing chunk. Files are moved
into place only when complete (a crash never leaves a short array under a final name).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tta_core.data.corruptions import ALL_CORRUPTIONS, SEVERITIES, corrupt_image
from tta_core.data.loaders import META, read_meta
from tta_core.data.signs import BENCHMARK_STYLE, CLASS_NAMES, balanced_labels, render_sign

SCHEMA = "tta.benchmark/1"
IMAGE_SIZE = 32
CHUNK = 500  # images per unit of work (and of resumption)
_SPLITS = {"train": 1, "test": 2}  # rng stream of each clean split
PARTS = ".parts"


@dataclass(frozen=True)
class BenchmarkConfig:
    """Sizes and seed of one benchmark folder."""

    train: int = 50_000
    test: int = 10_000
    per_corruption: int = 2_000  # test images per corruption and severity (CIFAR-10-C: 10k)
    seed: int = 0
    corruptions: tuple[str, ...] = ALL_CORRUPTIONS

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for name in ("train", "test", "per_corruption"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.per_corruption > self.test:
            raise ValueError(f"per_corruption {self.per_corruption} exceeds the "
                             f"{self.test} clean test images it corrupts")
        bad = [c for c in self.corruptions if c not in ALL_CORRUPTIONS]
        if bad or not self.corruptions:
            raise ValueError(f"corruptions {bad or '(none)'}: choose from "
                             f"{', '.join(ALL_CORRUPTIONS)}")


@dataclass
class BenchmarkReport:
    """What `generate` did: seconds per file kind, files made and skipped (resumed)."""

    root: str
    seconds: float = 0.0
    seconds_by_file: dict[str, float] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Chunk:
    file: str  # final file stem (train, test, or a corruption name)
    lo: int
    hi: int

    @property
    def part(self) -> str:
        return f"{self.file}.{self.lo:07d}-{self.hi:07d}.npy"


def labels_of(split: str, n: int, seed: int) -> np.ndarray:
    """The balanced labels of a clean split (train or test) of `n` images."""
    return balanced_labels(n, len(CLASS_NAMES), seed * 8 + _SPLITS[split])


def _render(split: str, labels: np.ndarray, lo: int, hi: int, seed: int) -> np.ndarray:
    out = np.empty((hi - lo, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    for k, i in enumerate(range(lo, hi)):
        rng = np.random.default_rng([seed, _SPLITS[split], i])
        out[k] = render_sign(int(labels[i]), rng, IMAGE_SIZE, BENCHMARK_STYLE)
    return out


def corruption_seeds(name: str, n: int, seed: int) -> np.ndarray:
    """(5, n) per-image seeds of corruption `name` at severities 1..5."""
    ci = ALL_CORRUPTIONS.index(name)
    return np.stack([np.random.SeedSequence([seed, ci, v]).generate_state(n)
                     for v in SEVERITIES])


def _work(root: str, chunk: _Chunk, cfg: BenchmarkConfig) -> tuple[_Chunk, float]:
    """Make one chunk and write it under .parts/ (runs in a worker process)."""
    t0 = time.perf_counter()
    parts = Path(root) / PARTS
    if chunk.file in _SPLITS:
        n = getattr(cfg, chunk.file)
        arr = _render(chunk.file, labels_of(chunk.file, n, cfg.seed), chunk.lo, chunk.hi,
                      cfg.seed)
    else:  # rows lo..hi of the (5 n) corruption file: severity blocks of n
        n = cfg.per_corruption
        clean = np.load(Path(root) / "test.npy", mmap_mode="r")
        seeds = corruption_seeds(chunk.file, n, cfg.seed)
        arr = np.empty((chunk.hi - chunk.lo, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
        for k, row in enumerate(range(chunk.lo, chunk.hi)):
            sev, i = divmod(row, n)
            arr[k] = corrupt_image(np.asarray(clean[i]), chunk.file, SEVERITIES[sev],
                                   int(seeds[sev, i]))
    tmp = parts / (chunk.part + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, parts / chunk.part)
    return chunk, time.perf_counter() - t0


def _chunks(file: str, rows: int) -> list[_Chunk]:
    return [_Chunk(file, lo, min(lo + CHUNK, rows)) for lo in range(0, rows, CHUNK)]


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, path)


def _assemble(root: Path, file: str, chunks: Sequence[_Chunk]) -> None:
    """Concatenate a file's finished chunks into `<file>.npy` and drop them."""
    parts = [root / PARTS / c.part for c in chunks]
    _save(root / f"{file}.npy", np.concatenate([np.load(p) for p in parts]))
    for p in parts:
        p.unlink()


def write_strict(path: Path, obj: object, indent: int | None = 1) -> None:
    """`obj` as strict JSON (no NaN can hide in it) at `path`, atomically (a temporary
    file beside it, then a rename). tta_core.io.strict_json.write_json for the data
    package, which tta_core.io imports (image messages use the preprocessing)."""
    text = json.dumps(obj, indent=indent, allow_nan=False) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_meta(root: Path, meta: dict) -> None:
    """meta.json as strict JSON, atomically."""
    write_strict(root / META, meta)


def _config_record(cfg: BenchmarkConfig) -> dict:
    rec = asdict(cfg)
    rec["corruptions"] = list(cfg.corruptions)
    return rec


def generate(root: str | Path, cfg: BenchmarkConfig = BenchmarkConfig(), workers: int = 0,
             progress: bool = True) -> BenchmarkReport:
    """Write (or finish) the benchmark in `root`; returns what was made and how long it
    took per file. `workers` processes (0: one per CPU). A folder made with another
    configuration is refused (ValueError naming the differing fields)."""
    cfg.validate()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / PARTS).mkdir(exist_ok=True)
    want = json.loads(json.dumps({"schema": SCHEMA, "config": _config_record(cfg),
                                  "style": asdict(BENCHMARK_STYLE), "image_size": IMAGE_SIZE}))
    old = read_meta(root)
    if old is not None:
        diff = [k for k in ("schema", "config", "style", "image_size") if old.get(k) != want[k]]
        if diff:
            raise ValueError(f"{str(root)!r} holds a benchmark made with another "
                             f"{', '.join(diff)}; use another folder or delete it")
    meta = old or {**want, "class_names": list(CLASS_NAMES), "files": {}}
    _write_meta(root, meta)  # claims the folder
    report = BenchmarkReport(str(root))
    t0 = time.perf_counter()
    for split in _SPLITS:  # labels first: cheap, and every later step reads them
        n = getattr(cfg, split)
        if not (root / f"{split}_labels.npy").is_file():
            _save(root / f"{split}_labels.npy", labels_of(split, n, cfg.seed))
    test_labels = labels_of("test", cfg.test, cfg.seed)
    if not (root / "labels.npy").is_file():
        _save(root / "labels.npy", np.tile(test_labels[:cfg.per_corruption], 5))
    stages = [{s: _chunks(s, getattr(cfg, s)) for s in _SPLITS},
              {c: _chunks(c, 5 * cfg.per_corruption) for c in cfg.corruptions}]
    for stage in stages:  # the corruptions read test.npy: the clean splits go first
        _run_stage(root, stage, cfg, workers, progress, report)
    for f in sorted(root.glob("*.npy")):
        meta["files"][f.name] = sha256(f)
    _write_meta(root, meta)
    shutil.rmtree(root / PARTS, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    return report


def _run_stage(root: Path, stage: dict[str, list[_Chunk]], cfg: BenchmarkConfig,
               workers: int, progress: bool, report: BenchmarkReport) -> None:
    todo: list[_Chunk] = []
    for file, chunks in stage.items():
        if (root / f"{file}.npy").is_file():
            report.kept.append(f"{file}.npy")
            continue
        todo += [c for c in chunks if not (root / PARTS / c.part).is_file()]
    left = {f: {c.part for c in cs} - {p.name for p in (root / PARTS).glob(f"{f}.*.npy")}
            for f, cs in stage.items() if not (root / f"{f}.npy").is_file()}
    for file in [f for f, rest in left.items() if not rest]:  # all chunks from a past run
        _assemble(root, file, stage[file])
        report.made.append(f"{file}.npy")
        del left[file]
    if not todo:
        return
    bar = _bar(sum(c.hi - c.lo for c in todo), progress, ", ".join(stage)[:40])
    n_workers = workers or os.cpu_count() or 1
    for chunk, seconds in _map(str(root), todo, cfg, n_workers):
        report.seconds_by_file[chunk.file] = report.seconds_by_file.get(chunk.file, 0) + seconds
        bar.update(chunk.hi - chunk.lo)
        left[chunk.file].discard(chunk.part)
        if not left[chunk.file]:
            _assemble(root, chunk.file, stage[chunk.file])
            report.made.append(f"{chunk.file}.npy")
    bar.close()


def _map(root: str, todo: list[_Chunk], cfg: BenchmarkConfig,
         workers: int) -> Iterator[tuple[_Chunk, float]]:
    if workers <= 1:
        for c in todo:
            yield _work(root, c, cfg)
        return
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(_work, root, c, cfg) for c in todo]
        for fut in as_completed(futures):
            yield fut.result()


def _bar(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=not enabled, leave=False)


def verify(root: str | Path) -> list[str]:
    """The files of `root` whose bytes differ from the SHA-256 its meta.json records
    (missing files included); empty when the folder is intact."""
    root = Path(root)
    meta = read_meta(root)
    if meta is None or not meta.get("files"):
        raise ValueError(f"{str(root)!r} has no finished benchmark ({META} lists no files)")
    return [name for name, digest in sorted(meta["files"].items())
            if not (root / name).is_file() or sha256(root / name) != digest]


def fingerprint(root: str | Path) -> str:
    """One SHA-256 over the sorted (file, SHA-256) pairs of meta.json: the benchmark's
    identity, compared with the published one (`PUBLISHED`)."""
    meta = read_meta(Path(root)) or {}
    pairs = "".join(f"{k}:{v}\n" for k, v in sorted(meta.get("files", {}).items()))
    return hashlib.sha256(pairs.encode()).hexdigest()


def config_key(cfg: BenchmarkConfig) -> str:
    """'train/test/per_corruption/seed' of the default corruption set: PUBLISHED's key."""
    return f"{cfg.train}/{cfg.test}/{cfg.per_corruption}/{cfg.seed}"


# fingerprints of benchmarks made with the pinned requirements (requirements/constraints.txt)
PUBLISHED: dict[str, str] = {
    "50000/10000/2000/0": "4dce6b9aef3cae0660d638fe86c83b81e8b9e06eee0eaec624778af1f9f89428",
}
