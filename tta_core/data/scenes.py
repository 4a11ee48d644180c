"""Synthetic driving scenes with Cityscapes train-id masks, for segmentation TTA.

`render_scene(seed)` draws one 128 x 256 (H x W) street view from its seed alone: a road
in perspective towards a vanishing point (lane markings are road, as in Cityscapes),
sidewalks, facades of buildings with window grids, trees and hedges, sky, and, ordered far
to near, poles with traffic signs and street lamps, parked or driving cars and pedestrians.
Labels use Cityscapes' trainId numbering (`CITYSCAPES_CLASSES`; `SCENE_CLASSES` are the nine
drawn here) with 255 = ignore (the anti-aliased outlines of objects). Ground and facades are
one vectorised numpy pass over the pixel grid; objects are OpenCV polygons. The scene also
returns the positions of its lights (car lamps, street lamps) for the night render
(tta_core.data.scene_conditions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import cv2
import numpy as np

CITYSCAPES_CLASSES: tuple[str, ...] = (
    "road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign",
    "vegetation", "terrain", "sky", "person", "rider", "car", "truck", "bus", "train",
    "motorcycle", "bicycle")
IGNORE = 255
ROAD, SIDEWALK, BUILDING, POLE, SIGN, VEGETATION, SKY, PERSON, CAR = 0, 1, 2, 5, 7, 8, 10, 11, 13
SCENE_CLASSES: tuple[int, ...] = (ROAD, SIDEWALK, BUILDING, POLE, SIGN, VEGETATION, SKY,
                                  PERSON, CAR)
HEIGHT, WIDTH = 128, 256


@dataclass
class Scene:
    """One rendered scene: RGB image, train-id mask, lights (x, y, radius, (r, g, b))."""

    image: np.ndarray  # (H, W, 3) uint8
    label: np.ndarray  # (H, W) uint8 train ids, 255 = ignore
    lights: list[tuple[float, float, float, tuple[float, float, float]]] = field(
        default_factory=list)


@dataclass(frozen=True)
class _Geometry:
    hor: float  # horizon row
    xv: float  # vanishing point column
    road_l: float  # road half-widths at the bottom row, left and right of xv
    road_r: float
    walk: float  # sidewalk width at the bottom row

    def t(self, y: np.ndarray | float) -> np.ndarray | float:
        """Depth parameter of a ground row: 0 at the horizon, 1 at the bottom row."""
        return (np.asarray(y, dtype=np.float32) - self.hor) / (HEIGHT - self.hor)

    def row(self, t: float) -> float:
        return self.hor + t * (HEIGHT - self.hor)


@cache
def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    yy.setflags(write=False)
    xx.setflags(write=False)
    return yy, xx


def _smooth_noise(rng: np.random.Generator, cells: tuple[int, int]) -> np.ndarray:
    """(H, W) float noise in [-1, 1], smooth at the scale of `cells` (rows, cols)."""
    small = rng.uniform(-1, 1, cells).astype(np.float32)
    return cv2.resize(small, (WIDTH, HEIGHT), interpolation=cv2.INTER_CUBIC).clip(-1, 1)


def _geometry(rng: np.random.Generator) -> _Geometry:
    return _Geometry(hor=HEIGHT * rng.uniform(0.36, 0.48), xv=WIDTH * rng.uniform(0.38, 0.62),
                     road_l=WIDTH * rng.uniform(0.35, 0.6), road_r=WIDTH * rng.uniform(0.35, 0.6),
                     walk=WIDTH * rng.uniform(0.2, 0.4))


def _facades(g: _Geometry, rng: np.random.Generator, s: np.ndarray, left: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pixel: facade top row, whether the facade is vegetation, its colour index;
    segments of constant height along the depth `s` of each street side."""
    top = np.empty_like(s)
    veg = np.zeros(s.shape, bool)
    col = np.zeros(s.shape, np.int32)
    for side, mask in enumerate((left, ~left)):
        edges = np.sort(rng.uniform(0.0, 1.2, rng.integers(3, 7)))
        kinds = rng.random(len(edges) + 1) < 0.35  # vegetation segments
        heights = np.where(kinds, rng.uniform(0.4, 1.1, len(edges) + 1),
                           rng.uniform(0.9, 2.6, len(edges) + 1))
        seg = np.searchsorted(edges, s[mask])
        top[mask] = g.hor - s[mask] * heights[seg] * (HEIGHT - g.hor)
        veg[mask] = kinds[seg]
        col[mask] = seg + 8 * side
    return top, veg, col


def _background(g: _Geometry, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sky, facades, road (with lane markings) and sidewalks: image (float 0-1), mask."""
    yy, xx = _grid(HEIGHT, WIDTH)
    t = np.maximum(g.t(yy), 1e-3)
    left = xx < g.xv
    half_road = np.where(left, g.road_l, g.road_r)
    s = np.abs(xx - g.xv) / (half_road + g.walk)  # ground depth where a column meets a facade
    lateral = np.abs(xx - g.xv) / t  # bottom-row units
    top, veg, col = _facades(g, rng, s, left)
    veg_top = top + 2.5 * _smooth_noise(rng, (4, 24)) * (1 + 4 * s)
    below = yy >= g.hor
    facade = (lateral > half_road + g.walk) | ~below
    facade &= np.where(veg, yy > veg_top, yy > top)
    label = np.full((HEIGHT, WIDTH), SKY, np.uint8)
    label[below & (lateral <= half_road)] = ROAD
    label[below & (lateral > half_road) & (lateral <= half_road + g.walk)] = SIDEWALK
    label[facade & veg] = VEGETATION
    label[facade & ~veg] = BUILDING
    img = _paint_background(g, rng, label, t, s, lateral, col, yy, xx)
    return img, label


def _paint_background(g: _Geometry, rng: np.random.Generator, label: np.ndarray,
                      t: np.ndarray, s: np.ndarray, lateral: np.ndarray, col: np.ndarray,
                      yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
    img = np.empty((HEIGHT, WIDTH, 3), np.float32)
    up = np.clip(yy / max(g.hor, 1), 0, 1)[..., None]
    sky_top, sky_low = rng.uniform([0.2, 0.35, 0.6], [0.45, 0.6, 0.95]), rng.uniform(0.7, 0.95, 3)
    img[:] = sky_top * (1 - up) + sky_low * up
    clouds = np.clip(_smooth_noise(rng, (3, 8)), 0, 1)[..., None] * rng.uniform(0, 0.5)
    img += (1 - img) * clouds
    palette = rng.uniform([0.35, 0.3, 0.25], [0.85, 0.75, 0.7], (16, 3))
    dist = np.maximum(s, 1e-3)
    height = (g.hor + dist * (HEIGHT - g.hor) - yy) / (dist * (HEIGHT - g.hor))
    windows = ((np.mod(height * 3.2, 1) > 0.35) & (np.mod(height * 3.2, 1) < 0.75)
               & (np.mod(1.6 / dist, 1) > 0.3) & (np.mod(1.6 / dist, 1) < 0.8) & (dist > 0.12))
    building = palette[col] * (0.9 + 0.1 * _smooth_noise(rng, (8, 16)))[..., None]
    building[windows] = building[windows] * 0.35 + np.array([0.1, 0.14, 0.2])
    leaf = rng.uniform([0.12, 0.3, 0.08], [0.3, 0.55, 0.22])
    tex = 0.75 + 0.25 * _smooth_noise(rng, (16, 48))
    vegetation = leaf * tex[..., None]
    grey = rng.uniform(0.28, 0.45)
    road = np.full((HEIGHT, WIDTH, 3), grey, np.float32) + 0.03 * rng.standard_normal(
        (HEIGHT, WIDTH, 1)).astype(np.float32)
    paint = _lane_paint(g, label, t, lateral, xx)
    road[paint] = 0.9
    walk = rng.uniform([0.55, 0.5, 0.45], [0.75, 0.72, 0.7]) * (
        0.92 + 0.08 * (np.mod(1.5 / t, 1) > 0.1))[..., None]
    for cls, layer in ((BUILDING, building), (VEGETATION, vegetation), (ROAD, road),
                       (SIDEWALK, walk)):
        img[label == cls] = layer[label == cls]
    return img


def _lane_paint(g: _Geometry, label: np.ndarray, t: np.ndarray, lateral: np.ndarray,
                xx: np.ndarray) -> np.ndarray:
    """Centre dashes and edge lines of the road (bottom-row units, so they narrow)."""
    centre = (g.road_r - g.road_l) / 2  # lane centre offset from xv at the bottom row
    signed = (xx - g.xv) / t - centre
    dashes = (np.abs(signed) < WIDTH * 0.012) & (np.mod(2.0 / t, 1) < 0.5)
    edges = np.abs(lateral - np.where(xx < g.xv, g.road_l, g.road_r) * 0.95) < WIDTH * 0.008
    return (label == ROAD) & (dashes | edges) & (t > 0.03)


def _draw(img: np.ndarray, label: np.ndarray, pts: np.ndarray, color, cls: int) -> None:
    """A filled polygon in the image (anti-aliased) and the mask (ignore on its outline)."""
    p = np.round(pts * 16).astype(np.int32)
    cv2.fillPoly(img, [p], color, cv2.LINE_AA, 4)
    cv2.fillPoly(label, [p], int(cls), cv2.LINE_8, 4)


def _box(x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float32)


def _car(img, label, g: _Geometry, rng, t: float, lights: list) -> None:
    yb = g.row(t)
    side = rng.uniform(-0.75, 0.75)
    xc = g.xv + t * side * (g.road_r if side > 0 else g.road_l)
    w = t * WIDTH * rng.uniform(0.3, 0.4)
    h = w * rng.uniform(0.55, 0.75)
    body = tuple(float(c) for c in rng.uniform(0.05, 0.95, 3))
    _draw(img, label, _box(xc - w / 2, yb - h * 0.62, xc + w / 2, yb - h * 0.1), body, CAR)
    cab = np.array([[xc - w * 0.38, yb - h * 0.6], [xc - w * 0.28, yb - h],
                    [xc + w * 0.28, yb - h], [xc + w * 0.38, yb - h * 0.6]], np.float32)
    _draw(img, label, cab, body, CAR)
    _draw(img, label, _box(xc - w * 0.3, yb - h * 0.93, xc + w * 0.3, yb - h * 0.65),
          (0.12, 0.15, 0.2), CAR)
    for dx in (-0.36, 0.24):
        _draw(img, label, _box(xc + w * dx, yb - h * 0.16, xc + w * (dx + 0.12), yb),
              (0.04, 0.04, 0.04), CAR)
    lamp = (1.0, 0.95, 0.8) if side < 0 else (1.0, 0.15, 0.1)  # oncoming: headlights
    for dx in (-0.4, 0.32):
        _draw(img, label, _box(xc + w * dx, yb - h * 0.5, xc + w * (dx + 0.08), yb - h * 0.4),
              lamp, CAR)
        lights.append((xc + w * (dx + 0.04), yb - h * 0.45, w * 0.18, lamp))


def _person(img, label, g: _Geometry, rng, t: float) -> None:
    yb = g.row(t)
    side = rng.choice((-1.0, 1.0))
    road = g.road_r if side > 0 else g.road_l
    x = g.xv + side * t * (road + g.walk * rng.uniform(0.2, 0.8))
    h = t * WIDTH * rng.uniform(0.26, 0.34)
    w = h * 0.28
    shirt = tuple(float(c) for c in rng.uniform(0.05, 0.95, 3))
    trousers = tuple(float(c) for c in rng.uniform(0.05, 0.4, 3))
    _draw(img, label, _box(x - w * 0.4, yb - h * 0.48, x - w * 0.05, yb), trousers, PERSON)
    _draw(img, label, _box(x + w * 0.05, yb - h * 0.48, x + w * 0.4, yb), trousers, PERSON)
    _draw(img, label, _box(x - w * 0.5, yb - h * 0.82, x + w * 0.5, yb - h * 0.45), shirt, PERSON)
    head = cv2.ellipse2Poly((int(x * 16), int((yb - h * 0.9) * 16)),
                            (max(int(w * 0.32 * 16), 8), max(int(h * 0.09 * 16), 8)), 0, 0, 360, 20)
    _draw(img, label, head.astype(np.float32) / 16, (0.85, 0.7, 0.55), PERSON)


def _pole(img, label, g: _Geometry, rng, t: float, lights: list) -> None:
    yb = g.row(t)
    side = rng.choice((-1.0, 1.0))
    road = g.road_r if side > 0 else g.road_l
    x = g.xv + side * t * (road + g.walk * rng.uniform(0.75, 0.95))
    h = t * WIDTH * rng.uniform(0.55, 0.8)
    w = max(t * WIDTH * 0.018, 1.5)
    grey = float(rng.uniform(0.3, 0.6))
    _draw(img, label, _box(x - w / 2, yb - h, x + w / 2, yb), (grey, grey, grey * 1.05), POLE)
    kind = rng.integers(0, 4)  # 0 lamp, 1 round sign, 2 triangle, 3 square
    r = max(t * WIDTH * 0.045, 3.0)
    cy = yb - h * rng.uniform(0.55, 0.8)
    if kind == 0:
        _draw(img, label, _box(x - side * w * 4, yb - h, x, yb - h + w * 1.5),
              (grey, grey, grey), POLE)
        lights.append((x - side * w * 3, yb - h + w * 2, h * 0.2, (1.0, 0.85, 0.55)))
        return
    colour = [(0.85, 0.1, 0.1), (0.1, 0.25, 0.8), (0.95, 0.8, 0.1)][int(rng.integers(0, 3))]
    if kind == 1:
        pts = cv2.ellipse2Poly((int(x * 16), int(cy * 16)), (int(r * 16),) * 2, 0, 0, 360, 15)
        pts = pts.astype(np.float32) / 16
    elif kind == 2:
        pts = np.array([[x - r, cy + r * 0.8], [x + r, cy + r * 0.8], [x, cy - r]], np.float32)
    else:
        pts = _box(x - r, cy - r, x + r, cy + r)
    _draw(img, label, pts, colour, SIGN)


def render_scene(seed: int | tuple[int, ...]) -> Scene:
    """The scene of `seed` (an int or a tuple such as (seed, split, index))."""
    rng = np.random.default_rng(seed)
    g = _geometry(rng)
    img, label = _background(g, rng)
    img = np.ascontiguousarray(img)
    objects = ([("car", t) for t in rng.uniform(0.2, 0.95, rng.integers(0, 5))]
               + [("person", t) for t in rng.uniform(0.3, 0.95, rng.integers(0, 5))]
               + [("pole", t) for t in rng.uniform(0.3, 1.0, rng.integers(1, 5))])
    lights: list = []
    outline = label.copy()
    for kind, t in sorted(objects, key=lambda o: o[1]):  # far to near
        if kind == "car":
            _car(img, outline, g, rng, float(t), lights)
        elif kind == "person":
            _person(img, outline, g, rng, float(t))
        else:
            _pole(img, outline, g, rng, float(t), lights)
    img *= rng.uniform(0.85, 1.1)  # exposure
    img += 0.012 * rng.standard_normal(img.shape).astype(np.float32)
    out = np.clip(img * 255 + 0.5, 0, 255).astype(np.uint8)
    return Scene(out, _ignore_edges(label, outline), lights)


def _ignore_edges(background: np.ndarray, objects: np.ndarray) -> np.ndarray:
    """The object mask with 255 on a 1 px ring where an object meets another class (the
    anti-aliased pixels blend both colours)."""
    edge = cv2.morphologyEx(objects, cv2.MORPH_GRADIENT, np.ones((2, 2), np.uint8)) > 0
    drawn = objects != background
    ring = edge & (drawn | cv2.dilate(drawn.astype(np.uint8), np.ones((3, 3), np.uint8)) > 0)
    out = objects.copy()
    out[ring] = IGNORE
    return out
