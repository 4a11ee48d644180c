"""Domain bank (DARDA, issue #21): recognition, novelty, recurring stream, overhead.

Prints JSON and writes it with a confusion-matrix PNG under --out:
- recognition of the 15 corruptions at batch 16 on the shipped stream (severity 5, fresh
  images on a second pass): "online" (domains learnt from nothing on the first pass,
  each found domain labelled by its majority corruption) and "enrolled" (domains enrolled
  from the labelled first pass, DARDA's offline phase); confusion matrices;
- novelty of the 4 held-out corruptions against the 15 enrolled domains: share of batches
  flagged novel (farther than the threshold from every domain) and share served as novel
  (flagged, or by a domain created during the held-out segment);
- the recurring stream (15 corruptions x 3 visits) for darda vs tent vs bn_adapt vs
  adashadow with and without its `domain_bank` (per-visit plot recurring_visits.png): mean
  online accuracy, per visit, visits 2-3 first-5-batch vs visit-1 last-5 accuracy,
  backward-pass share, detection + swap time share;
- detection + swap share of batch time on a torchvision ResNet-18 (random weights).

    python benchmarks/domains/bench_domain.py [--quick] [--moments-only] [--encoder ENC.safetensors]
                                      [--methods ''] [--resnet-size -1] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch
from torchvision import models as tvm

from tta_core.data.corruptions import CORRUPTIONS, HELD_OUT
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.domain.detector import DomainDetector
from tta_core.domain.embedding import DomainEmbedder, EmbeddingConfig
from tta_core.model.norms import set_bn_mode
from tta_core.model.source import load_source
from tta_core.registry import build_method

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"
BATCH = 16


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 corruptions, fewer samples")
    ap.add_argument("--samples", type=int, default=0, help="per domain (default 480 / 160)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="darda,darda:bn_mode=batch,tent,bn_adapt,adashadow,"
                                         "adashadow:domain_bank=true",
                    help="comma list, options as name:key=value;key=value")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_domain"))
    ap.add_argument("--moments-only", action="store_true",
                    help="embedding without the corruption residual (the old one)")
    ap.add_argument("--encoder", default="", help="also recognition with this learnt "
                    "corruption encoder (tta train-corruption-encoder), alone and added")
    ap.add_argument("--resnet-size", type=int, default=0,
                    help="ResNet-18 input px (224/112; -1: skip)")
    return ap.parse_args()


def embed_stream(spec: StreamSpec, config: EmbeddingConfig
                 ) -> list[tuple[torch.Tensor, torch.Tensor | None, str]]:
    """(embedding, within, true corruption) per batch, as darda's trunk computes them."""
    model, card = load_source(CARD)
    set_bn_mode(model, "batch")
    emb = DomainEmbedder(model, (3, 32, 32), config)
    out = []
    for b in build_stream(spec).batches(BATCH):
        with torch.no_grad():
            model(images_to_tensor(b.images, tuple(card.mean), tuple(card.std)))
        out.append((*emb.embedding(), b.domain.split("/")[0]))
    emb.close()
    return out


def confusion(true: list[str], pred: list[str], labels: list[str]) -> list[list[int]]:
    """Counts [true][predicted]; predictions outside `labels` go to a last 'other' column."""
    idx = {n: i for i, n in enumerate(labels)}
    mat = np.zeros((len(labels), len(labels) + 1), dtype=int)
    for t, p in zip(true, pred, strict=True):
        mat[idx[t], idx.get(p, len(labels))] += 1
    return mat.tolist()


def recognise(passes, enrolled: bool) -> tuple[DomainDetector, dict]:
    """Learn on the first half of `passes`, recognise the second half."""
    det = DomainDetector(passes[0][0].numel())
    half = len(passes) // 2
    if enrolled:
        for c in dict.fromkeys(d for _, _, d in passes[:half]):
            rows = [(e, w) for e, w, d in passes[:half] if d == c]
            det.enroll(c, torch.stack([e for e, _ in rows]), torch.stack([w for _, w in rows]))
        det.batches = det.config.warmup_pooled  # past warm-up: judge from the first batch
        label = {n: n for n in det.names}
    else:
        first = [(det.observe(e, w).domain, d) for e, w, d in passes[:half]]
        label = {n: Counter(d for m, d in first if m == n).most_common(1)[0][0]
                 for n, _ in first}
    true = [d for _, _, d in passes[half:]]
    pred = [label.get(det.observe(e, w).domain, "other") for e, w, _ in passes[half:]]
    labels = list(dict.fromkeys(true))
    return det, {"accuracy": float(np.mean([p == t for p, t in zip(pred, true, strict=True)])),
                 "domains_found": len(det.names), "labels": labels,
                 "confusion": confusion(true, pred, labels)}


def novelty(det: DomainDetector, held) -> dict:
    """Per held-out corruption: share flagged novel, share served as novel."""
    out = {}
    known = set(det.names)
    for c in dict.fromkeys(d for _, _, d in held):
        rows = [(e, w) for e, w, d in held if d == c]
        flagged = [det.assess(e)[2] for e, _ in rows]
        probe = copy.deepcopy(det)
        served = []
        for e, w in rows:
            r = probe.observe(e, w)
            served.append(r.novel or r.domain not in known)
        out[c] = {"flagged": float(np.mean(flagged)), "served_novel": float(np.mean(served)),
                  "nearest": Counter(det.names[det.assess(e)[0]] if not f else "novel"
                                     for (e, _), f in zip(rows, flagged, strict=True)
                                     ).most_common(2)}
    rates = [v["flagged"] for v in out.values()]
    return {"per_corruption": out, "mean_flagged": float(np.mean(rates)),
            "mean_served_novel": float(np.mean([v["served_novel"] for v in out.values()]))}


def recognition_report(config: EmbeddingConfig, corr: tuple[str, ...], n: int, seed: int,
                       out: Path, tag: str) -> dict:
    """Online / enrolled recognition (confusion plots confusion_<mode><tag>.png) and the
    novelty of the held-out corruptions, with one embedding."""
    passes = embed_stream(StreamSpec(order="recurring", corruptions=corr, samples_per_domain=n,
                                     recurrences=2, seed=seed), config)
    held = embed_stream(StreamSpec(order="continual", corruptions=HELD_OUT,
                                   samples_per_domain=n, seed=seed + 1), config)
    report = {"dim": int(passes[0][0].numel())}
    for mode in ("online", "enrolled"):
        det, rec = recognise(passes, enrolled=mode == "enrolled")
        plot_confusion(rec, out / f"confusion_{mode}{tag}.png", f"recognition ({mode}{tag})")
        report[f"recognition_{mode}"] = rec
        if mode == "enrolled":
            report["novelty"] = novelty(det, held)
    return report


def plot_confusion(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mat = np.asarray(result["confusion"], dtype=float)
    mat = mat / np.maximum(mat.sum(1, keepdims=True), 1)
    labels = result["labels"]
    fig, ax = plt.subplots(figsize=(8, 7))
    ax.imshow(mat, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(labels) + 1), [*labels, "other"], rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("recognised as")
    ax.set_ylabel("true corruption")
    ax.set_title(f"{title}: {result['accuracy']:.1%} of batches")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_visits(rows: list[dict], path: Path) -> None:
    """Mean online accuracy per visit of the recurring stream, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.plot(range(1, len(r["per_visit"]) + 1), [100 * a for a in r["per_visit"]],
                marker="o", label=r["method"])
    ax.set_xlabel("visit")
    ax.set_ylabel("online accuracy (%)")
    ax.set_xticks(range(1, len(rows[0]["per_visit"]) + 1))
    ax.set_title("recurring stream (15 corruptions x 3 visits, batch 16)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_method(spec: str) -> tuple[str, dict]:
    """'darda:bn_mode=batch;lr=0.01' -> ('darda', {'bn_mode': 'batch', 'lr': 0.01})."""
    name, _, rest = spec.partition(":")
    opts = {}
    for kv in filter(None, rest.split(";")):
        k, _, v = kv.partition("=")
        opts[k] = json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v
    return name, opts


def run_recurring(spec_str: str, batches, n_corr: int) -> dict:
    """Online accuracy etc. of one method over the recurring stream."""
    name, opts = parse_method(spec_str)
    torch.manual_seed(0)
    model, _ = load_source(CARD)
    m = build_method(name, model, input_shape=(3, 32, 32), **opts)
    accs, visits, backward, detect, total, seg, prev = [], [], 0, 0.0, 0.0, -1, None
    domains = 0
    with harness.Stopwatch() as sw:
        for x, y, d in batches:
            seg += d != prev
            prev = d
            r = m.step(x)
            accs.append(float((r.logits.argmax(1) == y).float().mean()))
            visits.append((seg // n_corr, d))
            backward += bool(r.stats.get("backward", r.adapted))
            domains = int(r.stats.get("domains", 0))
            detect += float(r.stats.get("detect_ms", 0.0))
            total += r.times.total_ms
    m.close()
    return {"method": spec_str, **_visit_stats(accs, visits),
            "backward_share": backward / len(accs),
            "detect_share": detect / total if total else 0.0, "domains": domains,
            "wall_s": sw.s}


def _visit_stats(accs: list[float], visits: list[tuple[int, str]]) -> dict:
    per: dict[tuple[int, str], list[float]] = {}
    for a, k in zip(accs, visits, strict=True):
        per.setdefault(k, []).append(a)
    n_vis = 1 + max(v for v, _ in per)
    by_visit = [float(np.mean([a for (v, _), xs in per.items() if v == i for a in xs]))
                for i in range(n_vis)]
    doms = [d for v, d in per if v == 0]
    last5 = float(np.mean([np.mean(per[(0, d)][-5:]) for d in doms]))
    first5 = float(np.mean([np.mean(per[(v, d)][:5]) for v in range(1, n_vis) for d in doms
                            if (v, d) in per])) if n_vis > 1 else float("nan")
    return {"accuracy": float(np.mean(accs)), "per_visit": by_visit,
            "visit1_last5": last5, "later_first5": first5}


def resnet18_overhead(size: int, n: int = 6) -> dict:
    """darda on a random-weight ResNet-18: detection + swap share of batch time."""
    torch.manual_seed(0)
    model = tvm.resnet18(weights=None, num_classes=10)
    m = build_method("darda", model, input_shape=(3, size, size))
    g = torch.Generator().manual_seed(0)
    det, tot, switches = 0.0, 0.0, 0
    for i in range(n):
        x = torch.randn(BATCH, 3, size, size, generator=g) * (1.0 if i < n // 2 else 3.0)
        r = m.step(x)
        if i:  # the first batch includes one-off allocations
            det, tot = det + r.stats["detect_ms"], tot + r.times.total_ms
        switches += bool(r.stats["switched"])
    return {"size": size, "batches": n, "switches": switches, "detect_share": det / tot,
            "detect_ms_per_batch": det / (n - 1), "batch_ms": tot / (n - 1),
            "state_bytes": m.bank.state_bytes()}


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    corr = CORRUPTIONS[::3] if args.quick else CORRUPTIONS
    n = args.samples or (160 if args.quick else 480)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = harness.Stopwatch().start()
    residual = not args.moments_only
    report: dict = {"batch": BATCH, "samples_per_domain": n, "corruptions": list(corr),
                    "embedding": "moments + residual" if residual else "moments only",
                    "threads": 1, "note": "CPU, 2 cores shared with other jobs: timings "
                                          "are contended"}
    report.update(recognition_report(EmbeddingConfig(residual=residual), corr, n, args.seed,
                                     out, ""))
    if args.encoder:  # DARDA's learnt encoder alone, and added to moments + residual
        for tag, cfg in (("learnt", EmbeddingConfig(0, False, True, False, args.encoder)),
                         ("moments_residual_learnt", EmbeddingConfig(encoder=args.encoder))):
            report[tag] = recognition_report(cfg, corr, n, args.seed, out, f"_{tag}")
    report["embed_s"] = clock.lap_s()
    _, card = load_source(CARD)
    stream = build_stream(StreamSpec(order="recurring", corruptions=corr, samples_per_domain=n,
                                     recurrences=3, seed=args.seed + 2))
    batches = [(images_to_tensor(b.images, tuple(card.mean), tuple(card.std)),
                torch.from_numpy(b.labels), b.domain) for b in stream.batches(BATCH)]
    report["recurring"] = [run_recurring(s, batches, len(corr))
                           for s in args.methods.split(",") if s]
    if report["recurring"]:
        plot_visits(report["recurring"], out / "recurring_visits.png")
    if args.resnet_size >= 0:
        report["resnet18"] = resnet18_overhead(args.resnet_size or (112 if args.quick else 224))
    report["total_s"] = clock.lap_s()
    (out / "bench_domain.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
