"""Results pages from benchmark JSON: one writer for the benchmarks, one renderer for the docs.

A benchmark calls `save(stem, data)`: the JSON gets a `provenance` block (the command as
run, the machine, the UTC date, the code version) and its page `docs/results/<stem>.md` is
rendered from that JSON by the benchmark's own markdown function (`PAGES`). Rendering
never reruns a measurement:

    python benchmarks/results.py            # every page, the index and README's headline
    python benchmarks/results.py --check    # exit 1 naming each stale file (CI's test)

A page carries its provenance as YAML front matter (MkDocs reads it as page metadata);
the prose holds no dates.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tta_core.io import strict_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
GPU = "gpu"  # the GPU check's folder under RESULTS (benchmarks/gpu_check.sh)


@dataclass(frozen=True)
class Page:
    """One family of results pages: JSON stems matching `pattern`, rendered by
    `benchmarks/<module>.py:<render>(data) -> markdown` (module: AREA/SCRIPT)."""

    pattern: str
    module: str
    render: str
    title: str
    command: str


PAGES: tuple[Page, ...] = (
    Page("paper_ratios", "speed/bench_paper_ratios", "to_markdown",
         "AdaShadow against inference, bn_adapt and Tent, phase split",
         "python benchmarks/speed/bench_paper_ratios.py"),
    Page("kernels", "speed/bench_kernels", "markdown",
         "DAF quantize+pack: fused one-pass CPU kernel vs two passes; Triton on CUDA",
         "python benchmarks/speed/bench_kernels.py"),
    Page("dynamic_widths", "memory/bench_dynamic_widths", "_markdown",
         "DAF dynamic widths under a budget: budget held, step time, gradient cosine",
         "python benchmarks/memory/bench_dynamic_widths.py"),
    Page("surgeon_peak", "memory/bench_surgeon_peak", "_markdown",
         "SURGEON step peak (importance pass included) against Tent",
         "python benchmarks/memory/bench_surgeon_peak.py"),
    Page("like_for_like", "memory/bench_like_for_like", "_markdown",
         "Saved bytes at equal adaptation: what the codec saves, what the plan saves",
         "python benchmarks/memory/bench_like_for_like.py"),
    Page("tent_parity", "speed/bench_tent_parity", "render",
         "tta's tent against a reference Tent from the paper: time, accuracy, agreement",
         "python benchmarks/speed/bench_tent_parity.py"),
    Page("darda_table2*", "domains/bench_darda_table2", "render",
         "DARDA's Table 2 at scale (CIFAR-scale benchmark, ResNet-26, 3 seeds, sweep)",
         "tta sweep config/sweeps/darda_table2.yaml && "
         "python benchmarks/domains/bench_darda_table2.py"),
    Page("darda_realtime*", "domains/bench_darda_realtime", "render",
         "DARDA in real time: shift recall, backward passes per shift, frames answered",
         "python benchmarks/domains/bench_darda_realtime.py --batch-sizes 4,16 "
         "--hz 250,1000,2000,4000"),
    Page("darda*", "domains/bench_darda", "render",
         "DARDA on the 4 unseen corruptions, small scale: Table 2 variants and baselines",
         "python benchmarks/domains/bench_darda.py"),
    Page("elastic_knowledge_*", "domains/bench_elastic_knowledge", "render",
         "ElasticDNN master-update ablation (Eq. 3-4 vs averaging vs none), revisits",
         "python benchmarks/domains/bench_elastic_knowledge.py"),
    Page("fleet_scheduler*", "field/bench_fleet", "markdown",
         "Fleet planners: paper objective (Eq. 5-11) vs confidence proxy vs equal split",
         "python benchmarks/field/bench_fleet.py"),
    Page("fleet_dds*", "field/bench_fleet_dds", "markdown",
         "Fleet planners over DDS: paper objective vs confidence proxy vs equal split",
         "python benchmarks/field/bench_fleet_dds.py"),
    Page("demo", "ros/bench_demo", "render",
         "`tta demo`: the sample bag through the ROS 2 nodes, source vs AdaShadow",
         "python benchmarks/ros/bench_demo.py"),
    Page("compressed_bombs", "field/bench_compressed_bombs", "render",
         "Compressed-image bombs: time to refuse from the header vs time to decode",
         "python benchmarks/field/bench_compressed_bombs.py"),
    Page("sweep_readme", "speed/bench_sweep", "render_readme",
         "Accuracy and streaming accuracy per method over seeds, with confidence intervals",
         "tta sweep config/sweeps/readme.yaml && "
         "python benchmarks/speed/bench_sweep.py --readme"),
    Page("sweep_speedup", "speed/bench_sweep", "render_speedup",
         "`tta sweep` on 2 Ray workers vs the sequential loop of the same bench runs",
         "python benchmarks/speed/bench_sweep.py"),
    Page("gate_scope", "speed/bench_gate_scope", "markdown",
         "Gating block-internal convs vs every conv: accuracy and forward time",
         "python benchmarks/speed/bench_gate_scope.py"),
    Page("shutdown", "ros/bench_shutdown", "markdown",
         "SIGINT -> exit of every node, idle and with frames flowing",
         "python benchmarks/ros/bench_shutdown.py"),
    Page("frame_cost", "ros/bench_frame_cost", "render",
         "Camera frames to the model's input: cost per kind, delay behind a large frame",
         "python benchmarks/ros/bench_frame_cost.py"),
    Page("update_overhead", "speed/bench_update_overhead", "render",
         "AdaShadow on a fast forward: the cheapest update against the room sigma*T leaves",
         "python benchmarks/speed/bench_update_overhead.py --threads 1,2 "
         "--batch-sizes 8,16,32,64"),
    Page("seg_adashadow*", "speed/bench_seg_adashadow", "render",
         "AdaShadow on the segmentation card: adapted, within budget, step over inference",
         "python benchmarks/speed/bench_seg_adashadow.py --threads 2"),
    Page("own_model", "domains/bench_own_model", "render",
         "Every paper on a user's own MobileNetV3-small, CLI only: prepare, then bench",
         "python benchmarks/domains/bench_own_model.py"),
    Page("segmentation", "domains/bench_segmentation", "render",
         "Segmentation TTA on synthetic driving scenes: mIoU under fog, night, rain, snow",
         "python benchmarks/domains/bench_segmentation.py"),
)


def page_for(stem: str) -> Page | None:
    """The page family a JSON stem belongs to (None: not a results page)."""
    name = stem.rpartition("/")[2]  # gpu/paper_ratios: the GPU check's page of the family
    return next((p for p in PAGES if fnmatch.fnmatch(name, p.pattern)), None)


def _module(path: str) -> ModuleType:
    """A benchmark script (AREA/SCRIPT under benchmarks/) imported as a module named by its
    file (benchmarks/ is no package; a script finds `harness` and `results` itself)."""
    name = path.rpartition("/")[2]
    if name in sys.modules:
        return sys.modules[name]
    file = ROOT / "benchmarks" / f"{path}.py"
    spec = importlib.util.spec_from_file_location(name, file) if file.is_file() else None
    if spec is None or spec.loader is None:
        raise SystemExit(f"results: no benchmark script benchmarks/{path}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def renderer(page: Page) -> Callable[[dict], str]:
    return getattr(_module(page.module), page.render)


# --- provenance ---------------------------------------------------------------------------

def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def code_version() -> str:
    """`git describe --always --dirty` in a checkout, else the installed package version."""
    described = _git("describe", "--always", "--dirty")
    if described:
        return described
    try:
        from importlib.metadata import version
        return f"tta_ros {version('tta_ros')}"
    except Exception:
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The machine in one line: CPU model and cores, GPU when torch sees one."""
    text = f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)}"
    return text


def provenance(argv: list[str] | None = None) -> dict:
    """What ran, where, when, from which code."""
    args = sys.argv if argv is None else argv
    script = Path(args[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return {"command": " ".join(["python", str(script), *args[1:]]),
            "machine": machine(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "code": code_version()}


# --- writing and rendering ----------------------------------------------------------------

def dumps(data: dict) -> str:
    """Strict JSON (a NaN or infinity is written as null), indented, one trailing newline."""
    return strict_json.dumps(data, indent=1) + "\n"


def render_page(stem: str, data: dict) -> str:
    """The markdown page of one results JSON: front matter, then the benchmark's tables."""
    page = page_for(stem)
    if page is None:
        raise SystemExit(f"results: no page family for docs/results/{stem}.json "
                         "(add it to PAGES in benchmarks/results.py)")
    prov = data.get("provenance", {})
    body = renderer(page)({k: v for k, v in data.items() if k != "provenance"})
    meta = ["---", f"title: {json.dumps(page.title)}",
            *(f"{k}: {json.dumps(str(prov[k]))}" for k in ("command", "machine", "date", "code")
              if k in prov),
            'generated_by: "python benchmarks/results.py"', "---", ""]
    return "\n".join(meta) + f"# {page.title}\n\n" + body.rstrip("\n") + "\n"


def save(stem: str, data: dict, out: Path = RESULTS, argv: list[str] | None = None) -> Path:
    """Write `<out>/<stem>.json` with provenance (kept when `data` already has it: a page
    re-rendered from an earlier run) and render its page next to it."""
    out.mkdir(parents=True, exist_ok=True)
    data = {**data, "provenance": data.get("provenance") or provenance(argv)}
    path = out / f"{stem}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(data))
    tmp.replace(path)
    (out / f"{stem}.md").write_text(render_page(stem, data))
    return path


def index(stems: list[str]) -> str:
    """docs/results/README.md: one row per page family, linking its pages."""
    lines = ["# Results", "",
             "Every page here is rendered from the JSON next to it by "
             "`python benchmarks/results.py`; the JSON is what the benchmark wrote, with its "
             "command, machine, date and code version (`provenance`, shown as each page's "
             "metadata). CPU figures come from the development VM (2 shared cores) unless a "
             "page names a GPU.", "", "| page | what | command |", "|---|---|---|"]
    for page in PAGES:
        mine = [s for s in stems if page_for(s) is page]
        if mine:
            links = ", ".join(f"[{s}.md]({s}.md)" for s in mine)
            lines.append(f"| {links} | {page.title} | `{page.command}` |")
    lines += ["| `gpu/` | the GPU check's figures, when it has run on a GPU | "
              "`bash benchmarks/gpu_check.sh` |"]
    return "\n".join(lines) + "\n"


# --- README blocks ------------------------------------------------------------------------

def with_interval(method: dict, key: str) -> str:
    """A ratio with its 95 % interval (`key`_ci95) when the report has one: 1.31 (1.24–1.42)."""
    lo, hi = method.get(f"{key}_ci95") or (None, None)  # absent, or null: no interval
    text = f"{method[key]:.2f}"
    known = all(v is not None and math.isfinite(v) for v in (lo, hi))
    return f"{text} ({lo:.2f}–{hi:.2f})" if known else text


def headline(data: dict) -> str:
    """README's results table: AdaShadow's cost against inference and Tent per model."""
    original = all("x_tent_original" in r["methods"]["adashadow"] for r in data["runs"])
    keys = ("x_inference", "x_tent") + (("x_tent_original",) if original else ())
    lines = ["| model | AdaShadow ms | × inference | × Tent (with reforward) | "
             + ("× Tent (original) | " if original else "") + "units updated |",
             "|---|---:|---:|---:|" + ("---:|" if original else "") + "---:|"]
    for run in data["runs"]:
        m = run["methods"]["adashadow"]
        ratios = " | ".join(with_interval(m, k) for k in keys)
        lines.append(f"| {run['arch']} {run['image_size']} px, batch {run['batch_size']} | "
                     f"{m['median_ms']:.1f} | {ratios} | {m['units_updated_median']:g} |")
    lines += ["", f"{data['device']}, {data['threads']} threads, median of {data['batches']} "
              "batches, one interleaved run, 95 % bootstrap interval over its rounds in "
              "brackets ([all methods and phases](docs/results/paper_ratios.md))."]
    return "\n".join(lines)


def gpu_table(data: dict) -> str:
    """README's GPU table: the GPU check's latency run (gpu/paper_ratios.json), with its
    memory and served-forward figures (gpu/gpu_figures.json) when present."""
    original = all("x_tent_original" in m for r in data["runs"] for m in r["methods"].values())
    keys = ("x_inference", "x_tent") + (("x_tent_original",) if original else ())
    lines = ["| model | method | ms | × inference | × Tent (with reforward) | "
             + ("× Tent (original) | " if original else "") + "units updated | "
             "batches adapted |", "|---|---|---:|---:|---:|" + ("---:|" if original else "")
             + "---:|---:|"]
    for run in data["runs"]:
        model = f"{run['arch']} {run['image_size']} px, batch {run['batch_size']}"
        for label, m in run["methods"].items():
            # a run before the two Tents: its "tent" was tent with the reforward
            label = "tent (with reforward)" if label == "tent" else label
            ratios = " | ".join(with_interval(m, k) for k in keys)
            lines.append(f"| {model} | {label} | {m['median_ms']:.1f} | {ratios} | "
                         f"{m['units_updated_median']:g} | {m['adapted_share']:.0%} |")
    lines += ["", f"{data['device']}, eager PyTorch in float32, median of {data['batches']} "
              "batches after each method's warm-up, one interleaved run ([phases]"
              f"(docs/results/{GPU}/paper_ratios.md), `bash benchmarks/gpu_check.sh`)."]
    for run in data["runs"]:  # same paragraph: why AdaShadow left batches unadapted
        why = run["methods"].get("adashadow", {}).get("no_room", "")
        if why:
            lines.append(f"AdaShadow at its default σ, {run['arch']}: {why}.")
    figures = RESULTS / GPU / "gpu_figures.json"
    if figures.exists():
        f = json.loads(figures.read_text())
        mem = "; ".join(f"{k} {v['saved_mib']:.1f} MiB in {v['step_ms']:.1f} ms"
                        for k, v in f["memory"].items())
        sf = f["served_forward"]
        lines += [f"Saved activations of one update and its step time ({f['arch']} "
                  f"{f['image_size']} px, batch {f['batch_size']}): {mem}. Served forward: "
                  f"eager {sf['eager_ms']:.2f} ms, torch.compile with CUDA graphs "
                  f"{sf.get('compiled_ms', float('nan')):.2f} ms."]
    return "\n".join(lines)


def demo(data: dict) -> str:
    """README's demo figures: the demo page's tables."""
    return renderer(page_for("demo"))(data).rstrip("\n")


def sweep_table(data: dict) -> str:
    """README's accuracy table: the readme sweep's page."""
    return renderer(page_for("sweep_readme"))(data).rstrip("\n")


#: README blocks: name -> (results JSON stem, render), between the markers of `markers`
README_BLOCKS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "headline": ("paper_ratios", headline), "demo": ("demo", demo),
    "sweep": ("sweep_readme", sweep_table), "gpu": ("gpu/paper_ratios", gpu_table)}


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- results:{name} begin (generated by python benchmarks/results.py) -->",
            f"<!-- results:{name} end -->")


def readme_with_block(text: str, name: str, block: str) -> str:
    """README text with the block between `name`'s markers replaced by `block`."""
    begin, end = markers(name)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{begin}\n{block}\n{end}", text)


def readme_blocks(text: str, folder: Path) -> str:
    """README text with every block whose markers it has regenerated from its JSON."""
    for name, (stem, render) in README_BLOCKS.items():
        if markers(name)[0] in text:
            data = json.loads((folder / f"{stem}.json").read_text())
            text = readme_with_block(text, name, render(data))
    return text


def expected_files(folder: Path = RESULTS, readme: Path = README) -> dict[Path, str]:
    """Every generated file and the text it should have."""
    found = [*folder.glob("*.json"), *folder.glob(f"{GPU}/*.json")]
    stems = sorted(str(p.relative_to(folder).with_suffix("")) for p in found
                   if page_for(p.stem))
    files = {folder / f"{s}.md": render_page(s, json.loads((folder / f"{s}.json").read_text()))
             for s in stems}
    files[folder / "README.md"] = index(stems)
    if readme.exists():
        files[readme] = readme_blocks(readme.read_text(), folder)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 naming every stale file")
    args = ap.parse_args(argv)
    stale = []
    for path, text in expected_files().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
