"""ImageNet-C corruptions (Hendrycks & Dietterich 2019) at severity 1-5, for small images.

Wraps `imagecorruptions` (the numpy-2 compatible imagecorruptions-imaug fork). That code
draws from numpy's *global* RNG (two corruptions take their own seed), so every image is
corrupted under its own seed, set just before the call: the same (seed, index) always
gives the same bytes. Its parameters are
tuned for 224 px ImageNet images and are used unchanged, so at 32/64 px the blurs are
relatively stronger than CIFAR-10-C's; severity still orders the strength. The four
held-out corruptions (`HELD_OUT`) are accepted too, for novelty tests.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

# the paper's (and ImageNet-C's standard) order of the 15 common corruptions
CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression",
)
# imagecorruptions' "validation" set: never seen while learning domains (DARDA's unseen four)
HELD_OUT: tuple[str, ...] = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
ALL_CORRUPTIONS: tuple[str, ...] = CORRUPTIONS + HELD_OUT
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)
_MIN_SIDE = 32  # frost crops a 32 px+ patch from its texture; smaller inputs are upscaled
_RNG_LOCK = threading.Lock()  # the library uses numpy's global RNG
_OWN_SEED = ("impulse_noise", "glass_blur")  # these take a seed (skimage / numba RNGs)


def check(name: str, severity: int) -> None:
    """ValueError naming an unknown corruption or a severity outside 1..5."""
    if name not in ALL_CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}; choose from {', '.join(ALL_CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be 1..5, got {severity!r}")


def corrupt_image(image: np.ndarray, name: str, severity: int, seed: int = 0) -> np.ndarray:
    """`image` (H, W, 3) uint8 corrupted by `name` at `severity`; same shape and dtype."""
    check(name, severity)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {image.shape} {image.dtype}")
    from imagecorruptions import corrupt

    h, w = image.shape[:2]
    src = image
    if min(h, w) < _MIN_SIDE:
        k = -(-_MIN_SIDE // min(h, w))
        src = np.repeat(np.repeat(image, k, 0), k, 1)
    with _RNG_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.random.seed(seed % 2**32)
        extra = {"seed": seed % 2**32} if name in _OWN_SEED else {}
        out = corrupt(src, corruption_name=name, severity=severity, **extra)
    out = np.clip(np.asarray(out, dtype=np.float32), 0, 255).astype(np.uint8)
    if out.shape[:2] != (h, w):  # upscaled input: sample back down by block means
        out = out[: (out.shape[0] // h) * h, : (out.shape[1] // w) * w]
        out = out.reshape(h, out.shape[0] // h, w, out.shape[1] // w, 3).mean((1, 3))
        out = np.clip(out + 0.5, 0, 255).astype(np.uint8)
    return out


def corrupt_batch(images: np.ndarray, name: str, severity: int, seed: int = 0) -> np.ndarray:
    """(N, H, W, 3) uint8 corrupted image by image; image i uses seed (seed, i)."""
    if images.ndim != 4:
        raise ValueError(f"expected (N, H, W, 3) images, got shape {images.shape}")
    check(name, severity)
    base = np.random.SeedSequence([seed, ALL_CORRUPTIONS.index(name), severity])
    seeds = base.generate_state(len(images))
    out = np.empty_like(images)
    for i, img in enumerate(images):
        out[i] = corrupt_image(img, name, severity, int(seeds[i]))
    return out
