"""Procedural traffic-sign dataset: the clean source domain of the benchmark.

Each class is a sign template (shape x border/fill colour x pictogram) drawn once per image
size with PIL and cached in memory; every image then places the template on a random
background (smooth noise, gradient or clutter) under a random scale, rotation, perspective
warp and lighting. Image `i` of a dataset with seed `s` depends only on (s, i), so the same
seed always gives identical bytes, whatever the batch split.

`SignStyle` holds the ranges every image draws from. `DEFAULT_STYLE` is the shipped small
benchmark's (the default cards, bags and tests were made with it, byte for byte);
`BENCHMARK_STYLE` is the CIFAR-scale benchmark's (`tta_core.data.benchmark`): smaller and
more tilted signs, textured scenes, cast shadows, occluders and a second sign cut by the
border, so that a ResNet trained on 50,000 images is not perfect on clean test images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

RED = (200, 30, 35)
BLUE = (25, 75, 175)
YELLOW = (245, 200, 20)
WHITE = (245, 245, 245)
BLACK = (20, 20, 20)
GREY = (120, 120, 120)


@dataclass(frozen=True)
class SignSpec:
    """One sign class: outline shape, border and fill colours, pictogram and its colour."""

    name: str
    shape: str  # circle | triangle_up | triangle_down | octagon | diamond | square
    border: tuple[int, int, int]
    fill: tuple[int, int, int]
    pictogram: str  # "" | "digits:NN" | "arrow:DEG" | hbar | vbars | cross | xcross | ...
    ink: tuple[int, int, int] = BLACK


SIGN_CLASSES: tuple[SignSpec, ...] = (
    SignSpec("speed_30", "circle", RED, WHITE, "digits:30"),
    SignSpec("speed_50", "circle", RED, WHITE, "digits:50"),
    SignSpec("speed_80", "circle", RED, WHITE, "digits:80"),
    SignSpec("no_entry", "circle", RED, RED, "hbar", WHITE),
    SignSpec("stop", "octagon", WHITE, RED, "hbar_thin", WHITE),
    SignSpec("yield", "triangle_down", RED, WHITE, ""),
    SignSpec("general_caution", "triangle_up", RED, WHITE, "exclamation"),
    SignSpec("crossroads", "triangle_up", RED, WHITE, "cross"),
    SignSpec("curve_left", "triangle_up", RED, WHITE, "arrow:180"),
    SignSpec("road_narrows", "triangle_up", RED, WHITE, "vbars"),
    SignSpec("priority_road", "diamond", WHITE, YELLOW, ""),
    SignSpec("end_priority", "diamond", WHITE, YELLOW, "diagonal"),
    SignSpec("ahead_only", "circle", BLUE, BLUE, "arrow:90", WHITE),
    SignSpec("turn_right", "circle", BLUE, BLUE, "arrow:0", WHITE),
    SignSpec("turn_left", "circle", BLUE, BLUE, "arrow:180", WHITE),
    SignSpec("keep_right", "circle", BLUE, BLUE, "arrow:-45", WHITE),
    SignSpec("roundabout", "circle", BLUE, BLUE, "ring", WHITE),
    SignSpec("parking", "square", WHITE, BLUE, "letter_p", WHITE),
    SignSpec("no_stopping", "circle", RED, BLUE, "xcross", RED),
    SignSpec("end_limits", "circle", GREY, WHITE, "diagonal"),
    SignSpec("no_overtaking", "circle", RED, WHITE, "two_bars"),
    SignSpec("detour", "square", BLACK, YELLOW, "arrow:0"),
)

CLASS_NAMES: tuple[str, ...] = tuple(s.name for s in SIGN_CLASSES)
IMAGE_SIZES: tuple[int, ...] = (32, 64)

# 7-segment layout: segment -> (x0, y0, x1, y1) in a 1 x 2 digit cell.
_SEGMENTS = {
    "a": (0.0, 0.0, 1.0, 0.2), "b": (0.8, 0.0, 1.0, 1.0), "c": (0.8, 1.0, 1.0, 2.0),
    "d": (0.0, 1.8, 1.0, 2.0), "e": (0.0, 1.0, 0.2, 2.0), "f": (0.0, 0.0, 0.2, 1.0),
    "g": (0.0, 0.9, 1.0, 1.1),
}
_DIGITS = {
    "0": "abcdef", "1": "bc", "2": "abged", "3": "abgcd", "4": "fgbc", "5": "afgcd",
    "6": "afgedc", "7": "abc", "8": "abcdefg", "9": "abcdfg",
}


@dataclass(frozen=True)
class SignStyle:
    """What varies between images of one class, as ranges drawn per image.

    scale: the sign's half-size as a fraction of the image side; rotation_deg: the largest
    in-plane tilt; shift: the largest centre offset (fraction of the side); perspective:
    the largest corner jitter (fraction of the half-size); fade: the largest blend of the
    paint towards its own grey; gain: the global light gain; backgrounds: kinds drawn
    uniformly (noise, gradient, clutter, texture); shadow / occlusion / distractor: the
    probability of a cast shadow, an occluding blob over the sign, a second sign cut by
    the image border; occlusion_size: the occluder's size as a fraction of the sign's.
    """

    scale: tuple[float, float] = (0.28, 0.46)
    rotation_deg: float = 15.0
    shift: float = 0.12
    perspective: float = 0.12
    fade: float = 0.3
    gain: tuple[float, float] = (0.55, 1.3)
    backgrounds: tuple[str, ...] = ("noise", "gradient", "clutter")
    shadow: float = 0.0
    occlusion: float = 0.0
    occlusion_size: tuple[float, float] = (0.25, 0.6)
    distractor: float = 0.0

    def __post_init__(self) -> None:
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {self.scale}")
        bad = [b for b in self.backgrounds if b not in BACKGROUNDS]
        if bad or not self.backgrounds:
            raise ValueError(f"backgrounds {self.backgrounds!r}: choose from {BACKGROUNDS}")
        for name in ("shadow", "occlusion", "distractor"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} is a probability, got {getattr(self, name)}")


BACKGROUNDS: tuple[str, ...] = ("noise", "gradient", "clutter", "texture")
DEFAULT_STYLE = SignStyle()
BENCHMARK_STYLE = SignStyle(scale=(0.17, 0.46), rotation_deg=30.0, shift=0.18,
                            perspective=0.22, fade=0.45, gain=(0.35, 1.45),
                            backgrounds=BACKGROUNDS, shadow=0.35, occlusion=0.4,
                            occlusion_size=(0.25, 0.7), distractor=0.3)


@dataclass
class SignDataset:
    """Images (N, H, W, 3) uint8, labels (N,) int64 and the class names they index."""

    images: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    image_size: int
    seed: int

    def __len__(self) -> int:
        return int(self.labels.shape[0])


# ----------------------------------------------------------------------------- templates


def _shape_points(shape: str, r: float) -> list[tuple[float, float]] | None:
    """Polygon of `shape` with circumradius-like size r around the origin (None: circle)."""
    if shape == "circle":
        return None
    if shape == "triangle_up":
        return [(0.0, -r), (r * 0.98, r * 0.72), (-r * 0.98, r * 0.72)]
    if shape == "triangle_down":
        return [(0.0, r), (r * 0.98, -r * 0.72), (-r * 0.98, -r * 0.72)]
    if shape == "octagon":
        return [(r * math.cos(a), r * math.sin(a))
                for a in (math.pi / 8 + k * math.pi / 4 for k in range(8))]
    if shape == "diamond":
        return [(0.0, -r), (r, 0.0), (0.0, r), (-r, 0.0)]
    if shape == "square":
        return [(-r * 0.9, -r * 0.9), (r * 0.9, -r * 0.9), (r * 0.9, r * 0.9), (-r * 0.9, r * 0.9)]
    raise ValueError(f"unknown sign shape {shape!r}")


class _Pen:
    """Draws in unit coordinates ([-1, 1]^2 maps onto the canvas) with a y offset."""

    def __init__(self, draw: ImageDraw.ImageDraw, size: int, dy: float = 0.0) -> None:
        self.draw, self.half, self.dy = draw, size / 2.0, dy

    def pt(self, x: float, y: float) -> tuple[float, float]:
        return (self.half * (1 + x), self.half * (1 + y + self.dy))

    def poly(self, pts: list[tuple[float, float]], color: tuple[int, ...]) -> None:
        self.draw.polygon([self.pt(x, y) for x, y in pts], fill=color)

    def rect(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, ...]) -> None:
        self.poly([(x0, y0), (x1, y0), (x1, y1), (x0, y1)], color)

    def disk(self, r: float, color: tuple[int, ...], cx: float = 0.0, cy: float = 0.0) -> None:
        (x0, y0), (x1, y1) = self.pt(cx - r, cy - r), self.pt(cx + r, cy + r)
        self.draw.ellipse([x0, y0, x1, y1], fill=color)


def _arrow_points(deg: float) -> list[tuple[float, float]]:
    """Arrow (shaft + head) pointing at angle `deg` (0 = right, 90 = up)."""
    base = [(-0.5, -0.09), (0.1, -0.09), (0.1, -0.28), (0.5, 0.0),
            (0.1, 0.28), (0.1, 0.09), (-0.5, 0.09)]
    a = math.radians(deg)
    c, s = math.cos(a), math.sin(a)
    return [(x * c + y * s, -x * s + y * c) for x, y in base]


def _draw_digits(pen: _Pen, text: str, color: tuple[int, ...]) -> None:
    w, h, gap = 0.26, 0.26, 0.1  # cell width, half-height unit, gap between digits
    total = len(text) * w + (len(text) - 1) * gap
    for k, ch in enumerate(text):
        x = -total / 2 + k * (w + gap)
        for seg in _DIGITS[ch]:
            x0, y0, x1, y1 = _SEGMENTS[seg]
            pen.rect(x + x0 * w, -h + y0 * h, x + x1 * w, -h + y1 * h, color)


def _draw_pictogram(pen: _Pen, spec: SignSpec, inner_fill: tuple[int, ...]) -> None:
    kind, _, arg = spec.pictogram.partition(":")
    ink = spec.ink
    if kind == "":
        return
    if kind == "digits":
        _draw_digits(pen, arg, ink)
    elif kind == "arrow":
        pen.poly(_arrow_points(float(arg)), ink)
    elif kind == "hbar":
        pen.rect(-0.6, -0.14, 0.6, 0.14, ink)
    elif kind == "hbar_thin":
        pen.rect(-0.55, -0.07, 0.55, 0.07, ink)
        pen.rect(-0.55, -0.33, 0.55, -0.25, ink)
        pen.rect(-0.55, 0.25, 0.55, 0.33, ink)
    elif kind == "vbars":
        pen.rect(-0.2, -0.35, -0.09, 0.3, ink)
        pen.rect(0.09, -0.35, 0.2, 0.3, ink)
    elif kind == "exclamation":
        pen.rect(-0.07, -0.4, 0.07, 0.12, ink)
        pen.disk(0.08, ink, 0.0, 0.28)
    elif kind == "cross":
        pen.rect(-0.07, -0.42, 0.07, 0.35, ink)
        pen.rect(-0.35, -0.1, 0.35, 0.04, ink)
    elif kind in ("xcross", "diagonal"):
        angles = (45, -45) if kind == "xcross" else (-45,)
        for deg in angles:
            a = math.radians(deg)
            c, s = math.cos(a), math.sin(a)
            bar = [(-0.8, -0.08), (0.8, -0.08), (0.8, 0.08), (-0.8, 0.08)]
            pen.poly([(x * c - y * s, x * s + y * c) for x, y in bar], ink)
    elif kind == "ring":
        pen.disk(0.5, ink)
        pen.disk(0.3, inner_fill)
        pen.poly([(0.28, -0.55), (0.62, -0.3), (0.22, -0.2)], ink)
    elif kind == "letter_p":
        pen.rect(-0.3, -0.5, -0.12, 0.5, ink)
        pen.disk(0.27, ink, 0.0, -0.2)
        pen.disk(0.11, inner_fill, 0.0, -0.2)
        pen.rect(-0.12, -0.38, 0.0, -0.02, inner_fill)
    elif kind == "two_bars":
        pen.rect(-0.35, -0.3, -0.05, 0.3, BLACK)
        pen.rect(0.05, -0.3, 0.35, 0.3, RED)
    else:
        raise ValueError(f"unknown pictogram {spec.pictogram!r} of class {spec.name!r}")


def _draw_shape(pen: _Pen, shape: str, r: float, color: tuple[int, ...]) -> None:
    pts = _shape_points(shape, r)
    if pts is None:
        pen.disk(r, color)
    else:
        pen.poly(pts, color)


def draw_template(spec: SignSpec, size: int, supersample: int = 4) -> np.ndarray:
    """The sign of `spec` as an RGBA uint8 (size, size, 4) array, sign filling the canvas.

    Transparent pixels carry the border colour so bilinear warps show no dark fringe.
    """
    big = size * supersample
    rgb = Image.new("RGB", (big, big), spec.border)
    mask = Image.new("L", (big, big), 0)
    dy = 0.12 if spec.shape == "triangle_up" else (-0.12 if spec.shape == "triangle_down" else 0)
    pen, mpen = _Pen(ImageDraw.Draw(rgb), big, dy), _Pen(ImageDraw.Draw(mask), big, dy)
    _draw_shape(mpen, spec.shape, 0.98, (255,))
    _draw_shape(pen, spec.shape, 0.98, spec.border)
    inner = 0.72 if spec.shape.startswith("triangle") else 0.8
    _draw_shape(pen, spec.shape, 0.98 * inner, spec.fill)
    _draw_pictogram(pen, spec, spec.fill)
    rgba = rgb.convert("RGBA")
    rgba.putalpha(mask)
    return np.asarray(rgba.resize((size, size), Image.Resampling.BOX))


@lru_cache(maxsize=8)
def _templates(size: int) -> tuple[Image.Image, ...]:
    return tuple(Image.fromarray(draw_template(s, size)) for s in SIGN_CLASSES)


# ----------------------------------------------------------------------------- per image


def _homography(src: np.ndarray, dst: np.ndarray) -> tuple[float, ...]:
    """PIL PERSPECTIVE coefficients mapping output points `dst` to input points `src`."""
    a = np.zeros((8, 8))
    b = np.zeros(8)
    for k, ((x, y), (u, v)) in enumerate(zip(dst, src, strict=True)):
        a[2 * k] = [x, y, 1, 0, 0, 0, -u * x, -u * y]
        a[2 * k + 1] = [0, 0, 0, x, y, 1, -v * x, -v * y]
        b[2 * k], b[2 * k + 1] = u, v
    return tuple(np.linalg.solve(a, b))


def _texture(rng: np.random.Generator, n: int) -> np.ndarray:
    """Float (n, n, 3) fine texture: oriented stripes over per-pixel grain, two colours
    (foliage, brick, asphalt at a distance)."""
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    a = rng.uniform(0, math.pi)
    freq = rng.uniform(0.15, 0.9)
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32)
    wave = 0.5 + 0.5 * np.sin(freq * (math.cos(a) * xx + math.sin(a) * yy) + rng.uniform(0, 6.3))
    grain = rng.uniform(0, 1, (n, n)).astype(np.float32)
    mix = np.clip(0.6 * wave + 0.4 * grain, 0, 1)[..., None]
    return (c0 * (1 - mix) + c1 * mix).astype(np.float32)


def _background(rng: np.random.Generator, n: int,
                kinds: tuple[str, ...] = DEFAULT_STYLE.backgrounds) -> np.ndarray:
    """Float (n, n, 3) background in [0, 255] of a kind drawn from `kinds`."""
    kind = BACKGROUNDS.index(kinds[int(rng.integers(len(kinds)))])
    if kind == 3:
        return _texture(rng, n)
    if kind == 0:  # smooth colour noise: a coarse grid upsampled bilinearly
        g = int(rng.integers(2, 6))
        coarse = rng.integers(0, 256, (g, g, 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((n, n), Image.Resampling.BILINEAR)
        return np.asarray(img, dtype=np.float32)
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    if kind == 1:  # linear gradient between two colours in a random direction
        a = rng.uniform(0, 2 * math.pi)
        t = np.linspace(-0.5, 0.5, n, dtype=np.float32)
        ramp = math.cos(a) * t[None, :] + math.sin(a) * t[:, None] + 0.5
        return (c0 * (1 - ramp[..., None]) + c1 * ramp[..., None]).astype(np.float32)
    img = np.empty((n, n, 3), np.float32)  # clutter: flat colour + random boxes
    img[:] = c0
    for _ in range(int(rng.integers(2, 7))):
        x0, y0 = rng.integers(0, n, 2)
        w, h = rng.integers(n // 8, n // 2 + 1, 2)
        img[y0:y0 + h, x0:x0 + w] = rng.uniform(0, 255, 3)
    return img


def _sign_quad(rng: np.random.Generator, n: int,
               style: SignStyle = DEFAULT_STYLE) -> np.ndarray:
    """Output-image corners of the warped sign: scale, rotation, shift and perspective."""
    half = rng.uniform(*style.scale) * n
    ang = math.radians(rng.uniform(-style.rotation_deg, style.rotation_deg))
    c, s = math.cos(ang), math.sin(ang)
    centre = n / 2 + rng.uniform(-style.shift, style.shift, 2) * n
    square = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=np.float64) * half
    rot = square @ np.array([[c, s], [-s, c]])
    jitter = rng.uniform(-style.perspective, style.perspective, (4, 2)) * half
    return rot + jitter + centre


def _lighting(img: np.ndarray, rng: np.random.Generator,
              gain_range: tuple[float, float] = DEFAULT_STYLE.gain) -> np.ndarray:
    """Global gain, colour cast, a linear shading ramp and gamma (no blur or noise)."""
    n = img.shape[0]
    gain = rng.uniform(*gain_range) * rng.uniform(0.9, 1.1, 3)
    a = rng.uniform(0, 2 * math.pi)
    t = np.linspace(-0.5, 0.5, n, dtype=np.float32)
    ramp = 1.0 + rng.uniform(0, 0.5) * (math.cos(a) * t[None, :] + math.sin(a) * t[:, None])
    out = img * (gain.astype(np.float32) * ramp[..., None])
    gamma = rng.uniform(0.8, 1.25)
    return 255.0 * np.power(np.clip(out, 0, 255) / 255.0, gamma)


def _warp(label: int, quad: np.ndarray, n: int) -> np.ndarray:
    """The template of class `label` warped onto `quad`: float RGBA (n, n, 4)."""
    tmpl = _templates(2 * n)[label]
    t = float(2 * n)
    src = np.array([[0, 0], [t, 0], [t, t], [0, t]], dtype=np.float64)
    coeffs = _homography(src, quad)
    return np.asarray(tmpl.transform((n, n), Image.Transform.PERSPECTIVE, coeffs,
                                     Image.Resampling.BILINEAR), dtype=np.float32)


def _paint(img: np.ndarray, warped: np.ndarray, fade: float) -> np.ndarray:
    """`warped`'s sign over `img`, its paint blended towards its own grey by `fade`."""
    alpha = warped[..., 3:] / 255.0
    sign = warped[..., :3] * (1 - fade) + warped[..., :3].mean(-1, keepdims=True) * fade
    return img * (1 - alpha) + sign * alpha


def _distractor(img: np.ndarray, label: int, rng: np.random.Generator) -> np.ndarray:
    """A second sign of another class, mostly outside the image, behind the main one."""
    n = img.shape[0]
    other = int((label + rng.integers(1, len(SIGN_CLASSES))) % len(SIGN_CLASSES))
    half = rng.uniform(0.25, 0.4) * n
    side = rng.integers(4)
    along = rng.uniform(0.1, 0.9) * n
    out = rng.uniform(0.55, 0.9) * half  # centre this far beyond the border
    cx, cy = [(-out, along), (n + out, along), (along, -out), (along, n + out)][side]
    square = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=np.float64) * half
    return _paint(img, _warp(other, square + np.array([cx, cy]), n), rng.uniform(0.0, 0.4))


def _occlude(img: np.ndarray, quad: np.ndarray, style: SignStyle,
             rng: np.random.Generator) -> np.ndarray:
    """An ellipse of flat or background colour (a branch, a pole, another car) over part
    of the sign: its centre inside the sign's quad, its size a fraction of the sign's."""
    n = img.shape[0]
    size = float(np.ptp(quad[:, 0]) + np.ptp(quad[:, 1])) / 2
    w = rng.uniform(*style.occlusion_size) * size
    h = rng.uniform(*style.occlusion_size) * size
    t = rng.uniform(0, 1, 2)
    cx, cy = quad.mean(0) + (t - 0.5) * (quad.max(0) - quad.min(0)) * 0.8
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32) + 0.5
    mask = ((xx - cx) / (w / 2)) ** 2 + ((yy - cy) / (h / 2)) ** 2 <= 1
    out = img.copy()
    out[mask] = rng.uniform(0, 255, 3)
    return out


def _shadow(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A hard cast shadow: the pixels on one side of a random line darkened."""
    n = img.shape[0]
    a = rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32) - n / 2
    side = math.cos(a) * xx + math.sin(a) * yy > rng.uniform(-0.3, 0.3) * n
    out = img.copy()
    out[side] *= rng.uniform(0.3, 0.65)
    return out


def render_sign(label: int, rng: np.random.Generator, image_size: int = 32,
                style: SignStyle = DEFAULT_STYLE) -> np.ndarray:
    """One (image_size, image_size, 3) uint8 image of class `label` drawn with `rng`."""
    if not 0 <= label < len(SIGN_CLASSES):
        raise ValueError(f"label {label} out of range 0..{len(SIGN_CLASSES) - 1}")
    n = image_size
    quad = _sign_quad(rng, n, style)
    warped = _warp(label, quad, n)
    fade = rng.uniform(0.0, style.fade)  # weathered paint: blend towards its own grey
    img = _background(rng, n, style.backgrounds)
    # the extras draw after everything the default style draws: its bytes stay the same
    if style.distractor and rng.uniform() < style.distractor:
        img = _distractor(img, label, rng)
    img = _paint(img, warped, fade)
    if style.occlusion and rng.uniform() < style.occlusion:
        img = _occlude(img, quad, style, rng)
    if style.shadow and rng.uniform() < style.shadow:
        img = _shadow(img, rng)
    return np.clip(_lighting(img, rng, style.gain) + 0.5, 0, 255).astype(np.uint8)


def balanced_labels(n: int, num_classes: int, seed: int) -> np.ndarray:
    """`n` labels with every class count within one of the others, in seeded random order."""
    labels = np.arange(n, dtype=np.int64) % num_classes
    return np.random.default_rng([seed, 0x5151]).permutation(labels)


def make_signs(n: int, image_size: int = 32, seed: int = 0, num_classes: int | None = None,
               progress: bool = False, style: SignStyle = DEFAULT_STYLE) -> SignDataset:
    """Generate `n` balanced sign images; image i is drawn with rng([seed, i]) only."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    k = len(SIGN_CLASSES) if num_classes is None else num_classes
    if not 2 <= k <= len(SIGN_CLASSES):
        raise ValueError(f"num_classes must be in 2..{len(SIGN_CLASSES)}, got {num_classes}")
    labels = balanced_labels(n, k, seed)
    images = np.empty((n, image_size, image_size, 3), np.uint8)
    it = range(n)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"signs {image_size}px", unit="img", leave=False)
    for i in it:
        images[i] = render_sign(int(labels[i]), np.random.default_rng([seed, i]), image_size,
                                style)
    return SignDataset(images, labels, CLASS_NAMES[:k], image_size, seed)
