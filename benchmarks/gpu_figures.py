"""Memory and served-forward figures on one device (the GPU part of `gpu_check.sh`).

Per method, in one interleaved run on the same batches: the median step time, the bytes
autograd saved in the step's forward (the saved-tensor ledger: Tent's dense forward counted
by `SavedActivationCounter`, the codecs' own `saved_bytes`) and, on CUDA, the peak memory
allocated during the step above what was allocated before it (measured bytes). Then the
served forward (no grad) eager against `torch.compile` (CUDA graphs through
mode="reduce-overhead" on CUDA). Then serving (`--serving`): per model and batch size and
per precision, one interleaved run of source eager, source with CUDA graphs
(runtime.graphs), bn_adapt, tent, adashadow (default sigma) and adashadow parallel: the
median step ms (the answer's latency; work a method leaves for between batches, waited
for after the timing, is `between_ms`), the ratios to source eager and to source graphs,
the units updated (median), the share of batches adapted, the graphs captured, and at a
reduced precision the share of predictions equal to the fp32 run's. A method that does not
take a precision says so in its row (`skipped`). Writes `<out>/gpu_figures.json` and
`<out>/gpu_serving.md` and prints the tables.

    python benchmarks/gpu_figures.py --device cuda
    python benchmarks/gpu_figures.py --device cpu --arch resnet18 --image-size 32 \
        --batch-size 2 --batches 2 --no-compile --serving resnet18:32:2,card:32:2 \
        --precisions fp32,bf16 --serving-batches 1 --serving-warmup 1 --threads 1
                                                          # the CPU self-test
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import harness
import torch
from speed.bench_paper_ratios import ModelSpec

from tta_core.api import WarmsUp
from tta_core.errors import one_line
from tta_core.memory.accounting import SavedActivationCounter
from tta_core.model.source import load_source
from tta_core.model.zoo import build_model
from tta_core.registry import build_method
from tta_core.runtime.losses import entropy_loss
from tta_core.runtime.precision import check_precision

MIB = 2 ** 20
CARD = Path("checkpoints/small_resnet_signs32.json")  # "card" in --serving: the shipped net
SERVING = "resnet50:224:4,resnet50:224:32,resnet18:224:8,card:32:8"
SERVED = {  # label: (registered method, settings)
    "source eager": ("source", {"cuda_graphs": False}),
    "source graphs": ("source", {"cuda_graphs": True}),
    "bn_adapt": ("bn_adapt", {}),
    "tent": ("tent", {}),
    "adashadow": ("adashadow", {}),
    "adashadow parallel": ("adashadow", {"mode": "parallel"}),
}


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
    ms, res = harness.timed(lambda: method.step(x), device=device)
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
        with torch.no_grad():
            t = harness.repeat(lambda fn=fn: fn(x), batches, warmup=3, device=device)
        out[f"{name}_ms"] = round(t.median, 3)
    if "compiled_ms" in out:
        out["compiled_over_eager"] = round(out["compiled_ms"] / out["eager_ms"], 4)
    return out


# ---------------------------------------------------------------- serving
def parse_serving(text: str) -> list[tuple[str, int, int]]:
    """`arch:size:batch[,...]` (arch `card`: the shipped small net at its card's size),
    each entry as bench_paper_ratios.ModelSpec reads it."""
    specs = [ModelSpec.parse(t.strip()) for t in text.split(",") if t.strip()]
    return [(m.arch, m.image_size, m.batch_size) for m in specs]


def _served_model(arch: str, size: int, device: torch.device) -> tuple[torch.nn.Module, str]:
    """A fresh copy of the model (seeded random weights; `card`: the shipped net's) and the
    architecture name decomposition takes."""
    if arch == "card":
        model, card = load_source(CARD)
        if card.image_size != size:
            raise ValueError(f"--serving card:{size}: the shipped net takes "
                             f"{card.image_size} px")
        return model.to(device), card.arch
    torch.manual_seed(0)
    return build_model(arch, 10).to(device), arch


def _build_served(arch: str, size: int, device: torch.device, precision: str,
                  noise: torch.Tensor) -> tuple[dict, dict[str, str]]:
    """Every SERVED method at `precision` on its own copy of the model, in one memory
    format (the first one's "auto" choice), warmed up as a node does at start; and, for a
    method that cannot be built so, why."""
    methods, skipped, fmt = {}, {}, "auto"
    for label, (name, settings) in SERVED.items():
        model, arch_name = _served_model(arch, size, device)
        torch.manual_seed(0)
        try:
            methods[label] = build_method(name, model, input_shape=(3, size, size),
                                          arch=arch_name, memory_format=fmt,
                                          precision=precision, **settings)
        except ValueError as exc:  # e.g. a method whose forward does not take fp16
            skipped[label] = one_line(exc)
            continue
        fmt = methods[label].format.format
        if isinstance(methods[label], WarmsUp):
            methods[label].warm_up(noise)
    return methods, skipped


def serve_run(arch: str, size: int, batch: int, precision: str, batches: int, warmup: int,
              device: torch.device) -> dict:
    """One interleaved run at `precision`: per method its times, units, adapted share,
    graphs and predictions (the argmax per sample, to compare precisions)."""
    gen = torch.Generator().manual_seed(0)
    xs = [(torch.randn(batch, 3, size, size, generator=gen) * (1 + 0.3 * (i % 3)) + 0.2 * i
           ).to(device) for i in range(warmup + batches)]
    methods, skipped = _build_served(arch, size, device, precision, torch.randn_like(xs[0]))
    rec = {label: {"ms": [], "between": [], "units": [], "pred": []} for label in methods}

    def note(label: str, res, counted: bool) -> None:
        # the work left for between batches (parallel update, next plan), timed apart
        between, _ = harness.timed(methods[label].finish, device=device)
        if counted:
            r = rec[label]
            r["between"].append(between)
            r["units"].append(int(res.units_updated))
            r["pred"].append(res.logits.argmax(1).cpu())

    # every method steps each batch in turn, the order rotated per batch
    times = harness.round_robin({label: m.step for label, m in methods.items()},
                                warmup=warmup, inputs=xs, rotate=True, device=device,
                                on_result=note)
    for label, t in times.items():
        rec[label]["ms"] = t.ms
    rows = {label: _serve_row(r, methods[label]) for label, r in rec.items()}
    for method in methods.values():
        method.close()
    rows.update({label: {"skipped": why} for label, why in skipped.items()})
    return {"arch": arch, "image_size": size, "batch_size": batch, "precision": precision,
            "methods": {label: rows[label] for label in SERVED if label in rows}}


def _serve_row(r: dict, method) -> dict:
    units = r["units"]
    return {"step_ms": round(statistics.median(r["ms"]), 3),
            "between_ms": round(statistics.median(r["between"]), 3),
            "units_median": statistics.median(units),
            "adapted_share": round(sum(u > 0 for u in units) / len(units), 3),
            "graphs": method.graphs.stats(), "pred": torch.cat(r["pred"])}


def _ratios(run: dict, fp32: dict | None) -> None:
    """Ratios to source eager / graphs and agreement with the fp32 run, in place."""
    rows = run["methods"]
    base = {k: rows.get(k, {}).get("step_ms") for k in ("source eager", "source graphs")}
    for label, row in rows.items():
        if "skipped" in row:
            continue
        for key, ms in (("x_source_eager", base["source eager"]),
                        ("x_source_graphs", base["source graphs"])):
            row[key] = round(row["step_ms"] / ms, 3) if ms else None
        ref = (fp32 or {}).get("methods", {}).get(label, {}).get("pred")
        if ref is not None and run["precision"] != "fp32":
            row["agree_fp32"] = round(float((row["pred"] == ref).float().mean()), 4)


def serving_figures(specs: list[tuple[str, int, int]], precisions: list[str], batches: int,
                    warmup: int, device: torch.device) -> list[dict]:
    """serve_run per model spec and precision (fp32 first, the reference of agreement)."""
    runs = []
    for arch, size, batch in specs:
        done: dict[str, dict] = {}
        for precision in precisions:
            done[precision] = serve_run(arch, size, batch, precision, batches, warmup, device)
        for precision, run in done.items():
            _ratios(run, done.get("fp32") if precision != "fp32" else None)
        for run in done.values():
            for row in run["methods"].values():
                row.pop("pred", None)  # the predictions compared, not JSON
            runs.append(run)
    return runs


def serving_markdown(runs: list[dict], device_name: str) -> str:
    """The serving table: one row per model, precision and method."""
    lines = [f"Serving on {device_name}: median step ms (the answer), ratio to source eager "
             "and to source with CUDA graphs, units updated (median), batches adapted, "
             "graphs captured, predictions equal to fp32's.", "",
             "| model | precision | method | ms | x eager | x graphs | units | adapted | "
             "captures | = fp32 |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for run in runs:
        model = f"{run['arch']} {run['image_size']} px b{run['batch_size']}"
        for label, m in run["methods"].items():
            if "skipped" in m:
                lines.append(f"| {model} | {run['precision']} | {label} | skipped: "
                             f"{m['skipped']} |  |  |  |  |  |  |")
                continue
            agree = m.get("agree_fp32")
            lines.append(f"| {model} | {run['precision']} | {label} | {m['step_ms']:.2f} | "
                         f"{m['x_source_eager']} | {m['x_source_graphs']} | "
                         f"{m['units_median']:g} | {100 * m['adapted_share']:.0f} % | "
                         f"{m['graphs']['captures']} | "
                         f"{'' if agree is None else f'{100 * agree:.1f} %'} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--serving", default=SERVING, metavar="ARCH:SIZE:BATCH[,...]",
                    help=f"models of the serving table ('card': the shipped net; '' none; "
                         f"default {SERVING})")
    ap.add_argument("--precisions", default="fp32,fp16",
                    help="precisions of the serving table, comma-separated (fp16: CUDA only)")
    ap.add_argument("--serving-batches", type=int, default=8)
    ap.add_argument("--serving-warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="docs/results", help="folder for gpu_figures.json")
    return ap


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace
             ) -> tuple[torch.device, list, list[str]]:
    """The device, serving specs and precisions of the arguments (ap.error naming a bad one)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no CUDA device")
    if not 0 < args.budget_share <= 1:
        ap.error(f"--budget-share must be in (0, 1], got {args.budget_share}")
    if args.serving_batches < 1 or args.serving_warmup < 0:
        ap.error(f"--serving-batches {args.serving_batches} must be >= 1 and "
                 f"--serving-warmup {args.serving_warmup} >= 0")
    try:
        specs = parse_serving(args.serving)
        precisions = [check_precision(p.strip(), device)
                      for p in args.precisions.split(",") if p.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    return device, specs, sorted(set(precisions), key=precisions.index)


def main(argv: list[str] | None = None) -> dict:
    ap = _parser()
    args = ap.parse_args(argv)
    device, specs, precisions = _checked(ap, args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dims = (args.arch, args.image_size, args.batch_size, args.batches, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = {"device": name,
              "arch": args.arch, "image_size": args.image_size, "batch_size": args.batch_size,
              "memory": memory_figures(*dims, args.budget_share),
              "served_forward": served_forward(*dims, not args.no_compile)}
    for label, m in report["memory"].items():
        print(f"{label:20s} step {m['step_ms']:9.2f} ms  saved {m['saved_mib']} MiB "
              f"({m['saved_share_of_tent']} of Tent)  CUDA step peak {m['cuda_step_peak_mib']} MiB")
    print("served forward:", report["served_forward"])
    report["serving"] = serving_figures(specs, precisions, args.serving_batches,
                                        args.serving_warmup, device)
    table = serving_markdown(report["serving"], name) if specs else ""
    print(table, end="")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_figures.json").write_text(json.dumps(report, indent=1) + "\n")
        if table:
            (Path(args.out) / "gpu_serving.md").write_text(table)
    return report


if __name__ == "__main__":
    main()
