"""ElasticDNN "Updating master DNN" ablation (§IV, paper: -11.33 / -6.62 points without it) on
a continual multi-domain stream, and the peak memory of one master update.

Stream: synthetic signs under `--domains` ImageNet-C corruptions at severity 5, each visited
`--visits` times in the same order (tta_core.data.streams, order "recurring"), batch 16.
Per domain visit (the shift is known: oracle boundaries), as the collaborative trainer runs:
  1. the master (sparsity 0, BN on the batch's statistics, no update) answers the visit's
     first batch: its accuracy there is the "master at first batch" figure;
  2. a surrogate keeping `--keep` of every gated conv's filters is cut from the batch's
     highest-entropy sample (§III-B2), its filters holding `--mass` of the BN-gradient
     score chosen (§III-B3 step 1-2), and it adapts on every batch of the visit (SHOT's
     information maximisation, SGD momentum 0.9), each batch predicted before its update;
  3. at the end of the visit the master is updated by `master_update`:
     knowledge  (Eq. 3 then Eq. 4 through Θ*, layer by layer: the paper),
     averaging  (master += (surrogate - origin) / 2: the authors' group's code),
     none       (the master never changes).
Printed and written to docs/results/elastic_knowledge_<card>.{json,md} and plots
(`_per_domain.png`: surrogate accuracy per visit; `_master.png`: the master's accuracy at
each visit's first batch and over the visit, the accumulation learning curve).

Memory: peak bytes allocated by one master update (torch profiler allocation events,
cumulative, from the surrogate of the last visit), knowledge layer by layer vs all layers'
changes held at once vs averaging; and Θ*'s resident size.

Per visit also: the surrogate on the visit's images before / after its own updates, the
master on them before / after the update, ‖Δθ‖/‖θ‖ of the changed conv and BN tensors, and
the master after the update on every seen domain's first-visit images (the per-domain
learning curves, `_learning_curve.png`). Variants: `--epochs` passes over each visit (the
retraining window), `--share` K < N (Θ* refitted, the master's filters rewritten at rank
K), `--gauge orthonormal` (the card's relevances re-gauged orthonormal: the same master and
tie, Eqs. 3-4 a projection instead of the trained spread), `--master-bn keep` (write_back's
BN affine kept), `--seed`. The column "outside / at" is how far Eq. 4 moves the master's
conv entries the surrogate did not change / did, over the surrogate's change (0 / 1 for
the identity update of orthonormal K = N relevances, 0 / 0.5 for averaging).

Usage: python benchmarks/domains/bench_elastic_knowledge.py [--card C] [--domains 8] [--visits 2]
           [--samples-per-domain 128] [--epochs 1] [--share S] [--master-bn change]
           [--seed 0] [--threads 1]
  small card, 3 visits, 2 seeds:
    for s in 0 1; do python benchmarks/domains/bench_elastic_knowledge.py --card \
        checkpoints/small_resnet_signs32_elastic.json --visits 3 --seed $s \
        --partial /tmp/ek_s$s.json; done
    python benchmarks/domains/bench_elastic_knowledge.py --merge /tmp/ek_s0.json,/tmp/ek_s1.json
  one mode per process (each under 10 min on the r18 card), then merged:
    for m in knowledge averaging none; do python benchmarks/domains/bench_elastic_knowledge.py \
        --samples-per-domain 64 --modes $m --partial /tmp/ek_$m.json; done
    python benchmarks/domains/bench_elastic_knowledge.py --merge /tmp/ek_knowledge.json,\
        /tmp/ek_averaging.json,/tmp/ek_none.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import results
import torch
from torch import Tensor

from tta_core.data import streams
from tta_core.data.corruptions import CORRUPTIONS
from tta_core.elasticdnn.filter_update import (
    MASTER_BN,
    _deltas,
    filter_optimizer,
    filter_scores,
    im_loss,
    mask_gradients,
    select_filters,
    write_back,
)
from tta_core.elasticdnn.gates import GatedModel, load_gated
from tta_core.elasticdnn.knowledge import attach_knowledge, require_knowledge
from tta_core.elasticdnn.surrogate import Surrogate, extract_surrogate, highest_entropy_sample
from tta_core.eval.bench_inputs import batches_from_arrays, images_to_input
from tta_core.model.source import load_card

CARD = Path("checkpoints/resnet18_cifar_w32_signs64_elastic.json")
MODES = ("knowledge", "averaging", "none")
OUT = Path("docs/results")


@dataclass
class Visit:
    """One visit of one domain: the master's first-batch and the surrogate's accuracy."""

    domain: str
    visit: int
    master_first: float
    master_visit: float  # the master (no update) over the whole visit, before it adapts
    master_probe: float  # the same, on the images of the domain's first visit
    surrogate: float
    images: int
    surrogate_before: float = float("nan")  # fresh surrogate on the visit, before updating
    surrogate_after: float = float("nan")  # the same images after its updates (no update)
    master_after: float = float("nan")  # the master after this visit's update, same images
    delta_conv: float = float("nan")  # ‖Δθ‖ / ‖θ‖ over the conv tensors the surrogate changed
    delta_bn: float = float("nan")  # the same over the BN affine tensors (master's format)
    # the master's conv change (Eq. 4 rewrites whole layers) outside / at the entries the
    # surrogate changed, over the norm of the surrogate's conv change (identity: 0 / 1)
    spread_out: float = float("nan")
    spread_in: float = float("nan")
    # the master after this visit's update on each seen domain's first-visit images
    seen: dict[str, float] = field(default_factory=dict)


@dataclass
class ModeRun:
    """One master-update mode over the stream."""

    mode: str
    visits: list[Visit] = field(default_factory=list)
    accuracy: float = 0.0  # surrogate, all images
    seconds: float = 0.0
    seed: int = 0


def segments(card_path: Path, domains: int, visits: int, n: int, batch: int, seed: int = 0
             ) -> list[tuple[str, list[tuple[Tensor, Tensor]]]]:
    """The recurring stream cut into domain visits: (domain, [(x, y) batches])."""
    card = load_card(card_path)
    spec = streams.StreamSpec(order="recurring", severity=5, samples_per_domain=n,
                              image_size=card.image_size, num_classes=card.num_classes,
                              corruptions=CORRUPTIONS[:domains], recurrences=visits,
                              seed=seed)
    stream = streams.build_stream(spec)
    x = images_to_input(stream.images, card, "cpu")
    out: list[tuple[str, list[tuple[Tensor, Tensor]]]] = []
    for b in batches_from_arrays(x, stream.labels, stream.domains.tolist(), batch):
        dom = str(b.domain)
        y = torch.as_tensor(b.labels)
        if not out or out[-1][0] != dom or len(out[-1][1]) * batch >= n:
            out.append((dom, []))
        out[-1][1].append((b.x, y))
    return out


def master_accuracy(master: GatedModel, x: Tensor, y: Tensor) -> float:
    """Accuracy of the full master with BN on the batch's statistics (buffers restored)."""
    return batch_stat_accuracy(master, [(x, y)])


@torch.no_grad()
def batch_stat_accuracy(model: torch.nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Accuracy of `model` over `batches`, BN on each batch's statistics, nothing kept."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    was, hits, total = model.training, 0, 0
    model.train()
    for x, y in batches:
        hits += int((model(x).argmax(1) == y).sum())
        total += len(y)
    model.train(was)
    for n, b in model.named_buffers():
        b.copy_(buffers[n])
    return hits / total


def adapt_visit(master: GatedModel, batches: list[tuple[Tensor, Tensor]], keep: float,
                mass: float, lr: float, epochs: int = 1) -> tuple[Surrogate, int, float, float]:
    """Cut, select filters and adapt a surrogate over one visit, `epochs` passes (the
    retraining window; the first pass predicts each batch before its update);
    (surrogate, first-pass hits, its accuracy on the visit before / after updating)."""
    x0 = batches[0][0]
    sur = extract_surrogate(master, highest_entropy_sample(master, x0), keep)
    before = batch_stat_accuracy(sur.model, batches)
    sur.model.train()
    mask_gradients(sur, select_filters(filter_scores(sur, x0), mass))
    opt = filter_optimizer(sur, lr)
    hits = 0
    for epoch in range(epochs):
        for x, y in batches:
            logits = sur.model(x)
            hits += int((logits.argmax(1) == y).sum()) if epoch == 0 else 0
            opt.zero_grad(set_to_none=True)
            im_loss(logits).backward()
            opt.step()
    return sur, hits, before, batch_stat_accuracy(sur.model, batches)


@torch.no_grad()
def delta_norms(master: GatedModel, sur: Surrogate) -> tuple[float, float]:
    """‖Δθ‖ / ‖θ‖ of the surrogate's change in the master's format, over the conv tensors
    and over the BN affine tensors it changed (the master's values at those entries)."""
    target = dict(master.base.named_parameters())
    sums = {4: [0.0, 0.0], 1: [0.0, 0.0]}
    for name, r, c, delta in _deltas(master, sur):
        if name not in target or delta.ndim not in sums:
            continue
        ref = target[name]
        ref = ref[r] if r is not None else ref
        ref = ref[:, c] if c is not None else ref
        sums[delta.ndim][0] += float(delta.double().pow(2).sum())
        sums[delta.ndim][1] += float(ref.double().pow(2).sum())
    return tuple(math.sqrt(a / b) if b else 0.0 for a, b in (sums[4], sums[1]))


@torch.no_grad()
def spread(before: GatedModel, after: GatedModel, sur: Surrogate) -> tuple[float, float]:
    """(‖master change outside the surrogate's changed conv entries‖, ‖at them‖), each over
    ‖the surrogate's conv change‖ in the master's format (Visit.spread_out / spread_in)."""
    was, now = dict(before.base.named_parameters()), dict(after.base.named_parameters())
    out_sq = in_sq = delta_sq = 0.0
    for name, r, c, delta in _deltas(before, sur):
        if name not in was or delta.ndim != 4:
            continue
        full = torch.zeros_like(was[name], dtype=torch.float64)
        rows = r if r is not None else torch.arange(len(full))
        if c is None:
            full[rows] = delta.double()
        else:
            full[rows[:, None], c[None, :]] = delta.double()
        touched, moved = full != 0, (now[name] - was[name]).double()
        out_sq += float(moved[~touched].pow(2).sum())
        in_sq += float(moved[touched].pow(2).sum())
        delta_sq += float(full.pow(2).sum())
    if delta_sq == 0:
        return 0.0, 0.0
    return math.sqrt(out_sq / delta_sq), math.sqrt(in_sq / delta_sq)


def run_mode(master0: GatedModel, segs: list, mode: str, keep: float, mass: float,
             lr: float, epochs: int = 1, seed: int = 0, master_bn: str = "change"
             ) -> tuple[ModeRun, Surrogate, GatedModel]:
    """One mode over the stream (module doc); also the last surrogate and the master it
    was cut from, for the memory measurement."""
    master = copy.deepcopy(master0).eval()
    run, seen, hits, total = ModeRun(mode, seed=seed), {}, 0, 0
    probes: dict[str, list[tuple[Tensor, Tensor]]] = {}
    clock = harness.Stopwatch().start()
    before = master
    for dom, batches in segs:
        seen[dom] = seen.get(dom, 0) + 1
        first = master_accuracy(master, *batches[0])
        whole = batch_stat_accuracy(master, batches)
        probe = probes.setdefault(dom, batches)
        same = whole if probe is batches else batch_stat_accuracy(master, probe)
        before = copy.deepcopy(master)
        sur, h, s0, s1 = adapt_visit(master, batches, keep, mass, lr, epochs)
        n = sum(len(y) for _, y in batches)
        dconv, dbn = delta_norms(master, sur)
        write_back(master, sur, mode, master_bn)
        after = {d: batch_stat_accuracy(master, p) for d, p in probes.items()}
        out, own = spread(before, master, sur)
        run.visits.append(Visit(dom, seen[dom], first, whole, same, h / n, n, s0, s1,
                                batch_stat_accuracy(master, batches), dconv, dbn, out, own,
                                after))
        hits, total = hits + h, total + n
        print(f"  {mode:<9} {dom:<18} visit {seen[dom]}  master@first {100 * first:5.1f}%  "
              f"surrogate {100 * h / n:5.1f}% ({100 * s0:5.1f} -> {100 * s1:5.1f})  master "
              f"{100 * whole:5.1f} -> {100 * run.visits[-1].master_after:5.1f}%  "
              f"|dθ|/|θ| {dconv:.4f}  spread out/in {out:.3f}/{own:.3f}", flush=True)
    run.accuracy, run.seconds = hits / total, clock.lap_s()
    return run, sur, before


def peak_bytes(fn) -> int:
    """Peak of the bytes `fn()` allocates and still holds, from the profiler's CPU
    allocation events in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    cur = peak = 0
    for e in events:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


@torch.no_grad()
def knowledge_all_at_once(master: GatedModel, sur: Surrogate) -> None:
    """Eqs. 3-4 with every layer's change built first (what layer by layer avoids)."""
    kn = require_knowledge(master)
    target = dict(master.base.named_parameters())
    fulls = {}
    for name, r, c, delta in _deltas(master, sur):
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in kn.layers:
            full = torch.zeros_like(target[name])
            rr = r if r is not None else torch.arange(full.shape[0])
            if c is None:
                full[rr] = delta
            else:
                full[rr[:, None], c[None, :]] = delta
            fulls[module] = full
    for module, full in fulls.items():
        kn.store(module, full)
    for module in fulls:
        kn.recall(module, target[f"{module}.weight"])


def memory_rows(master: GatedModel, sur: Surrogate) -> dict[str, int]:
    """Peak bytes of one master update per way (module doc), plus Θ*'s and the base's
    resident sizes."""
    ways = {"knowledge, layer by layer (Eqs. 3-4)": lambda m: write_back(m, sur, "knowledge"),
            "knowledge, all layers at once": lambda m: knowledge_all_at_once(m, sur),
            "averaging write-back": lambda m: write_back(m, sur, "averaging")}
    rows = {}
    for name, fn in ways.items():
        m = copy.deepcopy(master)
        rows[name] = peak_bytes(lambda fn=fn, m=m: fn(m))
    kn = require_knowledge(master)
    rows["resident: Θ* + relevances"] = sum(p.numel() * p.element_size()
                                            for p in kn.parameters())
    rows["resident: master base weights"] = sum(p.numel() * p.element_size()
                                                for p in master.base.parameters())
    return rows


def write_results(runs: list[ModeRun], mem: dict[str, int], meta: dict) -> None:
    """JSON, markdown and the two plots under docs/results."""
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "elastic_knowledge_" + Path(meta["card"]).stem.removesuffix("_elastic")
    data = {"meta": meta, "runs": [asdict(r) for r in runs], "peak_bytes": mem}
    results.save(stem, data, OUT)
    plot(runs, stem)


def _run(r: dict) -> ModeRun:
    """A ModeRun from its JSON (NaN is stored as null)."""
    visits = [Visit(**{k: math.nan if x is None else x for k, x in v.items()})
              for v in r["visits"]]
    return ModeRun(r["mode"], visits, r["accuracy"], r["seconds"], r.get("seed", 0))


def render(data: dict) -> str:
    """The results page from the JSON `write_results` wrote."""
    return markdown([_run(r) for r in data["runs"]], data["peak_bytes"], data["meta"])


def _visits(runs: list[ModeRun]) -> range:
    return range(1, max(v.visit for r in runs for v in r.visits) + 1)


def revisit_gains(run: ModeRun) -> dict[int, float]:
    """Per visit k >= 2, the mean over domains of the master (no update) on the domain's
    first-visit images at visit k minus at visit 1 (points x 0.01): accumulation."""
    first = {v.domain: v.master_probe for v in run.visits if v.visit == 1}
    out: dict[int, list[float]] = {}
    for v in run.visits:
        if v.visit > 1:
            out.setdefault(v.visit, []).append(v.master_probe - first[v.domain])
    return {k: _mean(g) for k, g in out.items()}


def markdown(runs: list[ModeRun], mem: dict[str, int], meta: dict) -> str:
    """The tables of the module doc as markdown."""
    ks = _visits(runs)
    slash = " / ".join(str(k) for k in ks)
    lines = [f"# ElasticDNN master update ablation ({meta['card']})", "",
             f"Recurring stream: {meta['domains']} corruptions x {meta['visits']} visits, "
             f"severity 5, {meta['samples']} images per visit, batch {meta['batch']}, keep "
             f"{meta['keep']}, mass {meta['mass']}, lr {meta['lr']}, "
             f"{meta.get('epochs', 1)} pass(es) over each visit, Θ* share "
             f"{meta.get('share', 1.0)} (relevances: {meta.get('gauge', 'card')}), master BN "
             f"{meta.get('master_bn', 'change')}, "
             f"{meta['threads']} thread(s). Made by "
             "`python benchmarks/domains/bench_elastic_knowledge.py`.", "",
             "Revisit gain: the master (no update, BN batch statistics) on the images of a "
             "domain's first visit, at the start of visit k minus at the start of visit 1, "
             "mean over domains (points; the same images, so a gain is the master's).", "",
             f"| master update | seed | surrogate accuracy | master@first batch, visit {slash} "
             f"| revisit gain, visit {' / '.join(str(k) for k in ks[1:])} | surrogate on its "
             "visit before -> after its updates | master on the visit before -> after the "
             "update | ‖Δθ‖/‖θ‖ conv, BN | master conv change outside / at the surrogate's "
             "changed entries, / ‖Δθ‖ | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        f = " / ".join(f"{100 * _mean([x.master_first for x in r.visits if x.visit == k]):.1f}"
                       for k in ks)
        g = " / ".join(f"{100 * v:+.1f}" for v in revisit_gains(r).values())
        vs = r.visits
        lines.append(
            f"| {r.mode} | {r.seed} | {100 * r.accuracy:.1f} % | {f} % | {g} | "
            f"{100 * _mean([v.surrogate_before for v in vs]):.1f} -> "
            f"{100 * _mean([v.surrogate_after for v in vs]):.1f} % | "
            f"{100 * _mean([v.master_visit for v in vs]):.1f} -> "
            f"{100 * _mean([v.master_after for v in vs]):.1f} % | "
            f"{_mean([v.delta_conv for v in vs]):.4f}, {_mean([v.delta_bn for v in vs]):.4f} | "
            f"{_spread_cell(vs)} | "
            f"{r.seconds:.0f} |")
    lines += paired_table(runs)
    first = [r for r in runs if r.seed == runs[0].seed]
    lines += ["", f"Per visit (seed {runs[0].seed}): surrogate accuracy (master at the visit's "
              "first batch).", "",
              "| visit | domain | " + " | ".join(r.mode for r in first) + " |",
              "|---|---|" + "---|" * len(first)]
    for i, v in enumerate(first[0].visits):
        cells = " | ".join(f"{100 * r.visits[i].surrogate:.1f} "
                           f"({100 * r.visits[i].master_first:.1f})" for r in first)
        lines.append(f"| {i + 1} | {v.domain} #{v.visit} | {cells} |")
    lines += revisit_table(first)
    lines += ["", "Peak bytes allocated by one master update (and resident sizes):", "",
              "| what | KiB |", "|---|---|"]
    lines += [f"| {k} | {v / 1024:.1f} |" for k, v in mem.items()]
    return "\n".join(lines) + "\n"


def _spread_cell(vs: list[Visit]) -> str:
    """Mean spread outside / at the changed entries; runs made before it: not measured."""
    out, own = _mean([v.spread_out for v in vs]), _mean([v.spread_in for v in vs])
    return "not measured" if math.isnan(out) else f"{out:.3f} / {own:.3f}"


def later_accuracy(run: ModeRun) -> float:
    """The surrogate's accuracy over the visits after the first (2, 3, ...): what the
    master's accumulated updates can raise."""
    vs = [v for v in run.visits if v.visit > 1]
    return sum(v.surrogate * v.images for v in vs) / max(sum(v.images for v in vs), 1)


def paired_table(runs: list[ModeRun]) -> list[str]:
    """Per mode, the surrogate on visits >= 2 per seed and its paired difference from
    "none" over the seeds both ran (mean, paired t-test p); empty without "none"."""
    none = {r.seed: later_accuracy(r) for r in runs if r.mode == "none"}
    if not none or max(v.visit for r in runs for v in r.visits) < 2:
        return []
    from scipy import stats

    lines = ["", "Surrogate accuracy on visits 2+ per seed, and the paired difference from "
             "`none` over the seeds (points; p: paired t-test, two-sided).", "",
             "| master update | per seed % | mean % | minus none, mean | p |",
             "|---|---|---|---|---|"]
    for mode in dict.fromkeys(r.mode for r in runs):
        acc = {r.seed: later_accuracy(r) for r in runs if r.mode == mode}
        seeds = sorted(set(acc) & set(none))
        diff = [100 * (acc[s] - none[s]) for s in seeds]
        p = (float(stats.ttest_rel([acc[s] for s in seeds], [none[s] for s in seeds]).pvalue)
             if mode != "none" and len(seeds) > 1 else float("nan"))
        per = ", ".join(f"{100 * acc[s]:.1f}" for s in sorted(acc))
        lines.append(f"| {mode} | {per} | {100 * _mean(list(acc.values())):.1f} | "
                     f"{_mean(diff):+.2f} | {p:.3f} |")
    return lines


def revisit_table(runs: list[ModeRun]) -> list[str]:
    """Per domain, the master (no update) on the images of the domain's first visit at each
    visit, per mode: accumulation shows as a rise (the same images, so a gain is the
    master's, not easier samples)."""
    lines = ["", "Accumulation: the master (no update, BN batch statistics) on the images of a "
             "domain's first visit, at the start of each visit, %.", "",
             "| domain | " + " | ".join(r.mode for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for dom in dict.fromkeys(v.domain for v in runs[0].visits):
        cells = [" -> ".join(f"{100 * x.master_probe:.1f}" for x in r.visits if x.domain == dom)
                 for r in runs]
        lines.append(f"| {dom} | " + " | ".join(cells) + " |")
    gains = [revisit_gains(r) for r in runs]
    lines.append("| mean gain (points), visit " + " / ".join(str(k) for k in gains[0]) + " | "
                 + " | ".join(" / ".join(f"{100 * v:+.1f}" for v in g.values()) for g in gains)
                 + " |")
    return lines


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def learning_curves(run: ModeRun) -> dict[str, tuple[list[int], list[float]]]:
    """Per domain, the master on its first-visit images over the stream: at its first
    visit (before the update) and after every later visit's update; (x, accuracy)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for t, v in enumerate(run.visits):
        if v.visit == 1:
            out[v.domain] = ([t], [v.master_probe])
        for dom, acc in v.seen.items():
            out[dom][0].append(t + 1)
            out[dom][1].append(acc)
    return out


def plot(runs: list[ModeRun], stem: str) -> None:
    """Surrogate accuracy per visit, the master's first-batch accuracy per visit, and the
    per-domain learning curves of the master (first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.seed == runs[0].seed]
    for keys, name, title in (
            (("surrogate",), "per_domain", "surrogate accuracy per visit"),
            (("master_first", "master_probe"), "master",
             "master (no update): visit's first batch (solid), first visit's images (dashed)")):
        fig, ax = plt.subplots(figsize=(8, 4))
        for r, color in zip(runs, ("C0", "C1", "C2", "C3"), strict=False):
            for key, style in zip(keys, ("-", "--"), strict=False):
                ax.plot(range(1, len(r.visits) + 1), [100 * getattr(v, key) for v in r.visits],
                        style, marker="o", color=color,
                        label=r.mode if style == "-" else None)
        labels = [f"{v.domain[:10]}#{v.visit}" for v in runs[0].visits]
        ax.set_xticks(range(1, len(labels) + 1), labels, rotation=70, fontsize=7)
        ax.set_ylabel("accuracy (%)")
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(OUT / f"{stem}_{name}.png", dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True,
                             squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        for dom, (x, y) in learning_curves(r).items():
            ax.plot(x, [100 * a for a in y], marker=".", label=dom.split("/")[0])
        for t, v in enumerate(r.visits):
            if v.visit > 1 and v.domain == r.visits[0].domain:
                ax.axvline(t, color="grey", lw=0.5)
        ax.set_title(f"{r.mode}: master on each domain's first-visit images")
        ax.set_xlabel("visits done (grey: a new round of domains)")
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}_learning_curve.png", dpi=110)
    plt.close(fig)


def load_partials(paths: list[Path]) -> tuple[list[ModeRun], dict[str, int], dict]:
    """Runs, memory rows and meta of partial results (`--partial`), in the given order."""
    runs, mem, meta = [], {}, {}
    for p in paths:
        data = json.loads(p.read_text())
        runs += [_run(r) for r in data["runs"]]
        mem, meta = mem or data["peak_bytes"], meta or data["meta"]
    return runs, mem, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", type=Path, default=CARD)
    ap.add_argument("--domains", type=int, default=8)
    ap.add_argument("--visits", type=int, default=2)
    ap.add_argument("--samples-per-domain", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--keep", type=float, default=0.3)
    ap.add_argument("--mass", type=float, default=0.8)
    ap.add_argument("--lr", type=float, default=1.25e-3)
    ap.add_argument("--epochs", type=int, default=1,
                    help="passes of the surrogate's retraining over each visit's images")
    ap.add_argument("--share", type=float, default=None,
                    help="refit Θ* with K = ceil(share·N) and rewrite the master's filters "
                    "from it (rank K, Eq. 4) before the stream; default: the card's Θ*")
    ap.add_argument("--gauge", choices=("card", "orthonormal"), default="card",
                    help="Θ*'s relevances as the card has them, or re-gauged orthonormal "
                    "(same combinations and tie; Eqs. 3-4 then a projection)")
    ap.add_argument("--master-bn", choices=MASTER_BN, default=MASTER_BN[0],
                    help="knowledge update: BN affine and conv biases (outside Θ*) take the "
                    "surrogate's change, or keep the master's")
    ap.add_argument("--seed", type=int, default=0, help="stream and torch seed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--partial", type=Path, default=None,
                    help="write this run's modes here instead of docs/results (one mode "
                    "per process keeps each run short); then --merge")
    ap.add_argument("--merge", default="", help="comma-separated --partial files to merge")
    args = ap.parse_args()
    if args.merge:
        runs, mem, meta = load_partials([Path(p) for p in args.merge.split(",")])
    else:
        runs, mem, meta = run_all(args)
    if args.partial is not None:
        data = {"meta": meta, "runs": [asdict(r) for r in runs], "peak_bytes": mem}
        args.partial.write_text(json.dumps(data) + "\n")
        return
    print(markdown(runs, mem, meta))
    write_results(runs, mem, meta)


def run_all(args: argparse.Namespace) -> tuple[list[ModeRun], dict[str, int], dict]:
    """Every mode of `args.modes` over the stream; the memory rows from the first mode's
    last surrogate."""
    torch.set_num_threads(args.threads)
    master = load_gated(args.card)
    kn = require_knowledge(master)
    if args.share is not None:
        kn = attach_knowledge(master, args.share)
        mods = dict(master.base.named_modules())
        for layer in kn.layers:
            kn.recall(layer, mods[layer].weight)
    if args.gauge == "orthonormal":
        kn.orthonormalize()
    segs = segments(args.card, args.domains, args.visits, args.samples_per_domain, args.batch,
                    args.seed)
    runs, last = [], None
    for mode in args.modes.split(","):
        torch.manual_seed(args.seed)
        run, sur, before = run_mode(master, segs, mode, args.keep, args.mass, args.lr,
                                    args.epochs, args.seed, args.master_bn)
        runs.append(run)
        last = last or (sur, before)
    meta = {"card": args.card.name, "domains": args.domains, "visits": args.visits,
            "samples": args.samples_per_domain, "batch": args.batch, "keep": args.keep,
            "mass": args.mass, "lr": args.lr, "epochs": args.epochs, "share": kn.share,
            "master_bn": args.master_bn, "gauge": args.gauge, "threads": args.threads}
    return runs, memory_rows(last[1], last[0]), meta


if __name__ == "__main__":
    main()
