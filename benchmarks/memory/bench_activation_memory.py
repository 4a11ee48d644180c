"""Saved-activation memory and time of the activation codec (tta_core.memory), per model.

For torchvision ResNet-18 (224 px, batch 8) and ResNet-50 (224 px, batch 4), random weights,
train-mode BN, entropy loss, one forward + backward per measurement:
  dense      all parameters trainable, no codec (measured by SavedActivationCounter)
  bn_only    only BN affine parameters trainable, no codec
  keep_0.5 / keep_0.3 / keep_0.1   all trainable, codec: exact 1-bit ReLU masks, BN inputs
             dense, conv/linear inputs magnitude-pruned to that keep ratio
Per config: measured saved MiB (and by role), the byte predictor's MiB, the analytic MiB
(conv/linear inputs x keep, as papers count), peak RSS of the step (VmHWM reset before it;
also minus the RSS at its start), CUDA peak when available, and forward+backward time
(median of round-robin interleaved repeats) with its ratio to dense.
Usage: python benchmarks/memory/bench_activation_memory.py [--quick] [--repeats 5] [--threads 1]
Prints JSON. --quick: 112 px and half the batch.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import psutil
import torch
from torch import nn
from torchvision.models import resnet18, resnet50

from tta_core.memory import (
    ActivationCodec,
    CodecPlan,
    SavedActivationCounter,
    memory_peaks,
    predicted_bytes,
    profile_saves,
    reset_peaks,
)
from tta_core.memory.ledger import MIB
from tta_core.model.units import decompose

KEEPS = (0.5, 0.3, 0.1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    p = logits.softmax(1)
    return -(p * p.clamp_min(1e-12).log()).sum(1).mean()


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _trim() -> None:
    """Give freed heap memory back to the OS so the next peak-RSS reading starts clean."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _mmap_large_blocks() -> bool:
    """glibc: serve blocks >= 64 KiB by mmap (a fixed threshold stops glibc's dynamic one from
    moving tensors to the heap), so freed tensors leave the RSS and peak RSS tracks live
    memory rather than heap high-water marks. False where not glibc."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(-3, 65536))


def _set_trainable(model: nn.Module, bn_only: bool) -> None:
    for mod in model.modules():
        is_bn = isinstance(mod, nn.BatchNorm2d)
        for p in mod.parameters(recurse=False):
            p.requires_grad_(is_bn or not bn_only)


def _step(model: nn.Module, x: torch.Tensor, ctx) -> tuple[float, object]:
    """One forward (under ctx) + backward; returns (seconds, ctx.result)."""
    model.zero_grad(set_to_none=False)
    with harness.Stopwatch(device=x.device) as sw:
        with ctx:
            loss = _entropy(model(x))
        loss.backward()
    return sw.s, ctx.result


def _configs(staged) -> dict[str, tuple[bool, object]]:
    """name -> (bn_only, context factory)."""
    out = {"dense": (False, lambda: SavedActivationCounter(staged)),
           "bn_only": (True, lambda: SavedActivationCounter(staged))}
    for k in KEEPS:
        out[f"keep_{k}"] = (False, lambda k=k: ActivationCodec(staged, CodecPlan.uniform(k)))
    return out


def _memory_of(model, x, bn_only, make, profile, name) -> dict:
    """Saved bytes and peak RSS of one step of a config (after a warm-up step)."""
    _set_trainable(model, bn_only)
    _step(model, x, make())  # warm-up: oneDNN primitives, grad buffers
    _trim()
    resettable = reset_peaks()
    start = psutil.Process().memory_info().rss
    _secs, res = _step(model, x, make())
    peaks = memory_peaks()
    row = {"saved_mib": res.total / MIB,
           "by_role_mib": {k: v / MIB for k, v in res.by_role.items()},
           "analytic_mib": res.analytic_kept / MIB,
           "peak_rss_mib": peaks.rss_bytes / MIB if resettable else None,
           "peak_rss_over_start_mib": (peaks.rss_bytes - start) / MIB if resettable else None,
           "cuda_peak_mib": None if peaks.cuda_bytes is None else peaks.cuda_bytes / MIB}
    if name.startswith("keep_"):
        plan = CodecPlan.uniform(float(name.split("_")[1]))
        row["predicted_mib"] = predicted_bytes(profile, plan).total / MIB
    elif name == "dense":
        row["predicted_mib"] = predicted_bytes(profile, CodecPlan(act_masks=False)).total / MIB
    return row


def bench_model(arch: str, px: int, batch: int, repeats: int, device: str) -> dict:
    """All configs of one model: memory rows, then interleaved timing."""
    torch.manual_seed(0)
    model = (resnet18 if arch == "resnet18" else resnet50)(num_classes=1000).to(device).train()
    x = torch.randn(batch, 3, px, px, device=device)
    staged = decompose(model, (3, px, px), arch=arch)
    _set_trainable(model, False)
    profile = profile_saves(staged, x, _entropy)
    configs = _configs(staged)
    rows = {name: _memory_of(model, x, bn_only, make, profile, name)
            for name, (bn_only, make) in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):  # round robin: contention drifts hit every config alike
        for name, (bn_only, make) in configs.items():
            _set_trainable(model, bn_only)
            times[name].append(_step(model, x, make())[0])
    dense_s = statistics.median(times["dense"])
    for name, row in rows.items():
        row["fwd_bwd_ms"] = 1e3 * statistics.median(times[name])
        row["time_ratio_vs_dense"] = statistics.median(times[name]) / dense_s
    return {"arch": arch, "input": [batch, 3, px, px], "units": len(staged.units),
            "configs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="112 px, half the batch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's dynamic mmap threshold (peak RSS then includes heap "
                         "blocks freed earlier and reused)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mmap_tuned = not args.default_malloc and _mmap_large_blocks()
    scale = 2 if args.quick else 1
    models = [("resnet18", 224 // scale, 8 // scale), ("resnet50", 224 // scale, 4 // scale)]
    result = {"torch": torch.__version__, "device": args.device, "threads": args.threads,
              "repeats": args.repeats, "quick": args.quick,
              "malloc_mmap_threshold_64k": mmap_tuned,
              "models": [bench_model(a, px, b, args.repeats, args.device)
                         for a, px, b in models]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
