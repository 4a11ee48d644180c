"""Shift streams: synthetic traffic signs under ImageNet-C corruptions, in the orders used
by the TTA literature, deterministic by seed.

Orders
- continual: each corruption in turn at one severity (AdaShadow / CoTTA / ImageNet-C order);
- gradual:   per corruption, severity 1 -> 5 -> 1 (CoTTA's gradual setting);
- mixed:     the continual samples shuffled, so the domain changes every sample;
- dirichlet: continual domains, labels temporally correlated by a Dirichlet split of each
             class over time slots (RoTTA / NOTE's non-i.i.d. protocol);
- recurring: the continual sequence repeated `recurrences` times with fresh images;
- iid:       continual domains, each domain's samples in a seeded random order (DARDA's
             i.i.d. protocol; for the synthetic stream, whose samples are drawn per seed
             anyway, the same as continual; for a user's data, where continual keeps the
             file order, it makes the seed choose the order).

Tracks (`track_length` k > 1, for the streaming benchmark): each object is seen over k
consecutive frames, like a sign a vehicle approaches: a domain's samples are ceil(n / k)
objects (labels drawn per object by the order's rule, the classes rotated from domain
to domain so that all classes appear even when a domain has few objects), each rendered
once and then shown k times, zooming in by up to TRACK_ZOOM over the track with a random
shift of at most TRACK_SHIFT_PX per frame (an image-level affine re-crop of the rendered
frame, not a re-render with new geometry); every frame gets
its own corruption noise seed. The last track of a domain is cut at the domain's end, so
the domain sizes and order are those of k = 1; k = 1 gives the i.i.d. stream unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from PIL import Image

from tta_core.data.corruptions import CORRUPTIONS, check, corrupt_image
from tta_core.data.signs import CLASS_NAMES, balanced_labels, render_sign

ORDERS: tuple[str, ...] = ("continual", "gradual", "mixed", "dirichlet", "recurring", "iid")
CLEAN = "clean"
GRADUAL_LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5, 4, 3, 2, 1)
TRACK_ZOOM = 0.25  # a track's last frame shows its object 1.25x larger than its first
TRACK_SHIFT_PX = 1.0  # per-frame random shift of a track's view, at most this many pixels


def domain_name(corruption: str | None, severity: int) -> str:
    """'fog/5', or 'clean' for uncorrupted samples."""
    return CLEAN if corruption is None else f"{corruption}/{severity}"


@dataclass
class StreamBatch:
    """One batch: uint8 NHWC images, labels and each sample's domain."""

    images: np.ndarray
    labels: np.ndarray
    domains: np.ndarray  # str per sample, e.g. "fog/5"
    index: int  # batch index in the stream

    @property
    def domain(self) -> str:
        """The batch's domain (its first sample's; batches of `mixed` hold several)."""
        return str(self.domains[0])


@dataclass
class Stream:
    """A whole stream held in memory (small images: 15 x 500 x 32 px ~ 23 MB)."""

    images: np.ndarray  # (N, H, W, 3) uint8
    labels: np.ndarray  # (N,) int64
    domains: np.ndarray  # (N,) str
    class_names: tuple[str, ...]
    order: str
    seed: int

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batches(self, batch_size: int) -> Iterator[StreamBatch]:
        """Consecutive batches in stream order (the last one may be smaller)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for b, i in enumerate(range(0, len(self), batch_size)):
            sl = slice(i, i + batch_size)
            yield StreamBatch(self.images[sl], self.labels[sl], self.domains[sl], b)

    def domain_order(self) -> list[str]:
        """Domains in order of first appearance."""
        return list(dict.fromkeys(self.domains.tolist()))


@dataclass(frozen=True)
class StreamSpec:
    """What to generate; `samples_per_domain` counts images per (corruption, severity)."""

    order: str = "continual"
    image_size: int = 32
    samples_per_domain: int = 100
    severity: int = 5
    corruptions: tuple[str, ...] = CORRUPTIONS
    seed: int = 0
    num_classes: int = len(CLASS_NAMES)
    recurrences: int = 2
    dirichlet_alpha: float = 0.1
    dirichlet_slots: int = 10
    track_length: int = 1  # frames per object (module doc "Tracks"); 1: i.i.d. frames

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        if self.order not in ORDERS:
            raise ValueError(f"unknown order {self.order!r}; choose from {', '.join(ORDERS)}")
        for c in self.corruptions:
            check(c, self.severity)
        if not self.corruptions:
            raise ValueError("corruptions is empty")
        if self.samples_per_domain < 1:
            raise ValueError(f"samples_per_domain must be >= 1, got {self.samples_per_domain}")
        if not 2 <= self.num_classes <= len(CLASS_NAMES):
            raise ValueError(f"num_classes must be in 2..{len(CLASS_NAMES)}, got "
                             f"{self.num_classes}")
        if not isinstance(self.track_length, int) or self.track_length < 1:
            raise ValueError(f"track_length must be an integer >= 1, got {self.track_length!r}")
        if self.track_length > 1 and self.order == "mixed":
            raise ValueError("track_length > 1 needs an ordered stream, not 'mixed'")
        if self.recurrences < 1 or self.dirichlet_alpha <= 0 or self.dirichlet_slots < 1:
            raise ValueError(f"bad recurrences/dirichlet settings: {self.recurrences}, "
                             f"{self.dirichlet_alpha}, {self.dirichlet_slots}")


def _segments(spec: StreamSpec) -> list[tuple[str | None, int, int]]:
    """(corruption, severity, n samples) in stream order."""
    n, sev = spec.samples_per_domain, spec.severity
    if spec.order == "gradual":
        per = max(1, -(-n // len(GRADUAL_LEVELS)))
        return [(c, s, per) for c in spec.corruptions for s in GRADUAL_LEVELS]
    seq = [(c, sev, n) for c in spec.corruptions]
    return seq * spec.recurrences if spec.order == "recurring" else seq


def dirichlet_labels(n: int, num_classes: int, alpha: float, slots: int,
                     rng: np.random.Generator) -> np.ndarray:
    """`n` balanced labels ordered so classes cluster in time: each class's samples are
    spread over `slots` consecutive slots with Dirichlet(alpha) proportions."""
    labels = np.arange(n, dtype=np.int64) % num_classes
    return labels[dirichlet_order(labels, num_classes, alpha, slots, rng)]


def dirichlet_order(labels: np.ndarray, num_classes: int, alpha: float, slots: int,
                    rng: np.random.Generator) -> np.ndarray:
    """The permutation of `labels` (class indices < num_classes) that makes classes
    cluster in time: each class's samples spread over `slots` consecutive slots with
    Dirichlet(alpha) proportions (RoTTA / NOTE), ties broken at random."""
    n = len(labels)
    slot_of = np.empty(n, dtype=np.int64)
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        props = rng.dirichlet(np.full(slots, alpha))
        slot_of[idx] = np.minimum(
            np.searchsorted(np.cumsum(props), (np.arange(len(idx)) + 0.5) / len(idx)),
            slots - 1)
    return np.lexsort((rng.random(n), slot_of))


def _plan_samples(spec: StreamSpec) -> tuple[np.ndarray, list[str | None], np.ndarray]:
    """Labels, corruption and severity of every sample, in stream order."""
    labels, corr, sevs = [], [], []
    t = spec.track_length
    for k, (c, s, n) in enumerate(_segments(spec)):
        m = -(-n // t)  # objects in the segment
        if spec.order == "dirichlet":
            rng = np.random.default_rng([spec.seed, k, 0xD1])
            lab = dirichlet_labels(m, spec.num_classes, spec.dirichlet_alpha,
                                   spec.dirichlet_slots, rng)
        else:
            lab = balanced_labels(m, spec.num_classes, spec.seed * 1000 + k)
        if t > 1:  # few objects per domain: rotate the classes so all of them appear
            lab = (lab + sum(-(-sn // t) for _, _, sn in _segments(spec)[:k])) % spec.num_classes
        labels.append(np.repeat(lab, t)[:n])
        corr += [c] * n
        sevs.append(np.full(n, s))
    lab_all, sev_all = np.concatenate(labels), np.concatenate(sevs)
    return lab_all, corr, sev_all


def track_starts(spec: StreamSpec) -> np.ndarray:
    """Per frame, the index of its track's first frame (tracks restart at every domain)."""
    out = []
    for _, _, n in _segments(spec):
        base = len(out)
        out += [base + (j // spec.track_length) * spec.track_length for j in range(n)]
    return np.asarray(out, dtype=np.int64)


def track_view(img: np.ndarray, j: int, k: int, seed: int, i: int) -> np.ndarray:
    """Frame j of a k-frame track of rendered `img`: zoomed in by 1 + TRACK_ZOOM * j / (k - 1)
    about the centre, shifted by up to TRACK_SHIFT_PX (seeded by frame index i)."""
    n = img.shape[0]
    zoom = 1.0 + TRACK_ZOOM * j / max(k - 1, 1)
    dx, dy = np.random.default_rng([seed, 0x7C, i]).uniform(-TRACK_SHIFT_PX, TRACK_SHIFT_PX, 2)
    c = (n - 1) / 2
    # output (x, y) samples input (x / zoom + c(1 - 1/zoom) + dx, ...): PIL AFFINE coefficients
    coeffs = (1 / zoom, 0.0, c * (1 - 1 / zoom) + dx, 0.0, 1 / zoom, c * (1 - 1 / zoom) + dy)
    out = Image.fromarray(img).transform((n, n), Image.Transform.AFFINE, coeffs,
                                         Image.Resampling.BILINEAR)
    return np.asarray(out, dtype=np.uint8)


def build_stream(spec: StreamSpec, progress: bool = False) -> Stream:
    """Render and corrupt every sample of `spec`; image i uses seeds derived from (seed, i)."""
    spec.validate()
    labels, corr, sevs = _plan_samples(spec)
    n, size = len(labels), spec.image_size
    seeds = np.random.SeedSequence([spec.seed, 0xC0]).generate_state(n)
    images = np.empty((n, size, size, 3), np.uint8)
    it = range(n)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"{spec.order} stream", unit="img", leave=False)
    starts = track_starts(spec)
    base = np.empty((size, size, 3), np.uint8)
    for i in it:
        if starts[i] == i:
            base = render_sign(int(labels[i]), np.random.default_rng([spec.seed, 0x5E, i]),
                               size)
        img = base if starts[i] == i else track_view(base, i - int(starts[i]),
                                                     spec.track_length, spec.seed, i)
        c = corr[i]
        images[i] = img if c is None else corrupt_image(img, c, int(sevs[i]), int(seeds[i]))
    domains = np.array([domain_name(c, int(s)) for c, s in zip(corr, sevs, strict=True)])
    if spec.order == "mixed":
        perm = np.random.default_rng([spec.seed, 0x313]).permutation(n)
        images, labels, domains = images[perm], labels[perm], domains[perm]
    return Stream(images, labels, domains, CLASS_NAMES[: spec.num_classes], spec.order,
                  spec.seed)


def _blocks(domains: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of equal domains, in stream order."""
    cuts = [0, *(np.flatnonzero(domains[1:] != domains[:-1]) + 1).tolist(), len(domains)]
    return list(pairwise(cuts))


def arrange(stream: Stream, order: str, seed: int = 0, recurrences: int = 2,
            dirichlet_alpha: float = 0.1, dirichlet_slots: int = 10) -> Stream:
    """A continual stream (domains in consecutive blocks: a user's data) in `order`, by
    the same rules as the synthetic orders (module doc): continual as is; mixed: the
    samples shuffled (seed, as the synthetic one); dirichlet: each domain's samples
    reordered so classes cluster in time (seed, domain index); iid: each domain's samples
    shuffled (seed, domain index); recurring: the sequence
    `recurrences` times, the same images again (a user's data has no fresh renders).
    "gradual" needs each corruption at every severity: tta_core.data.sources reads it."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose from {', '.join(ORDERS)}")
    if order == "gradual":
        raise ValueError("order 'gradual' is read per severity (tta_core.data.sources), not "
                         "arranged from one severity's stream")
    idx = np.arange(len(stream))
    if order == "mixed":
        idx = np.random.default_rng([seed, 0x313]).permutation(len(stream))
    elif order == "dirichlet":
        c = len(stream.class_names)
        idx = np.concatenate([a + dirichlet_order(stream.labels[a:b], c, dirichlet_alpha,
                                                  dirichlet_slots,
                                                  np.random.default_rng([seed, k, 0xD1]))
                              for k, (a, b) in enumerate(_blocks(stream.domains))])
    elif order == "recurring":
        idx = np.tile(idx, recurrences)
    elif order == "iid":
        idx = np.concatenate([a + np.random.default_rng([seed, k, 0x11D]).permutation(b - a)
                              for k, (a, b) in enumerate(_blocks(stream.domains))])
    return Stream(stream.images[idx], stream.labels[idx], stream.domains[idx],
                  stream.class_names, order, seed)
