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
Printed and written to docs/results/elastic_knowledge_<card>.{json,md} and two plots
(`_per_domain.png`: surrogate accuracy per visit; `_master.png`: the master's accuracy at
each visit's first batch and over the visit, the accumulation learning curve).

Memory: peak bytes allocated by one master update (torch profiler allocation events,
cumulative, from the surrogate of the last visit), knowledge layer by layer vs all layers'
changes held at once vs averaging; and Θ*'s resident size.

Usage: python benchmarks/bench_elastic_knowledge.py [--card C] [--domains 8] [--visits 2]
           [--samples-per-domain 128] [--threads 1]
  one mode per process (each under 10 min on the r18 card), then merged:
    for m in knowledge averaging none; do python benchmarks/bench_elastic_knowledge.py \
        --samples-per-domain 64 --modes $m --partial /tmp/ek_$m.json; done
    python benchmarks/bench_elastic_knowledge.py --merge /tmp/ek_knowledge.json,\
        /tmp/ek_averaging.json,/tmp/ek_none.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import results
import torch
from torch import Tensor

from tta_core.data import streams
from tta_core.data.corruptions import CORRUPTIONS
from tta_core.elasticdnn.filter_update import (
    _deltas,
    filter_optimizer,
    filter_scores,
    im_loss,
    mask_gradients,
    select_filters,
    write_back,
)
from tta_core.elasticdnn.gates import GatedModel, load_gated
from tta_core.elasticdnn.knowledge import require_knowledge
from tta_core.elasticdnn.surrogate import Surrogate, extract_surrogate, highest_entropy_sample
from tta_core.eval.bench import batches_from_arrays, images_to_input
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


@dataclass
class ModeRun:
    """One master-update mode over the stream."""

    mode: str
    visits: list[Visit] = field(default_factory=list)
    accuracy: float = 0.0  # surrogate, all images
    seconds: float = 0.0


def segments(card_path: Path, domains: int, visits: int, n: int, batch: int
             ) -> list[tuple[str, list[tuple[Tensor, Tensor]]]]:
    """The recurring stream cut into domain visits: (domain, [(x, y) batches])."""
    card = load_card(card_path)
    spec = streams.StreamSpec(order="recurring", severity=5, samples_per_domain=n,
                              image_size=card.image_size, num_classes=card.num_classes,
                              corruptions=CORRUPTIONS[:domains], recurrences=visits,
                              seed=0)
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


@torch.no_grad()
def master_accuracy(master: GatedModel, x: Tensor, y: Tensor) -> float:
    """Accuracy of the full master with BN on the batch's statistics (buffers restored)."""
    buffers = {n: b.clone() for n, b in master.named_buffers()}
    master.train()
    acc = float((master(x).argmax(1) == y).float().mean())
    master.eval()
    for n, b in master.named_buffers():
        b.copy_(buffers[n])
    return acc


def adapt_visit(master: GatedModel, batches: list[tuple[Tensor, Tensor]], keep: float,
                mass: float, lr: float) -> tuple[Surrogate, int]:
    """Cut, select filters and adapt a surrogate over one visit; (surrogate, hits)."""
    x0 = batches[0][0]
    sur = extract_surrogate(master, highest_entropy_sample(master, x0), keep)
    sur.model.train()
    mask_gradients(sur, select_filters(filter_scores(sur, x0), mass))
    opt = filter_optimizer(sur, lr)
    hits = 0
    for x, y in batches:
        logits = sur.model(x)
        hits += int((logits.argmax(1) == y).sum())
        opt.zero_grad(set_to_none=True)
        im_loss(logits).backward()
        opt.step()
    return sur, hits


def run_mode(master0: GatedModel, segs: list, mode: str, keep: float, mass: float,
             lr: float) -> tuple[ModeRun, Surrogate, GatedModel]:
    """One mode over the stream (module doc); also the last surrogate and the master it
    was cut from, for the memory measurement."""
    master = copy.deepcopy(master0).eval()
    run, seen, hits, total = ModeRun(mode), {}, 0, 0
    probes: dict[str, list[tuple[Tensor, Tensor]]] = {}
    t0 = time.perf_counter()
    before = master
    for dom, batches in segs:
        seen[dom] = seen.get(dom, 0) + 1
        first = master_accuracy(master, *batches[0])
        whole = sum(master_accuracy(master, x, y) * len(y) for x, y in batches)
        probe = probes.setdefault(dom, batches)
        same = whole if probe is batches else sum(
            master_accuracy(master, x, y) * len(y) for x, y in probe)
        before = copy.deepcopy(master)
        sur, h = adapt_visit(master, batches, keep, mass, lr)
        n = sum(len(y) for _, y in batches)
        run.visits.append(Visit(dom, seen[dom], first, whole / n,
                                same / sum(len(y) for _, y in probe), h / n, n))
        hits, total = hits + h, total + n
        write_back(master, sur, mode)
        print(f"  {mode:<9} {dom:<18} visit {seen[dom]}  master@first {100 * first:5.1f}%  "
              f"surrogate {100 * h / n:5.1f}%", flush=True)
    run.accuracy, run.seconds = hits / total, time.perf_counter() - t0
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


def render(data: dict) -> str:
    """The results page from the JSON `write_results` wrote."""
    runs = [ModeRun(r["mode"], [Visit(**v) for v in r["visits"]], r["accuracy"], r["seconds"])
            for r in data["runs"]]
    return markdown(runs, data["peak_bytes"], data["meta"])


def markdown(runs: list[ModeRun], mem: dict[str, int], meta: dict) -> str:
    """The tables of the module doc as markdown."""
    lines = [f"# ElasticDNN master update ablation ({meta['card']})", "",
             f"Recurring stream: {meta['domains']} corruptions x {meta['visits']} visits, "
             f"severity 5, {meta['samples']} images per visit, batch {meta['batch']}, keep "
             f"{meta['keep']}, mass {meta['mass']}, lr {meta['lr']}, {meta['threads']} "
             "thread(s). Made by `python benchmarks/bench_elastic_knowledge.py`.", "",
             "| master update | surrogate accuracy | master@first batch, visit 1 / 2 | "
             "master over the visit, visit 1 / 2 | s |", "|---|---|---|---|---|"]
    for r in runs:
        f = {k: _mean([x.master_first for x in r.visits if x.visit == k]) for k in (1, 2)}
        w = {k: _mean([x.master_visit for x in r.visits if x.visit == k]) for k in (1, 2)}
        lines.append(f"| {r.mode} | {100 * r.accuracy:.1f} % | {100 * f[1]:.1f} / "
                     f"{100 * f[2]:.1f} % | {100 * w[1]:.1f} / {100 * w[2]:.1f} % | "
                     f"{r.seconds:.0f} |")
    lines += ["", "Per visit: surrogate accuracy (master at the visit's first batch).", "",
              "| visit | domain | " + " | ".join(r.mode for r in runs) + " |",
              "|---|---|" + "---|" * len(runs)]
    for i, v in enumerate(runs[0].visits):
        cells = " | ".join(f"{100 * r.visits[i].surrogate:.1f} "
                           f"({100 * r.visits[i].master_first:.1f})" for r in runs)
        lines.append(f"| {i + 1} | {v.domain} #{v.visit} | {cells} |")
    lines += revisit_table(runs)
    lines += ["", "Peak bytes allocated by one master update (and resident sizes):", "",
              "| what | KiB |", "|---|---|"]
    lines += [f"| {k} | {v / 1024:.1f} |" for k, v in mem.items()]
    return "\n".join(lines) + "\n"


def revisit_table(runs: list[ModeRun]) -> list[str]:
    """Per domain, the master (no update) on the images of the domain's first visit, at
    that visit -> at the revisit, per mode: accumulation shows as a gain (the same images,
    so a gain is the master's, not easier samples)."""
    lines = ["", "Accumulation: the master (no update, BN batch statistics) on the images of a "
             "domain's first visit, at that visit -> at the revisit, %.", "",
             "| domain | " + " | ".join(r.mode for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    rows = {r.mode: [] for r in runs}
    for dom in dict.fromkeys(v.domain for v in runs[0].visits):
        cells = []
        for r in runs:
            v = {x.visit: x for x in r.visits if x.domain == dom}
            if 1 in v and 2 in v:
                rows[r.mode].append(v[2].master_probe - v[1].master_probe)
                cells.append(f"{100 * v[1].master_probe:.1f} -> {100 * v[2].master_probe:.1f}")
        if cells:
            lines.append(f"| {dom} | " + " | ".join(cells) + " |")
    lines.append("| mean gain (points) | " + " | ".join(
        f"{100 * _mean(rows[r.mode]):+.1f}" for r in runs) + " |")
    return lines


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def plot(runs: list[ModeRun], stem: str) -> None:
    """Surrogate accuracy per visit, and the master's first-batch accuracy per visit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def load_partials(paths: list[Path]) -> tuple[list[ModeRun], dict[str, int], dict]:
    """Runs, memory rows and meta of partial results (`--partial`), in the given order."""
    runs, mem, meta = [], {}, {}
    for p in paths:
        data = json.loads(p.read_text())
        for r in data["runs"]:
            runs.append(ModeRun(r["mode"], [Visit(**v) for v in r["visits"]], r["accuracy"],
                                r["seconds"]))
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
    require_knowledge(master)
    segs = segments(args.card, args.domains, args.visits, args.samples_per_domain, args.batch)
    runs, last = [], None
    for mode in args.modes.split(","):
        torch.manual_seed(0)
        run, sur, before = run_mode(master, segs, mode, args.keep, args.mass, args.lr)
        runs.append(run)
        last = last or (sur, before)
    meta = {"card": args.card.name, "domains": args.domains, "visits": args.visits,
            "samples": args.samples_per_domain, "batch": args.batch, "keep": args.keep,
            "mass": args.mass, "lr": args.lr, "threads": args.threads}
    return runs, memory_rows(last[1], last[0]), meta


if __name__ == "__main__":
    main()
