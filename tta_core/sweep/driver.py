"""One sweep end to end: spec -> cells -> cached or run on Ray -> aggregated report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tta_core.eval.report_identity import code_version
from tta_core.sweep.aggregate import aggregate, samples
from tta_core.sweep.report import write_report
from tta_core.sweep.run import BenchCLI, SweepRun, execute, init_ray, plan_cells
from tta_core.sweep.spec import load_spec


@dataclass
class SweepResult:
    """What a sweep did: cells run now, from cache, failed; files written; lines to print."""

    cells: int
    ran: int
    cached: int
    failed: int
    markdown: Path | None = None
    files: list[Path] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _bar(total: int, start: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="cell", disable=not show,
                desc="tta sweep", dynamic_ncols=True)


def sweep(spec_path: str | Path, bench: BenchCLI, out: str | Path | None = None, *,
          address: str = "",
          workers: int = 2, cpus_per_cell: float = 1.0, gpus_per_cell: float = 0.0,
          retry_failed: bool = False, list_only: bool = False,
          progress: bool = True) -> SweepResult:
    """Run (or resume) the sweep of `spec_path` into `out` and write its report."""
    spec = load_spec(spec_path, bench.options())
    folder = Path(out) if out else Path("runs") / f"sweep-{spec.name}"
    cwd = Path.cwd()
    run = plan_cells(spec.cells(), folder.resolve(), code_version(), cwd, retry_failed)
    cached = sum(c.cached for c in run.cells)
    if list_only:
        return SweepResult(len(run.cells), 0, cached, len(run.failed), lines=[
            f"{'cached' if c.cached else 'to run'} {c.key} tta bench {' '.join(c.cell.argv())}"
            for c in run.cells])
    folder.mkdir(parents=True, exist_ok=True)
    if cached < len(run.cells):
        init_ray(address, workers, cpus_per_cell)
        with _bar(len(run.cells), cached, progress) as bar:
            def tick(_ran: int, running: int, failed: int) -> None:
                bar.update(1)
                bar.set_postfix(running=running, failed=failed)

            execute(run, bench, cwd, cpus_per_cell, gpus_per_cell, tick)
    return _report(spec.name, spec.baseline, run, folder, cached)


def _report(name: str, baseline: str, run: SweepRun, folder: Path,
            cached: int) -> SweepResult:
    results = [c.result for c in run.cells if c.result is not None]
    rows = aggregate(samples(results), baseline)
    files = write_report(name, rows, baseline, results, folder)
    res = SweepResult(len(run.cells), run.ran, cached, len(run.failed), files[1], files)
    res.lines = [f"tta sweep {name}: {res.cells} cells, {res.ran} run now, {res.cached} "
                 f"from cache, {res.failed} failed", files[1].read_text().rstrip(),
                 "wrote " + ", ".join(str(f) for f in files)]
    return res
