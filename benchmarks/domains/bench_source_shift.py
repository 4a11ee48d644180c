"""Source model vs. the shift: signs/s, corruption cost, clean and per-domain accuracy.

Prints JSON: synthetic-sign generation rate at 32/64 px (one core), mean ms per corrupted
image per corruption, the source model's clean held-out accuracy and its accuracy on each
domain of the continual severity-5 stream (and the drop in points).

    .venv/bin/python benchmarks/domains/bench_source_shift.py [--card ...]
        [--samples-per-domain 200]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch

from tta_core.data.corruptions import CORRUPTIONS, corrupt_image
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.model.source import accuracy, load_source

ROOT = Path(__file__).resolve().parents[2]


def signs_rate(size: int, n: int) -> float:
    make_signs(8, size, seed=99)  # warm the template cache
    with harness.Stopwatch() as sw:
        make_signs(n, size, seed=1)
    return n / sw.s


def corruption_ms(images: np.ndarray) -> dict[str, float]:
    out = {}
    for name in CORRUPTIONS:
        corrupt_image(images[0], name, 5, seed=0)  # one-off costs (numba compile)
        with harness.Stopwatch() as sw:
            for i, img in enumerate(images):
                corrupt_image(img, name, 5, seed=i)
        out[name] = round(sw.ms / len(images), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--card", default=str(ROOT / "checkpoints/small_resnet_signs32.json"))
    ap.add_argument("--samples-per-domain", type=int, default=200)
    ap.add_argument("--clean-samples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, card = load_source(args.card)
    clean = make_signs(args.clean_samples, card.image_size, seed=card.seed + 10_000)
    clean_acc = accuracy(model, images_to_tensor(clean.images, card.mean, card.std),
                         torch.from_numpy(clean.labels))
    spec = StreamSpec(image_size=card.image_size, samples_per_domain=args.samples_per_domain,
                      seed=args.seed, num_classes=card.num_classes)
    with harness.Stopwatch() as sw:
        stream = build_stream(spec, progress=False)
    build_s = sw.s
    per_domain = {}
    for dom in stream.domain_order():
        m = stream.domains == dom
        x = images_to_tensor(stream.images[m], card.mean, card.std)
        per_domain[dom] = round(accuracy(model, x, torch.from_numpy(stream.labels[m])), 4)
    mean_acc = float(np.mean(list(per_domain.values())))
    print(json.dumps({
        "signs_per_s": {"32px": round(signs_rate(32, 2000), 1),
                        "64px": round(signs_rate(64, 1000), 1)},
        "corrupt_ms_per_image_sev5_32px": corruption_ms(clean.images[:20]),
        "stream_build_s": round(build_s, 2), "stream_len": len(stream),
        "card": card.name, "clean_accuracy": round(clean_acc, 4),
        "continual_sev5_accuracy": per_domain, "continual_sev5_mean": round(mean_acc, 4),
        "drop_points": round(100 * (clean_acc - mean_acc), 2),
    }, indent=1))


if __name__ == "__main__":
    main()
