"""Saved-activation MiB and step time of `surgeon` against `tent`, per model.

Per method config, one `step` per measurement on a fixed batch (fresh model per config):
  saved MiB   measured with the same storage-dedup ledger for both: tent with a
              SavedActivationCounter around its step, surgeon from its codec (stats);
              forward + loss of the adaptation pass
  peak MiB    max(adaptation pass, faithful importance pass) for surgeon; = saved for tent
  ms          median step time over round-robin interleaved repeats (after 2 warm-up steps,
              so robot mode is past its dense first step); ratio to tent
Models: the shipped small_resnet (32 px, batch 16) and torchvision ResNet-18 (random
weights, 10 classes, 64 px, batch 8).
Usage: python benchmarks/memory/bench_surgeon.py [--repeats 5] [--threads 1]   (prints JSON)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from torch import nn
from torchvision.models import resnet18

from tta_core.memory import SavedActivationCounter
from tta_core.memory.ledger import MIB
from tta_core.model.source import load_source
from tta_core.registry import build_method

CONFIGS: dict[str, tuple[str, dict]] = {
    "tent": ("tent", {}),
    "surgeon": ("surgeon", {}),
    "surgeon_robot": ("surgeon", {"mode": "robot"}),
    "surgeon_bn": ("surgeon", {"trainable": "norm"}),
    "surgeon_bn_robot": ("surgeon", {"trainable": "norm", "mode": "robot"}),
    "surgeon_css_cr": ("surgeon", {"css": True, "cr": True}),
}


def _models() -> dict[str, tuple[callable, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        "small_resnet_32px_b16": (lambda: load_source("checkpoints/small_resnet_signs32.json")[0],
                                  0.5 * torch.randn((16, 3, 32, 32), generator=g)),
        "resnet18_64px_b8": (lambda: _r18(), torch.randn((8, 3, 64, 64), generator=g)),
    }


def _r18() -> nn.Module:
    torch.manual_seed(0)
    return resnet18(num_classes=10)


def _saved(meth, x: torch.Tensor) -> tuple[float, float]:
    """(saved MiB, peak saved MiB) of one step."""
    if meth.name == "tent":
        counter = SavedActivationCounter(meth.model)
        with counter:
            meth.step(x)
        return counter.result.total / MIB, counter.result.total / MIB
    stats = meth.step(x).stats
    return stats["saved_bytes"] / MIB, stats["peak_saved_bytes"] / MIB


def bench_model(make, x: torch.Tensor, repeats: int) -> dict:
    meths = {k: build_method(name, make(), **opts) for k, (name, opts) in CONFIGS.items()}
    out: dict[str, dict] = {}
    for key, meth in meths.items():
        meth.step(x)
        saved, peak = _saved(meth, x)  # second step: robot mode is pruned
        out[key] = {"saved_mib": round(saved, 3), "peak_mib": round(peak, 3)}
    times = harness.round_robin({k: (lambda m=m: m.step(x)) for k, m in meths.items()},
                                repeats, warmup=0)
    tent_ms = times["tent"].median
    for key in meths:
        ms = times[key].median
        out[key].update(ms=round(ms, 1), time_ratio=round(ms / tent_ms, 2),
                        saved_ratio=round(out[key]["saved_mib"] / out["tent"]["saved_mib"], 3))
        if key != "tent":
            out[key]["keep_mean"] = round(float(statistics.mean(meths[key].last_keep.values())),
                                          3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = {name: bench_model(make, x, args.repeats) for name, (make, x) in _models().items()}
    res["meta"] = {"threads": args.threads, "repeats": args.repeats,
                   "torch": torch.__version__, "device": "cpu"}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
