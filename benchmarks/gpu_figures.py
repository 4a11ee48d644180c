"""Memory and served-forward figures on one device (the GPU part of `gpu_check.sh`).

Per method, in one interleaved run on the same batches: the median step time, the bytes
autograd saved in the step's forward (the saved-tensor ledger: Tent's dense forward counted
by `SavedActivationCounter`, the codecs' own `saved_bytes`) and, on CUDA, the peak memory
allocated during the step above what was allocated before it (measured bytes). Then the
served forward (no grad) eager against `torch.compile` (CUDA graphs through
mode="reduce-overhead" on CUDA). Writes `<out>/gpu_figures.json` and prints a table.

    python benchmarks/gpu_figures.py --device cuda
    python benchmarks/gpu_figures.py --device cpu --arch resnet18 --image-size 32 \
        --batch-size 2 --batches 2 --no-compile          # the CPU self-test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tta_core.memory.accounting import SavedActivationCounter
from tta_core.methods import build_method
from tta_core.model.zoo import build_model
from tta_core.runtime.losses import entropy_loss

MIB = 2 ** 20


def _methods(arch: str, shape: tuple[int, ...], device: torch.device, budget_mib: float):
    """Tent dense, Tent with 4-bit saved activations, AdaShadow under a memory budget."""
    runs = {"tent": ("tent", {}), "tent 4-bit": ("tent", {"activation_bits": 4}),
            "adashadow + budget": ("adashadow", {"memory_budget_mb": budget_mib})}
    out = {}
    for label, (name, settings) in runs.items():
        torch.manual_seed(0)
        out[label] = build_method(name, build_model(arch, 10).to(device), input_shape=shape,
                                  arch=arch, **settings)
    return out


def _dense_saved_bytes(method, x: torch.Tensor) -> int:
    """Bytes Tent's forward + loss saves for its backward (nothing is updated)."""
    with torch.enable_grad(), SavedActivationCounter(method.model) as counter:
        entropy_loss(method.model(x))
    return counter.result.total if counter.result is not None else 0


def _timed_step(method, x: torch.Tensor, device: torch.device) -> tuple[float, int | None, dict]:
    """Step time (ms), CUDA peak above the allocation before the step, the result stats."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    res = method.step(x)
    if cuda:
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    return ms, peak, res.stats


def memory_figures(arch: str, size: int, batch: int, batches: int, device: torch.device,
                   budget_share: float) -> dict:
    shape = (3, size, size)
    gen = torch.Generator().manual_seed(0)
    xs = [(torch.randn(batch, *shape, generator=gen) * (1 + 0.3 * (i % 3)) + 0.2 * i
           ).to(device) for i in range(batches + 2)]
    torch.manual_seed(0)
    probe = build_method("tent", build_model(arch, 10).to(device), input_shape=shape, arch=arch)
    dense = _dense_saved_bytes(probe, xs[0])
    methods = _methods(arch, shape, device, budget_share * dense / MIB)
    rec = {label: {"ms": [], "peak": [], "saved": []} for label in methods}
    for i, x in enumerate(xs):
        for label, method in methods.items():
            ms, peak, stats = _timed_step(method, x, device)
            if i < 2:
                continue
            rec[label]["ms"].append(ms)
            rec[label]["peak"].append(peak)
            rec[label]["saved"].append(stats.get("saved_bytes", dense if label == "tent"
                                                 else None))
    for method in methods.values():
        method.close()
    return {label: {"step_ms": round(statistics.median(r["ms"]), 3),
                    "saved_mib": _med_mib(r["saved"]), "cuda_step_peak_mib": _med_mib(r["peak"]),
                    "saved_share_of_tent": (round(statistics.median(r["saved"]) / dense, 4)
                                            if None not in r["saved"] else None)}
            for label, r in rec.items()}


def _med_mib(values: list) -> float | None:
    return None if None in values else round(statistics.median(values) / MIB, 3)


def served_forward(arch: str, size: int, batch: int, batches: int, device: torch.device,
                   compile_too: bool) -> dict:
    """Median no-grad forward ms: eager, and torch.compile (reduce-overhead on CUDA)."""
    torch.manual_seed(0)
    model = build_model(arch, 10).to(device).eval()
    x = torch.randn(batch, 3, size, size, device=device)
    variants = {"eager": model}
    if compile_too:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        variants["compiled"] = torch.compile(model, mode=mode)
    out = {}
    for name, fn in variants.items():
        times = []
        with torch.no_grad():
            for i in range(batches + 3):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1e3)
        out[f"{name}_ms"] = round(statistics.median(times), 3)
    if "compiled_ms" in out:
        out["compiled_over_eager"] = round(out["compiled_ms"] / out["eager_ms"], 4)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--budget-share", type=float, default=0.3,
                    help="AdaShadow's memory budget as a share of Tent's saved bytes")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="docs/results", help="folder for gpu_figures.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    if not 0 < args.budget_share <= 1:
        ap.error(f"--budget-share must be in (0, 1], got {args.budget_share}")
    dims = (args.arch, args.image_size, args.batch_size, args.batches, device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size,
              "memory": memory_figures(*dims, args.budget_share),
              "served_forward": served_forward(*dims, not args.no_compile)}
    for label, m in report["memory"].items():
        print(f"{label:20s} step {m['step_ms']:9.2f} ms  saved {m['saved_mib']} MiB "
              f"({m['saved_share_of_tent']} of Tent)  CUDA step peak {m['cuda_step_peak_mib']} MiB")
    print("served forward:", report["served_forward"])
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_figures.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
