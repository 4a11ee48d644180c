"""DAF kernels: the fused CPU quantize + pack (one read of each group: min/max, scales,
codes; tta_kernels.native.quantize_pack) against today's two-pass form (PyTorch amin and
amax, then the C quantize pass: native.quantize_pack_two_pass), on a post-ReLU tensor of
--n floats, 1 thread, 2/4/8 bits, group 128. Also the ReLU-output case (1-bit mask + the
next conv's quantized input): mask_pack + two-pass against the fused mask variant, and the
vectorised PyTorch path for scale. Every case is checked bit-identical to the reference
before it is timed; repetitions run round-robin (each round times every case once), ratios
are per-round medians.

With CUDA: the Triton kernels against native torch on the GPU (the reference's torch ops,
and amin/amax against the hybrid tree + compare-and-swap reduction), same protocol.

Usage: python benchmarks/speed/bench_kernels.py [--n 3200000] [--repeats 21] [--device cpu|cuda]
       [--out docs/results] [--quick | --dry-run]
Prints JSON; writes OUT/kernels.{json,md} (not with --quick). benchmarks/gpu_check.sh runs
it with --device cuda on a GPU and with --dry-run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import results
import torch
from tta_kernels import cpu, native, reference

OUT = Path(__file__).resolve().parents[2] / "docs" / "results"
GROUP = 128
RELU = (0.0, float("inf"))
Case = Callable[[], object]


def _cpu_cases(x: torch.Tensor, bits: int) -> dict[str, Case]:
    return {
        "two_pass": lambda: native.quantize_pack_two_pass(x, bits, GROUP),
        "fused": lambda: native.quantize_pack(x, bits, GROUP),
        "vectorised": lambda: cpu.quantize_pack(x, bits, GROUP),
        "mask+two_pass": lambda: (native.mask_pack(x, *RELU),
                                  native.quantize_pack_two_pass(x, bits, GROUP)),
        "fused_mask": lambda: native.quantize_pack_mask(x, bits, GROUP, RELU),
    }


def _check_cpu(x: torch.Tensor, bits: int) -> None:
    """Every CPU case gives the reference's bytes (and mask) before it is timed."""
    ref = reference.quantize_pack(x, bits, GROUP)
    mask = reference.mask_bits(x, RELU)
    for qt in (native.quantize_pack(x, bits, GROUP), native.quantize_pack_two_pass(
            x, bits, GROUP), cpu.quantize_pack(x, bits, GROUP)):
        assert all(torch.equal(a, b) for a, b in zip(ref, qt, strict=True))
    qt, got = native.quantize_pack_mask(x, bits, GROUP, RELU)
    assert torch.equal(got, mask) and torch.equal(native.mask_pack(x, *RELU), mask)
    assert all(torch.equal(a, b) for a, b in zip(ref, qt, strict=True))


def round_robin(cases: dict[str, Case], repeats: int, device: str | None = None
                ) -> dict[str, list[float]]:
    """ms per call of each case, `repeats` rounds, every case once per round (after one
    untimed warm-up round; harness.round_robin)."""
    return {k: t.ms for k, t in harness.round_robin(cases, repeats, device=device).items()}


def _ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """Median over rounds of slow / fast (both measured in the same round)."""
    return round(statistics.median(a / b for a, b in zip(times[slow], times[fast],
                                                          strict=True)), 3)


def _best_ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """min(slow) / min(fast): on a loaded machine the fastest round is the one least
    disturbed by other processes (a longer call is preempted more often)."""
    return round(min(times[slow]) / min(times[fast]), 3)


def cpu_rows(n: int, repeats: int) -> list[dict]:
    """One row per width: median ms per case and the per-round ratios."""
    torch.set_num_threads(1)
    x = torch.relu(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    rows = []
    for bits in (2, 4, 8):
        _check_cpu(x, bits)
        t = round_robin(_cpu_cases(x, bits), repeats)
        rows.append({"bits": bits, "ms": {k: round(statistics.median(v), 3)
                                          for k, v in t.items()},
                     "ms_min": {k: round(min(v), 3) for k, v in t.items()},
                     "fused_speedup": _ratio(t, "two_pass", "fused"),
                     "fused_speedup_min": _best_ratio(t, "two_pass", "fused"),
                     "fused_mask_speedup": _ratio(t, "mask+two_pass", "fused_mask"),
                     "fused_mask_speedup_min": _best_ratio(t, "mask+two_pass", "fused_mask"),
                     "fused_vs_vectorised": _ratio(t, "vectorised", "fused")})
    return rows


def cuda_rows(n: int, repeats: int) -> list[dict]:
    """Triton against native torch on the GPU."""
    from tta_kernels import triton_kernels as tk

    x = torch.relu(torch.randn(n, device="cuda"))
    rows = []
    for bits in (2, 4, 8):
        ref = reference.quantize_pack(x.cpu(), bits, GROUP)
        got = tk.quantize_pack(x, bits, GROUP)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(ref, got, strict=True))
        cases: dict[str, Case] = {
            "torch_reference": lambda b=bits: reference.quantize_pack(x, b, GROUP),
            "torch_vectorised": lambda b=bits: cpu.quantize_pack(x, b, GROUP),
            "triton_fused": lambda b=bits: tk.quantize_pack(x, b, GROUP),
            "triton_hybrid": lambda b=bits: tk.quantize_pack(x, b, GROUP, hybrid=True),
        }
        t = round_robin(cases, repeats, "cuda")
        rows.append({"bits": bits, "ms": {k: round(statistics.median(v), 4)
                                          for k, v in t.items()},
                     "triton_vs_torch": _ratio(t, "torch_vectorised", "triton_fused")})
    g = x.view(-1)
    t = round_robin({"amin_amax": lambda: (g.amin(), g.amax()),
                     "hybrid_minmax": lambda: tk.group_minmax(g, g.numel())}, repeats, "cuda")
    rows.append({"tensor_minmax_ms": {k: round(statistics.median(v), 4) for k, v in t.items()},
                 "hybrid_vs_torch": _ratio(t, "amin_amax", "hybrid_minmax")})
    return rows


def markdown(res: dict) -> str:
    """The small table of docs/results/kernels.md: median ms (min ms) per case, speedups as
    the per-round median ratio (ratio of the minima)."""
    lines = [f"n = {res['n']} post-ReLU float32, group {GROUP}, 1 thread, {res['repeats']} "
             f"round-robin rounds, {res['cpu']}, load average {res['load_avg']:.1f}; "
             "median ms (min ms); speedup: median of per-round ratios (ratio of minima)",
             "", "| bits | two-pass | fused | speedup | mask + two-pass | fused mask | speedup |"
             " vectorised |", "|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, k: str) -> str:
        return f"{r['ms'][k]} ({r['ms_min'][k]})"

    for r in res["cpu_rows"]:
        lines.append(
            f"| {r['bits']} | {cell(r, 'two_pass')} | {cell(r, 'fused')} | "
            f"{r['fused_speedup']}x ({r['fused_speedup_min']}x) | {cell(r, 'mask+two_pass')} | "
            f"{cell(r, 'fused_mask')} | {r['fused_mask_speedup']}x "
            f"({r['fused_mask_speedup_min']}x) | {cell(r, 'vectorised')} |")
    if res["cuda_rows"]:
        lines += ["", "CUDA (Triton vs torch):", "", "```", json.dumps(res["cuda_rows"]),
                  "```"]
    else:
        lines += ["", "CUDA: not measured (--device cpu)."]
    return "\n".join(lines) + "\n"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3_200_000)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="cuda adds the Triton rows (default: cuda when available)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of kernels.{json,md}")
    ap.add_argument("--quick", action="store_true", help="5 rounds, no files written")
    ap.add_argument("--dry-run", action="store_true",
                    help="the code paths at 65536 floats, 3 rounds (files still written)")
    args = ap.parse_args()
    if args.n < GROUP or args.repeats < 1:
        raise SystemExit(f"--n must be >= {GROUP} and --repeats >= 1, got {args.n}, "
                         f"{args.repeats}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.dry_run:
        args.n, args.repeats = 65536, 3
    elif args.quick:
        args.repeats = 5
    return args


def main() -> None:
    args = _args()
    res = {"n": args.n, "repeats": args.repeats, "cpu": results.cpu_model(),
           "torch": torch.__version__, "device": args.device,
           "load_avg": os.getloadavg()[0], "cpu_rows": cpu_rows(args.n, args.repeats),
           "cuda_rows": cuda_rows(args.n, args.repeats) if args.device == "cuda" else []}
    print(json.dumps(res, indent=1))
    if not args.quick:
        harness.save("kernels", res, options=args, out=args.out)


if __name__ == "__main__":
    main()
