"""DARDA in real time: shift recall, false alarms, backward passes per true shift, and the
share of frames answered by their deadline on a stream at a camera rate.

The stream is `tta bench`'s (synthetic signs, continual order, the 15 corruptions at
severity 5, `--samples-per-domain` each; or `--data KIND:DIR`), cut into batches that never
straddle a domain change, so the true shift points are the batches whose domain label
differs from the previous batch's (tta_core.eval.shifts). Each darda variant steps through
it offline (every batch waited for): per batch its `stats["shift"]` (a shift perceived),
`stats["backward"]` and `stats["reason"]` are scored against the labels. Then every method
runs in streaming mode (`tta bench --stream-hz`'s `stream_method`: the node's keep-latest
queue, camera deadline at the rate) at each rate of `--hz`; the rate where bn_adapt still
answers >= 99 % of the frames is the one the acceptance reads DARDA at.

    python benchmarks/domains/bench_darda_realtime.py --batch-sizes 4,16 --hz 250,1000,2000,4000 \\
        [--card checkpoints/small_resnet_signs32.json] [--seeds 0,1] [--out FILE.json]

Variants: `darda` (the online-learnt domain bank), `darda@paper` (the paper's online phase
from `--bundle`, default the card's `<stem>_darda.safetensors` when it exists). `--set
M.KEY=VALUE` as `tta bench` (e.g. darda.gate_policy=stable: the gate before this
change). Prints one table per batch size and writes the figures to
`docs/results/<--stem>.json` and its page (`--stem`, default darda_realtime; `--out FILE`:
that JSON file instead, no page).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import results
import torch

from tta_core.eval.bench_config import BenchConfig, method_base, method_options
from tta_core.eval.bench_inputs import bench_inputs
from tta_core.eval.bench_stream import stream_method
from tta_core.eval.shifts import score_shifts
from tta_core.registry import build_method

ROOT = Path(__file__).resolve().parents[2]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", default=str(ROOT / "checkpoints" / "small_resnet_signs32.json"))
    ap.add_argument("--bundle", default="", help="the paper's bundle ('': the card's "
                    "<stem>_darda.safetensors if present; 'none': no paper variant)")
    ap.add_argument("--data", default="", help="tta bench --data KIND:DIR")
    ap.add_argument("--batch-sizes", default="4,16")
    ap.add_argument("--samples-per-domain", type=int, default=40)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--hz", default="", help="stream rates (comma list); '': offline only")
    ap.add_argument("--stream-methods", default="bn_adapt,darda,darda@paper,adashadow")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="streaming rounds: every method at a rate runs once per round, "
                    "methods and rates interleaved; the page shows the round with the "
                    "median answered share")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="streaming step times and darda's deadline decisions: wall time, "
                    "or the thread's CPU time (a shared machine: what the steps cost "
                    "without the neighbours' preemption; torch threads 1)")
    ap.add_argument("--set", action="append", default=[], metavar="M.KEY=VALUE")
    ap.add_argument("--out", default="", help="write the JSON here instead of the page")
    ap.add_argument("--stem", default="darda_realtime", help="results page (docs/results)")
    return ap.parse_args()


def _value(raw: str) -> Any:
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def overrides(sets: list[str], bundle: str) -> dict[str, dict[str, Any]]:
    """Per-method options: --set values, the paper variant's bundle."""
    out: dict[str, dict[str, Any]] = {}
    for item in sets:
        key, _, raw = item.partition("=")
        name, _, field = key.partition(".")
        out.setdefault(name, {})[field] = _value(raw)
    if bundle:
        out.setdefault("darda@paper", {}).setdefault("bundle_path", bundle)
    return out


def perceived_shift(stats: dict) -> bool:
    """A batch's perceived shift (`shift`; code without it: a domain switch, `switched`)."""
    return bool(stats.get("shift", stats.get("switched", False)))


def offline(name: str, cfg: BenchConfig, fresh, stream) -> dict[str, Any]:
    """One variant over the stream, every batch waited for: its shift score and accuracy."""
    torch.manual_seed(cfg.seed)
    meth = build_method(method_base(name), fresh(),
                        **method_options(name, cfg, tuple(stream[0].x.shape[1:])))
    perceived, backward, reasons, right, n, ms = [], [], [], 0, 0, []
    for b in stream:
        step_ms, res = harness.timed(lambda b=b: meth.step(b.x))
        ms.append(step_ms)
        perceived.append(perceived_shift(res.stats))
        backward.append(bool(res.adapted))
        reasons.append(str(res.stats.get("reason", "")))
        right += int((res.logits.argmax(1).cpu().numpy() == b.labels).sum())
        n += len(b.labels)
    meth.close()
    score = score_shifts([b.domain for b in stream], perceived, backward, reasons)
    ms.sort()
    return {**score.to_dict(), "accuracy": right / n, "step_ms_p50": ms[len(ms) // 2],
            "deferred": getattr(meth, "deferred", 0), "skipped": getattr(meth, "skipped", 0)}


def streaming(name: str, cfg: BenchConfig, fresh, stream, hz: float) -> dict[str, Any]:
    """One method in streaming mode at `hz`: answered / strict shares, deadline met and,
    for darda, its backward passes and shifts on the batches the schedule formed."""
    seen: list[tuple[bool, bool, str]] = []
    plain = [0]

    def note(res: Any) -> None:
        seen.append((perceived_shift(res.stats), bool(res.adapted),
                     str(res.stats.get("reason", ""))))
        plain[0] += bool(res.stats.get("undetected") or res.stats.get("plain"))

    r = stream_method(name, fresh(), stream, cfg, hz, on_step=note)
    s = r.summary
    out = {"hz": hz, "answered": s.answered, "strict": s.strict, "dropped": s.dropped,
           "deadline_met": s.deadline_met, "batches": s.batches,
           "backward": sum(a for _, a, _ in seen),
           "reasons": {k: sum(1 for _, a, why in seen if a and why == k)
                       for k in sorted({why for _, a, why in seen if a})}}
    if method_base(name) == "darda":
        out["perceived"] = sum(p for p, _, _ in seen)
        out["detected_share"] = 1.0 - plain[0] / max(len(seen), 1)
    return out


def _stream_one(cfg: BenchConfig, fresh, stream, name: str, hz: float) -> dict[str, Any]:
    return streaming(name, cfg, fresh, stream, hz)


def interleaved(methods: list[str], rates: list[float], rounds: int,
                run: Callable[[str, float], dict[str, Any]]) -> dict[str, list[dict]]:
    """Every method at every rate, `rounds` times, in the order round > rate > method (so
    the methods compared at a rate ran minutes, not a whole sweep, apart on a shared
    machine); per method and rate the round with the median answered share, with every
    round's share in `answered_rounds`."""
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    seen: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for h in rates:
            for m in methods:
                seen.setdefault((m, h), []).append(run(m, h))
    out: dict[str, list[dict]] = {}
    for m in methods:
        for h in rates:
            rows = sorted(seen[(m, h)], key=lambda r: r["answered"])
            pick = dict(rows[(len(rows) - 1) // 2])
            pick["answered_rounds"] = [r["answered"] for r in seen[(m, h)]]
            out.setdefault(m, []).append(pick)
    return out


def reference_rates(streams: dict[str, list[dict]], base: list[dict]) -> dict[str, Any]:
    """The rates DARDA is read at: the highest where bn_adapt answers >= 99 % in its
    median round (`bn_adapt_max_hz`) and in every round (`bn_adapt_sustained_hz`: the
    rate it keeps up with on this machine, not the edge where timing noise decides), with
    each method's worst round at the sustained rate."""
    med = [r["hz"] for r in base if r["answered"] >= 0.99]
    every = [r["hz"] for r in base if min(r.get("answered_rounds", [r["answered"]])) >= 0.99]
    out: dict[str, Any] = {"bn_adapt_max_hz": max(med) if med else None,
                           "bn_adapt_sustained_hz": max(every) if every else None}
    if every:
        hz = max(every)
        out["worst_at_sustained"] = {
            m: min(r.get("answered_rounds", [r["answered"]]))
            for m, rows in streams.items() for r in rows if r["hz"] == hz}
    return out


def fmt(v: float, spec: str = ".1f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def use_cpu_clock() -> None:
    """Step times and darda's deadline decisions on the thread's CPU time."""
    import tta_core.eval.bench_stream as bench_module
    from tta_core.darda.method import Darda
    from tta_core.eval.streaming import timed_step

    thread = harness.CLOCKS["thread"]
    bench_module.timed_step = lambda run, clock=thread: timed_step(run, clock)
    Darda.clock = staticmethod(thread)


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    if a.clock == "cpu":
        use_cpu_clock()
    bundle = a.bundle
    if not bundle:
        guess = Path(a.card).with_name(f"{Path(a.card).stem}_darda.safetensors")
        bundle = str(guess) if guess.is_file() else ""
    bundle = "" if bundle == "none" else bundle
    opts = overrides(a.set, bundle)
    variants = ["darda", *(["darda@paper"] if bundle else [])]
    stream_methods = [m for m in a.stream_methods.split(",") if m and
                      (m != "darda@paper" or bundle)]
    rates = [float(h) for h in a.hz.split(",") if h]
    report: dict[str, Any] = {"card": _rel(a.card), "bundle": _rel(bundle), "data": a.data,
                              "clock": a.clock, "threads": a.threads,
                              "samples_per_domain": a.samples_per_domain, "options": opts,
                              "rounds": a.rounds,
                              "runs": []}
    for bs in (int(b) for b in a.batch_sizes.split(",")):
        for seed in (int(s) for s in a.seeds.split(",")):
            cfg = BenchConfig(methods=tuple(dict.fromkeys(variants + stream_methods)),
                              batch_size=bs, samples_per_domain=a.samples_per_domain,
                              model_card=Path(a.card), seed=seed, threads=a.threads,
                              data=a.data, method_options=opts)
            _, fresh, stream = bench_inputs(cfg)
            run: dict[str, Any] = {"batch_size": bs, "seed": seed, "batches": len(stream),
                                   "offline": {}, "streaming": {}}
            for v in variants:
                run["offline"][v] = offline(v, replace(cfg), fresh, stream)
            run["streaming"] = interleaved(stream_methods, rates, a.rounds,
                                           functools.partial(_stream_one, cfg, fresh, stream))
            base = run["streaming"].get("bn_adapt")
            if base:
                run |= reference_rates(run["streaming"], base)
            print(render_run(run, rates))
            report["runs"].append(run)
    report["hz"] = rates
    if a.out:
        Path(a.out).write_text(results.dumps(report))
        print(f"\nwrote {a.out}")
    else:
        print(f"\nwrote {harness.save(a.stem, report, options=a)}")


def _rel(path: str) -> str:
    """`path` relative to the checkout when inside it (pages name no machine's folders)."""
    if not path:
        return path
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else path


def render_run(run: dict, rates: list[float]) -> str:
    """One batch size and seed: the offline shift scores per variant, the answered share
    per stream method and rate."""
    lines = [f"## batch {run['batch_size']}, seed {run['seed']}: {run['batches']} batches",
             "", "| variant | recall % | missed | false alarms | perceived | backward % of "
             "batches | backward per true shift | reasons | deferred | accuracy % | "
             "step ms p50 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v, o in run["offline"].items():
        lines.append(
            f"| {v} | {fmt(100 * o['recall'])} ({o['detected']}/{o['true_shifts']}) | "
            f"{', '.join(o['missed']) or '–'} | {o['false_alarms']} | {o['perceived']} | "
            f"{fmt(100 * o['backward_share'])} | {fmt(o['backward_per_shift'], '.2f')} | "
            f"{', '.join(f'{k} {c}' for k, c in o['reasons'].items()) or '–'} | "
            f"{o['deferred']} | {fmt(100 * o['accuracy'])} | {fmt(o['step_ms_p50'], '.2f')} |")
    if run["streaming"]:
        lines += ["", "Answered % by the deadline (backward passes; darda: batches with "
                  "detection %):", "", "| method | " + " | ".join(f"{h:g} Hz" for h in rates)
                  + " |", "|---|" + "---|" * len(rates)]
        for m, rows in run["streaming"].items():
            lines.append(f"| {m} | " + " | ".join(
                f"{fmt(100 * r['answered'])} ({r['backward']}"
                + (f"; {fmt(100 * r['detected_share'], '.0f')}" if "detected_share" in r
                   else "") + ")" for r in rows) + " |")
    if "bn_adapt_max_hz" in run:
        lines += ["", f"Highest rate where bn_adapt answers >= 99 % (median round): "
                  f"{fmt(run['bn_adapt_max_hz'], 'g')} Hz."]
    base = run["streaming"].get("bn_adapt")
    ref = reference_rates(run["streaming"], base) if base else {}
    if ref.get("bn_adapt_sustained_hz") is not None:
        run = {**run, **ref}
        worst = run.get("worst_at_sustained", {})
        lines += ["", f"Highest rate where bn_adapt answers >= 99 % in every round: "
                  f"{fmt(run['bn_adapt_sustained_hz'], 'g')} Hz; there, the worst round of "
                  "each method answers " + ", ".join(
                      f"{m} {fmt(100 * v)} %" for m, v in worst.items()) + "."]
    return "\n".join(lines) + "\n"


def render(data: dict) -> str:
    """The results page: the settings, then every batch size and seed."""
    head = (f"Card `{data['card']}`, paper bundle `{data['bundle'] or 'none'}`, data "
            f"`{data['data'] or 'synthetic signs'}`, {data['samples_per_domain']} samples "
            f"per domain, {data['threads']} thread(s), {data['clock']} clock, "
            f"{data.get('rounds', 1)} streaming round(s) (methods and rates interleaved; "
            f"the median round shown). Recall: true "
            f"shifts (a batch whose domain differs from the previous one's) perceived; "
            f"backward per true shift: backward passes over true shifts.\n")
    return head + "\n" + "\n".join(render_run(r, data.get("hz", [])) for r in data["runs"])


if __name__ == "__main__":
    main()
