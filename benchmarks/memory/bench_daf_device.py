"""DAF on one device through the shared loop: step time, saved bytes and the CUDA step peak
of Tent with every parameter trainable (`trainable: all`) under

  dense     no codec
  daf8      activation_bits=8 (uniform widths)
  daf4      activation_bits=4
  dyn12     activation_budget_frac=0.12 (dynamic widths 0/2/4/8 per unit per batch)

one interleaved run (harness.round_robin, rotated), lr 0, random weights, fresh inputs per
round; the CUDA peak is the allocator's peak over one step less what was allocated before
it (weights, optimizer state), the maximum over the measured rounds. On CUDA also the
per-group min/max reduction at the product's group sizes (128, 256): torch.amin/amax on
the groups against the hybrid tree + CAS reduction (tta_kernels.triton_kernels.
group_minmax, Algorithm 1), and quantize_pack with the fused reduction against the hybrid
one (`hybrid=True`). Part of `benchmarks/gpu_check.sh`.
Usage: python benchmarks/memory/bench_daf_device.py --device cuda --out DIR
       [--arch resnet50 --image-size 224 --batch-size 4 --batches 10 --warmup 3]
Writes DIR/gpu_daf.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness
import torch
from torchvision import models as tv_models

from tta_core.memory.ledger import MIB
from tta_core.registry import build_method

CONFIGS = {"dense": {}, "daf8": {"activation_bits": 8}, "daf4": {"activation_bits": 4},
           "dyn12": {"activation_budget_frac": 0.12}}
GROUPS = (128, 256)


def step_figures(arch: str, size: int, batch: int, batches: int, warmup: int,
                 device: torch.device) -> dict:
    """Per config: median / min step ms, ratio to dense (median of per-round ratios), saved
    MiB (max), CUDA step peak MiB (max; None off CUDA), whether the budget held."""
    torch.manual_seed(0)
    model = getattr(tv_models, arch)(num_classes=10).train().to(device)
    meths = {k: build_method("tent", copy.deepcopy(model), lr=0.0,
                             lr_ref_batch=0, trainable="all", reforward=False,
                             memory_format="contiguous", cuda_graphs=False, **cfg)
             for k, cfg in CONFIGS.items()}
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(batch, 3, size, size, generator=gen).to(device)
          for _ in range(warmup + batches)]
    cuda = device.type == "cuda"
    seen: dict[str, dict[str, list]] = {k: {"saved": [], "peak": [], "held": []} for k in meths}

    def case(name: str):
        def run(x: torch.Tensor) -> tuple[dict, float | None]:
            meth = meths[name]
            meth.optimizer.zero_grad(set_to_none=True)
            base = torch.cuda.memory_allocated(device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            stats = meth.forward_and_adapt(x).stats
            peak = (torch.cuda.max_memory_allocated(device) - base) / MIB if cuda else None
            return stats, peak
        return run

    def record(name: str, returned: tuple[dict, float | None], counted: bool) -> None:
        if counted:
            stats, peak = returned
            seen[name]["saved"].append(stats.get("saved_bytes"))
            seen[name]["peak"].append(peak)
            seen[name]["held"].append(stats.get("within_width_budget", True))

    times = harness.round_robin({k: case(k) for k in meths}, inputs=xs, warmup=warmup,
                                rotate=True, device=device, on_result=record)
    dense = times["dense"].times["wall"]
    out = {}
    for k, t in times.items():
        ms = t.times["wall"]
        saved = [s for s in seen[k]["saved"] if s is not None]
        peaks = [p for p in seen[k]["peak"] if p is not None]
        out[k] = {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2),
                  "x_dense": round(statistics.median(a / b for a, b in zip(ms, dense,
                                                                           strict=True)), 3),
                  "saved_mib_max": round(max(saved) / MIB, 2) if saved else None,
                  "cuda_step_peak_mib": round(max(peaks), 1) if peaks else None,
                  "budget_held_pct": round(100 * sum(map(bool, seen[k]["held"]))
                                           / len(seen[k]["held"]), 1)}
    return out


def reduction_figures(device: torch.device, rounds: int) -> list[dict]:
    """amin/amax vs the hybrid reduction, and quantize_pack fused vs hybrid, per group size,
    on one post-ReLU tensor (CUDA only: the hybrid reduction is a Triton kernel)."""
    if device.type != "cuda":
        return []
    from tta_kernels import triton_kernels as tk

    x = torch.randn(4 * 256 * 56 * 56, device=device).relu_()
    rows = []
    for group in GROUPS:
        g = x[: x.numel() // group * group].view(-1, group)
        t = harness.round_robin({
            "amin_amax": lambda g=g: (g.amin(1), g.amax(1)),
            "hybrid_minmax": lambda group=group: tk.group_minmax(x, group),
            "quantize_fused": lambda group=group: tk.quantize_pack(x, 4, group),
            "quantize_hybrid": lambda group=group: tk.quantize_pack(x, 4, group, hybrid=True),
        }, rounds, warmup=3, rotate=True, device=device)
        med = {k: round(statistics.median(v.times["wall"]), 4) for k, v in t.items()}
        rows.append({"group": group, "numel": x.numel(), "ms": med,
                     "hybrid_vs_amin_amax": round(med["amin_amax"] / med["hybrid_minmax"], 3),
                     "hybrid_vs_fused_quantize": round(med["quantize_fused"]
                                                       / med["quantize_hybrid"], 3)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="docs/results/gpu", help="folder for gpu_daf.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    if args.batches < 1 or args.warmup < 0:
        ap.error(f"--batches {args.batches} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size,
              "batches": args.batches,
              "steps": step_figures(args.arch, args.image_size, args.batch_size, args.batches,
                                    args.warmup, device),
              "reduction": reduction_figures(device, max(args.batches, 5))}
    for k, r in report["steps"].items():
        print(f"DAF {k:6s} step {r['median_ms']:9.2f} ms  x dense {r['x_dense']}  saved "
              f"{r['saved_mib_max']} MiB  CUDA step peak {r['cuda_step_peak_mib']} MiB  "
              f"budget held {r['budget_held_pct']} %")
    for r in report["reduction"]:
        print(f"group {r['group']}: {r['ms']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_daf.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    return report


if __name__ == "__main__":
    main()
