"""DAF (quantized, bit-packed saved activations) on ResNet-50 224 px batch 4 and ResNet-18
224 px batch 8 (random weights, train-mode BN, every parameter trainable, entropy loss):
measured saved bytes and forward+backward time, one interleaved run, for

  dense       no codec (SavedActivationCounter)
  daf8 / daf4 every conv/linear input and BN input at 8 / 4 bits, ReLU masks exact
              (the default kernels: tta_kernels.native, the C passes)
  daf4_vec    daf4 with the vectorised PyTorch kernels (TTA_KERNELS_CPU=vectorised)
  daf4_ref    daf4 with the pure-PyTorch reference kernels (TTA_KERNELS_CPU=reference)
  daf4_compiled  daf4 with the torch.compile kernels (TTA_KERNELS_CPU=compiled)
  budgeted    greedy widths (tta_core.daf.plans.budget_plan) of the conv/linear inputs
              under a memory budget of --budget-frac x dense bytes, BN inputs at 4 bits;
              importance = RMS of each unit's gradient from one dense step; units given
              0 bits are frozen for the step
  importance_ablation  the budgeted widths from gradient statistics of the previous batch,
              uniform importance and the inverse ranking: gradient cosine with dense

Importance is gradient statistics (SURGEON Eq. 4), not AdaShadow's backprop-free KL: the
KL needs source statistics of trained weights, and these models are random.

Bytes include masks and per-group metadata (what the codec holds). As the runtime does,
freed memory stays in the heap (tta_core.runtime.malloc_tuning; --default-malloc: not), so
time ratios compare computation, not the page faults of dense steps. Also the kernel paths
(reference / vectorised [/ torch.compile with --compiled]) on one 4x256x56x56 tensor.
Usage: nice -n 19 python benchmarks/memory/bench_daf.py [--repeats 3] [--threads 1] [--quick]
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import torch
from bench_activation_memory import _entropy, _set_trainable, _step
from torch import nn
from torchvision.models import resnet18, resnet50
from tta_kernels import cpu, native, reference

from tta_core.daf.plans import budget_plan
from tta_core.memory import ActivationCodec, CodecPlan, SavedActivationCounter, profile_saves
from tta_core.memory.ledger import MIB
from tta_core.memory.widths import trainable_units
from tta_core.runtime.malloc_tuning import keep_freed_memory
from tta_core.surgeon.layer_importance import gradient_importance

Config = tuple[Callable[[], object], dict[str, str], list[str]]  # ctx, env, frozen units


def _importance(model: nn.Module, units: list[str]) -> dict[str, float]:
    """Gradient statistics (SURGEON Eq. 4) of each unit from the grads now in the model."""
    mods = dict(model.named_modules())
    return {u: gradient_importance([p.grad for p in mods[u].parameters(recurse=False)
                                    if p.grad is not None]) for u in units}


def _configs(model: nn.Module, x: torch.Tensor, frac: float) -> tuple[dict[str, Config], dict]:
    dense = SavedActivationCounter(model)
    _step(model, x, dense)
    units, _frozen = trainable_units(model)
    profile = profile_saves(model, x, _entropy)
    plan, alloc = budget_plan(profile, _importance(model, units), frac * dense.result.total,
                              norm_bits=4)
    zero = [u for u, b in alloc.bits.items() if b == 0]
    q = {b: CodecPlan(default_bits=b, norm_bits=b, narrow_ints=True) for b in (8, 4)}
    configs: dict[str, Config] = {
        "dense": (lambda: SavedActivationCounter(model), {}, []),
        "daf8": (lambda: ActivationCodec(model, q[8]), {}, []),
        "daf4": (lambda: ActivationCodec(model, q[4]), {}, []),
        "daf4_vec": (lambda: ActivationCodec(model, q[4]), {"TTA_KERNELS_CPU": "vectorised"},
                     []),
        "daf4_ref": (lambda: ActivationCodec(model, q[4]), {"TTA_KERNELS_CPU": "reference"}, []),
        "daf4_compiled": (lambda: ActivationCodec(model, q[4]), {"TTA_KERNELS_CPU": "compiled"},
                          []),
        "budgeted": (lambda: ActivationCodec(model, plan), {}, zero)}
    info = {"budget_mib": frac * dense.result.total / MIB, "value": alloc.value,
            "widths": dict(Counter(alloc.bits.values())), "units": len(units)}
    return configs, info


def _run(model: nn.Module, x: torch.Tensor, cfg: Config) -> tuple[float, object]:
    make, env, frozen = cfg
    mods = dict(model.named_modules())
    _set_trainable(model, False)
    for u in frozen:
        mods[u].requires_grad_(False)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return _step(model, x, make())
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_model(arch: str, px: int, batch: int, repeats: int, frac: float) -> dict:
    """Saved bytes per config, then round-robin timing (median)."""
    torch.manual_seed(0)
    model = (resnet18 if arch == "resnet18" else resnet50)(num_classes=1000).train()
    x = torch.randn(batch, 3, px, px)
    _set_trainable(model, False)
    configs, info = _configs(model, x, frac)
    rows = {}
    for name, cfg in configs.items():
        _run(model, x, cfg)  # warm-up
        res = _run(model, x, cfg)[1]
        rows[name] = {"saved_mib": res.total / MIB,
                      "by_role_mib": {k: round(v / MIB, 2) for k, v in res.by_role.items()}}
    times: dict[str, list[float]] = {n: [] for n in configs}
    for _ in range(repeats):
        for name, cfg in configs.items():
            times[name].append(_run(model, x, cfg)[0])
    dense_b = rows["dense"]["saved_mib"]
    for name, row in rows.items():  # ratios per round (drift cancels), then the median
        ratios = [t / d for t, d in zip(times[name], times["dense"], strict=True)]
        row["bytes_vs_dense"] = row["saved_mib"] / dense_b
        row["fwd_bwd_ms"] = 1e3 * statistics.median(times[name])
        row["time_vs_dense"] = statistics.median(ratios)
        row["time_vs_dense_rounds"] = [round(r, 3) for r in ratios]
    return {"arch": arch, "input": [batch, 3, px, px], "budgeted": info, "configs": rows,
            "importance_ablation": importance_ablation(model, x, frac)}


def _grad_vector(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, zeros where a frozen unit has none."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()]).double()


def importance_ablation(model: nn.Module, x: torch.Tensor, frac: float) -> dict:
    """Budgeted widths (budget_plan, frac x dense bytes) from three importance sources:
    gradient statistics (RMS per unit, SURGEON Eq. 4) of the *previous* batch (a second
    random batch: what a running node has), uniform, and the inverse of the gradient RMS
    (a wrong ranking); per source: the cosine of the step's gradient (units at 0 bits frozen,
    their gradient 0) with the dense gradient, the share of units kept, the saved MiB."""
    _set_trainable(model, False)  # every unit trainable (a timed config may have frozen some)
    units, _ = trainable_units(model)
    mods = dict(model.named_modules())
    dense = SavedActivationCounter(model)
    _step(model, x, dense)
    g_dense = _grad_vector(model)
    _step(model, torch.randn_like(x), SavedActivationCounter(model))  # the previous batch
    grad_imp = _importance(model, units)
    profile = profile_saves(model, x, _entropy)
    sources = {"gradient": grad_imp, "uniform": dict.fromkeys(units, 1.0),
               "inverse_gradient": {u: 1.0 / max(v, 1e-30) for u, v in grad_imp.items()}}
    out = {}
    for name, imp in sources.items():
        plan, alloc = budget_plan(profile, imp, frac * dense.result.total, norm_bits=4)
        _set_trainable(model, False)
        for u, b in alloc.bits.items():
            if b == 0:
                mods[u].requires_grad_(False)
        _, res = _step(model, x, ActivationCodec(model, plan))
        g = _grad_vector(model)
        out[name] = {"grad_cosine": round(float(g @ g_dense / (g.norm() * g_dense.norm())), 4),
                     "units_kept": round(sum(b > 0 for b in alloc.bits.values()) / len(units), 3),
                     "saved_mib": round(res.total / MIB, 2)}
    _set_trainable(model, False)
    return out


def _ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Fastest of `reps` calls of `fn` after one warm-up call, ms."""
    return harness.repeat(fn, reps).stats()["min"]


def bench_kernels(compiled: bool) -> dict:
    """ms per path for quantize+pack and unpack+dequantize of 4x256x56x56 floats."""
    x = torch.randn(4 * 256 * 56 * 56)
    paths = {"reference": (reference.quantize_pack, reference.unpack_dequantize),
             "vectorised": (cpu.quantize_pack, cpu.unpack_dequantize),
             "native": (native.quantize_pack, native.unpack_dequantize)}
    if compiled:
        paths["compiled"] = (cpu.quantize_pack_compiled, cpu.unpack_dequantize_compiled)
    out: dict = {"copy_ms": _ms(lambda: x.clone())}
    for name, (q, dq) in paths.items():
        for bits in (8, 4, 2):
            qt = q(x, bits, 128)
            out[f"{name}_{bits}"] = {"quantize_ms": _ms(lambda q=q, b=bits: q(x, b, 128)),
                                     "dequantize_ms": _ms(lambda dq=dq, b=bits, qt=qt:
                                                          dq(qt, b, 128, x.numel()))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget-frac", type=float, default=0.12)
    ap.add_argument("--quick", action="store_true", help="112 px, half the batch")
    ap.add_argument("--compiled", action="store_true", help="also time torch.compile kernels")
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's mmap of large blocks: dense steps then page-fault "
                         "their activations in every step, which DAF's small saves avoid")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kept = not args.default_malloc and keep_freed_memory()
    s = 2 if args.quick else 1
    result = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
              "keep_freed_memory": kept,
              "kernels": bench_kernels(args.compiled),
              "models": [bench_model(a, 224 // s, b // s, args.repeats, args.budget_frac)
                         for a, b in (("resnet50", 4), ("resnet18", 8))]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
