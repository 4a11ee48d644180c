"""Model input preprocessing: uint8 NHWC images -> normalised float32 NCHW tensors.

One definition shared by training (tta_core.model.source), the benchmark
(tta_core.eval.bench_inputs) and live / recorded frames (tta_core.io.image_msg), so a model sees the
same normalisation everywhere; kept apart from the shift streams so that image decoding does
not depend on stream generation.
"""

from __future__ import annotations

import numpy as np
import torch


def images_to_tensor(images: np.ndarray, mean: tuple[float, ...],
                     std: tuple[float, ...]) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW normalised by per-channel mean/std (in [0, 1] units)."""
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected (N, H, W, 3) uint8 images, got {images.shape} "
                         f"{images.dtype}")
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - m) / s
