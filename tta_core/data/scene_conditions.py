"""Adverse conditions of a synthetic scene, ACDC style: fog, night, rain, snow.

Fog and snow are the ImageNet-C corruptions of tta_core.data.corruptions (at `severity`);
night and rain are simple physical renders that use the scene's mask and lights:

- night: the scene's irradiance scaled down with a gamma (dark sky, dim facades), glows of
  the car lamps and street lamps (Gaussian halos, additive), then sensor noise growing
  with the gain (shot-like) and a slight blur;
- rain: wet road and sidewalk darkened with a sheen that mirrors the sky colour, contrast
  lost to the veil of drops, a slight blur, and streaks (short slanted lines, blurred
  along their direction) over the whole image.

The mask is the clean scene's: the conditions change appearance, not geometry. Every
render is a function of (scene, severity, seed) alone.
"""

from __future__ import annotations

import cv2
import numpy as np

from tta_core.data.corruptions import SEVERITIES, corrupt_image
from tta_core.data.scenes import ROAD, SIDEWALK, SKY, Scene

CONDITIONS: tuple[str, ...] = ("fog", "night", "rain", "snow")


def _night(scene: Scene, severity: int, rng: np.random.Generator) -> np.ndarray:
    f = scene.image.astype(np.float32) / 255.0
    gain = 0.5 - 0.07 * severity
    f = gain * f ** (1.4 + 0.2 * severity)
    f[scene.label == SKY] *= 0.3
    h, w = f.shape[:2]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for x, y, r, colour in scene.lights:
        r = max(float(r), 2.0)
        halo = np.exp(-((xx - x) ** 2 + (yy - y) ** 2) / (2 * r * r))
        f += 0.9 * halo[..., None] * np.asarray(colour, np.float32)
    sigma = 0.01 + 0.008 * severity
    f += sigma * np.sqrt(np.maximum(f, 0.02)) * rng.standard_normal(f.shape).astype(np.float32)
    f = cv2.GaussianBlur(f, (0, 0), 0.6)
    return np.clip(f * 255 + 0.5, 0, 255).astype(np.uint8)


def _rain(scene: Scene, severity: int, rng: np.random.Generator) -> np.ndarray:
    f = scene.image.astype(np.float32) / 255.0
    h, w = f.shape[:2]
    wet = np.isin(scene.label, (ROAD, SIDEWALK))
    sky = f[scene.label == SKY].mean(0) if (scene.label == SKY).any() else np.full(3, 0.7)
    f[wet] = 0.55 * f[wet] + 0.12 * np.asarray(sky, np.float32)
    veil = 0.1 + 0.06 * severity
    f = (1 - veil) * f + veil * np.float32(0.62)
    f = cv2.GaussianBlur(f, (0, 0), 0.4 + 0.15 * severity)
    streaks = np.zeros((h, w), np.float32)
    n = 150 + 120 * severity
    x0 = rng.uniform(0, w, n)
    y0 = rng.uniform(-10, h, n)
    length = rng.uniform(6, 10 + 2 * severity, n)
    angle = np.deg2rad(rng.normal(100, 5))
    for x, y, ln in zip(x0, y0, length, strict=True):
        end = (int(x + ln * np.cos(angle)), int(y + ln * np.sin(angle)))
        cv2.line(streaks, (int(x), int(y)), end, float(rng.uniform(0.3, 0.8)), 1, cv2.LINE_AA)
    streaks = cv2.GaussianBlur(streaks, (0, 0), 0.5)
    f = f + (0.85 - f) * np.clip(streaks, 0, 1)[..., None] * 0.8
    return np.clip(f * 255 + 0.5, 0, 255).astype(np.uint8)


def render_condition(scene: Scene, condition: str, severity: int, seed: int) -> np.ndarray:
    """`scene`'s image under `condition` at `severity` (1-5); ValueError naming a bad one."""
    if condition not in CONDITIONS:
        raise ValueError(f"unknown condition {condition!r}; choose from {', '.join(CONDITIONS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be 1..5, got {severity!r}")
    if condition in ("fog", "snow"):
        return corrupt_image(scene.image, condition, severity, seed)
    rng = np.random.default_rng([seed, CONDITIONS.index(condition), severity])
    return (_night if condition == "night" else _rain)(scene, severity, rng)
