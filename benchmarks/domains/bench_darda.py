"""DARDA as the paper evaluates it (§5, Table 2): unseen corruptions at severity 5.

A bundle from `tta train-darda` (15 training corruptions) is streamed the 4 unseen ones
(speckle_noise, gaussian_blur, spatter, saturate; severity 5), IID labels and non-IID
(Dirichlet delta, label-correlated), against source, bn_adapt, tent, robust BN (adashadow
bn_mode robust), the online-learnt darda (no bundle) and the five Table 2 variants. Per
method: error %, accuracy of the first 5 batches after each shift, backward passes per
new domain, forward MACs per sample (model + corruption encoder for the paper's darda),
wall seconds. A recurring stream (the 4 unseen twice) measures the robot extension
(`learn_domains`): backward passes on the second visits. `--cifar10c-only`: a tiny
CIFAR-10-C-layout folder (<corruption>.npy + labels.npy, written from the signs data into
a temporary folder) read by `--data cifar10c:DIR`'s loader: backward passes per new domain
on the 15 corruptions it can hold.

    python benchmarks/domains/bench_darda.py --card checkpoints/small_resnet_signs32.json \\
        --bundle checkpoints/small_resnet_signs32_darda.safetensors [--quick]

Writes docs/results/darda.json and .md (or --out); prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import results
import torch
from torch import Tensor, nn

from tta_core.data.corruptions import CORRUPTIONS, HELD_OUT, SEVERITIES, corrupt_batch
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.data.sources import load_data, parse_data
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.model.source import load_source
from tta_core.registry import build_method

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("no_extractor", "no_bn_adapt", "bn_only", "bn_entropy", "full")
BASELINES = ("source", "bn_adapt", "tent", "adashadow:bn_mode=robust", "darda")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", default=str(ROOT / "checkpoints" / "small_resnet_signs32.json"))
    ap.add_argument("--bundle", default="")
    ap.add_argument("--samples", type=int, default=320, help="per unseen corruption")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seeds", default="0", help="comma list of stream seeds")
    ap.add_argument("--deltas", default="iid,0.1", help="'iid' and Dirichlet deltas")
    ap.add_argument("--quick", action="store_true", help="96 samples per corruption")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "darda"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--deadline-only", action="store_true", help="run the deadline part "
                    "and add it to --from-json's results")
    ap.add_argument("--cifar10c-only", action="store_true", help="run the CIFAR-10-C-layout "
                    "part and add it to --from-json's results")
    ap.add_argument("--cifar10c-n", type=int, default=64, help="clean images per severity "
                    "in the CIFAR-10-C-layout folder")
    ap.add_argument("--from-json", default="", help="rewrite the markdown (with the means) "
                    "from a JSON this script wrote, running nothing")
    return ap.parse_args()


def stream(card, n: int, seed: int, delta: str, recur: bool = False):
    """[(x, y, corruption)] batches of the unseen corruptions."""
    spec = StreamSpec(order="dirichlet" if delta != "iid" else "continual",
                      corruptions=HELD_OUT * (2 if recur else 1), samples_per_domain=n,
                      severity=5, seed=seed, image_size=card.image_size,
                      dirichlet_alpha=float(delta) if delta != "iid" else 0.1)
    return build_stream(spec), spec


def batches(s, card, batch: int):
    x = images_to_tensor(s.images, tuple(card.mean), tuple(card.std))
    y = torch.as_tensor(s.labels)
    out = []
    for i in range(0, len(y), batch):
        out.append((x[i:i + batch], y[i:i + batch], str(s.domains[i])))
    return out


def macs(model: nn.Module, x: Tensor) -> int:
    """Multiply-accumulates of conv and linear layers in one forward of x, per sample."""
    total = 0

    def hook(mod, inp, out):
        nonlocal total
        if isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
            total += out.numel() * k
        elif isinstance(mod, nn.Linear):
            total += out.numel() * mod.in_features

    hs = [m.register_forward_hook(hook) for m in model.modules()
          if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    return total // len(x)


def run(spec: str, card_path: str, data, bundle: str, deadline_ms: float = 0.0) -> dict:
    name, _, rest = spec.partition(":")
    opts = {}
    for kv in filter(None, rest.split(";")):
        k, _, v = kv.partition("=")
        opts[k] = json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v
    if "variant" in opts or opts.get("learn_domains"):
        opts["bundle_path"] = bundle
    torch.manual_seed(0)
    model, card = load_source(card_path)
    m = build_method(name, model, input_shape=(3, card.image_size, card.image_size), **opts)
    mac = macs(model, data[0][0])
    if "bundle_path" in opts:
        mac += macs(m.paper.encoder, data[0][0])
    correct, n, first, backward, prev, since = 0, 0, [], 0, None, 0
    domains, ms = 0, []
    with harness.Stopwatch() as sw:
        for x, y, d in data:
            r = m.step(x)
            hit = (r.logits.argmax(1) == y).float()
            correct, n = correct + float(hit.sum()), n + len(y)
            since = 0 if d != prev else since + 1
            domains += d != prev
            prev = d
            if since < 5:
                first.append(float(hit.mean()))
            backward += bool(r.adapted)
            ms.append(r.times.total_ms)
        m.close()
    return {"method": spec, "error": 100 * (1 - correct / n),
            "first5_acc": 100 * sum(first) / len(first), "backward_per_domain": backward / domains,
            "macs": mac, "wall_s": sw.s,
            "batch_ms_median": sorted(ms)[len(ms) // 2],
            "deadline_hit": sum(t <= deadline_ms for t in ms) / len(ms) if deadline_ms else None}


def deadline_part(a: argparse.Namespace, card, result: dict) -> list[str]:
    """IID seed 0 under a per-batch deadline of k x the source's median batch time: share
    of batches on time, with and without darda's `deadline_ms` (its adaptation waits)."""
    data = batches(stream(card, a.samples, 0, "iid")[0], card, a.batch)
    base = run("source", a.card, data, a.bundle)["batch_ms_median"]
    rows = []
    for k in (4, 8):
        d = k * base
        free = run("darda:variant=full", a.card, data, a.bundle, d)
        held = run(f"darda:variant=full;deadline_mode=fixed;deadline_ms={d:.3f}", a.card,
                   data, a.bundle, d)
        rows.append({"k": k, "deadline_ms": d, "free": free, "held": held})
    result["deadline"] = {"source_median_ms": base, "rows": rows}
    return deadline_table(result["deadline"])


def deadline_table(dl: dict) -> list[str]:
    lines = [f"### Deadline (IID seed 0; source median batch {dl['source_median_ms']:.1f} ms)",
             "", "| deadline | darda full: on time | backward / domain | with deadline_mode "
             "fixed: on time | backward / domain |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in dl["rows"]:
        free, held = r["free"], r["held"]
        lines.append(f"| {r['k']} x = {r['deadline_ms']:.1f} ms | "
                     f"{100 * free['deadline_hit']:.1f} % | {free['backward_per_domain']:.2f} | "
                     f"{100 * held['deadline_hit']:.1f} % | {held['backward_per_domain']:.2f} |")
    return ["\n".join(lines), ""]


def write_cifar10c(root: Path, n: int, seed: int = 11) -> None:
    """A CIFAR-10-C-layout folder from the signs data: <corruption>.npy, (5n, 32, 32, 3)
    uint8, severities 1-5 in blocks of the same n clean images, and labels.npy (5n)."""
    clean = make_signs(n, 32, seed)
    for name in CORRUPTIONS:
        np.save(root / f"{name}.npy", np.concatenate(
            [corrupt_batch(clean.images, name, sev, seed) for sev in SEVERITIES]))
    np.save(root / "labels.npy", np.tile(clean.labels, len(SEVERITIES)))


def cifar10c_part(a: argparse.Namespace, card, result: dict) -> list[str]:
    """Backward passes per new domain on a CIFAR-10-C-layout stream (severity 5, the 15
    corruptions the layout holds, continual), read by `--data cifar10c:DIR`'s loader."""
    with tempfile.TemporaryDirectory() as tmp:
        write_cifar10c(Path(tmp), a.cifar10c_n)
        s = load_data(parse_data(f"cifar10c:{tmp}"), card.image_size, 5, a.cifar10c_n)
        data = batches(s, card, a.batch)
    rows = [run(spec, a.card, data, a.bundle)
            for spec in ("bn_adapt", "darda:variant=full", "darda")]
    result["cifar10c"] = {"n": a.cifar10c_n, "domains": len(CORRUPTIONS), "rows": rows}
    return cifar10c_table(result["cifar10c"])


def cifar10c_table(part: dict) -> list[str]:
    return [table(part["rows"], f"CIFAR-10-C-layout `--data` stream ({part['domains']} "
                  f"corruptions, severity 5, {part['n']} images each, continual)"), ""]


def oracle(card_path: str, bundle: str, data) -> dict:
    """Accuracy of every bootstrapped sub-network on each unseen corruption of the stream
    (forward-only, its stored BN statistics) and the one Eq. 10 picks for it."""
    from tta_core.darda.bundle import load_bundle
    from tta_core.darda.subnet import closest
    from tta_core.domain.bank import adapted_tensors

    model, _ = load_source(card_path)
    off = load_bundle(bundle, model)
    live = adapted_tensors(model)
    sig = off.s(off.fingerprints)
    out = {}
    for corr in dict.fromkeys(d for _, _, d in data):
        xs = torch.cat([x for x, _, d in data if d == corr])
        ys = torch.cat([y for _, y, d in data if d == corr])
        with torch.no_grad():
            c = torch.nn.functional.normalize(off.encoder(xs).mean(0), dim=0)
            accs = {}
            for name, state in off.states.items():
                for k, t in live.items():
                    t.copy_(state[k])
                accs[name] = 100 * float((model(xs).argmax(1) == ys).float().mean())
        best = max(accs, key=accs.get)
        pick = off.names[closest(sig, c)]
        out[corr] = {"picked": pick, "picked_acc": accs[pick], "best": best,
                     "best_acc": accs[best]}
    return out


def oracle_table(rows: dict) -> str:
    lines = ["### Bootstrapped sub-networks on the unseen corruptions (seed 0, forward-only)",
             "", "| corruption | Eq. 10 picks | its accuracy % | best of 15 | its accuracy % |",
             "| --- | --- | ---: | --- | ---: |"]
    for corr, r in rows.items():
        lines.append(f"| {corr} | {r['picked']} | {r['picked_acc']:.1f} | {r['best']} | "
                     f"{r['best_acc']:.1f} |")
    return "\n".join(lines)


def table(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| method | error % | first-5 acc % | backward / domain | "
             "forward MACs / sample |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['error']:.1f} | {r['first5_acc']:.1f} | "
                     f"{r['backward_per_domain']:.2f} | {r['macs'] / 1e6:.2f} M |")
    return "\n".join(lines)


def summary(result: dict) -> list[str]:
    """Mean over seeds per stream kind (IID, each delta): the Table 2 analog."""
    md = []
    kinds = sorted({k.split(" seed")[0] for k in result["runs"] if " seed " in k})
    for kind in kinds:
        rows: dict[str, list[dict]] = {}
        for key, runs in result["runs"].items():
            if key.startswith(kind + " seed "):
                for r in runs:
                    rows.setdefault(r["method"], []).append(r)
        mean = [{k: (sum(r[k] for r in rs) / len(rs)
                     if isinstance(rs[0][k], int | float) else rs[0][k])
                 for k in rs[0]} for m, rs in rows.items()]
        seeds = len(next(iter(rows.values())))
        result.setdefault("mean", {})[kind] = mean
        md += [table(mean, f"{kind}: mean of {seeds} seed(s)"), ""]
    return md


def write(result: dict, md: list[str], out: Path) -> None:
    summary(result)
    results.save(out.stem, result, out.parent)
    print("\n".join(md[4:]))
    print(f"wrote {out.with_suffix('.json')} and .md")


def render(result: dict) -> str:
    """The results page from the JSON: settings, deadline, oracle, Table 2 means, runs."""
    md = header(result)
    if "deadline" in result:
        md += deadline_table(result["deadline"])
    if "cifar10c" in result:
        md += cifar10c_table(result["cifar10c"])
    if "oracle" in result:
        md += [oracle_table(result["oracle"]), ""]
    md += summary(dict(result))
    for key, rows in result["runs"].items():
        md += [table(rows, key), ""]
    return "\n".join(md) + "\n"


def header(result: dict) -> list[str]:
    return [f"## DARDA on the unseen corruptions ({result['card']}, severity 5, batch "
            f"{result['batch']}, {result['samples']} samples per corruption, bundle "
            f"{result['bundle']})", "",
            "`darda`: the online-learnt domain bank (no bundle, the robot extension); "
            "`darda:variant=...`: the paper from the bundle (Table 2 rows: no_extractor, "
            "no_bn_adapt = w/o context-aware BN & adaptation, bn_only = context-aware BN "
            "w/o adaptation, bn_entropy = context-aware BN + entropy, full = Eq. 16); "
            "`learn_domains`: the paper + banked novel corruptions. First-5 acc: the first "
            "5 batches after each shift. Backward / domain: backward passes per corruption "
            "segment. MACs: conv + linear of one forward (+ the corruption encoder).", ""]


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    if a.from_json:
        result = json.loads(Path(a.from_json).read_text())
        md = header(result)
        if a.deadline_only:
            md += deadline_part(a, load_source(a.card)[1], result)
        elif "deadline" in result:
            md += deadline_table(result["deadline"])
        if a.cifar10c_only:
            md += cifar10c_part(a, load_source(a.card)[1], result)
        elif "cifar10c" in result:
            md += cifar10c_table(result["cifar10c"])
        if "oracle" in result:
            md += [oracle_table(result["oracle"]), ""]
        for key, rows in result["runs"].items():
            md += [table(rows, key), ""]
        write(result, md, Path(a.out))
        return
    if not a.bundle:
        raise SystemExit("bench_darda: --bundle is required (tta train-darda writes one)")
    _, card = load_source(a.card)
    n = 96 if a.quick else a.samples
    specs = list(BASELINES) + [f"darda:variant={v}" for v in VARIANTS]
    result = {"card": card.name, "bundle": Path(a.bundle).name, "samples": n,
              "batch": a.batch, "runs": {}}
    md = header(result)
    for delta in a.deltas.split(","):
        for seed in map(int, a.seeds.split(",")):
            s, _ = stream(card, n, seed, delta)
            data = batches(s, card, a.batch)
            rows = [run(spec, a.card, data, a.bundle) for spec in specs]
            if seed == 0 and delta == "iid":
                result["oracle"] = oracle(a.card, a.bundle, data)
                md += [oracle_table(result["oracle"]), ""]
            key = f"{'IID' if delta == 'iid' else 'delta=' + delta} seed {seed}"
            result["runs"][key] = rows
            md += [table(rows, key), ""]
            print(md[-2], flush=True)
        s, _ = stream(card, n, 0, delta, recur=True)
        data = batches(s, card, a.batch)
        rows = [run(spec, a.card, data, a.bundle) for spec in
                ("darda:variant=full", "darda:variant=full;learn_domains=true;novelty_cos=0.95")]
        key = f"recurring (4 unseen x 2), {'IID' if delta == 'iid' else 'delta=' + delta}"
        result["runs"][key] = rows
        md += [table(rows, key), ""]
        print(md[-2], flush=True)
    write(result, md, Path(a.out))


if __name__ == "__main__":
    main()
