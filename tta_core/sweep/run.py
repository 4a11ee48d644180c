"""Running a sweep's cells as Ray tasks, each one `tta bench` in a worker process, with a
per-cell cache so that a rerun resumes.

A cell's result lives in `<out>/cells/<key>/result.json`, `key` a hash of the cell's bench
arguments, the identity of its data (content of a `--data` folder) and the code version:
the same cell on the same data and code is never run twice. Results are written by the
driver as each task finishes (tmp + rename), so a killed sweep loses only the cells in
flight. A cell that fails is recorded with its one-line error (`status: failed`) and the
others go on; `retry_failed` runs failed cells again. Each result names the Ray node that
ran it (`node`: id, IP, host name), so a sweep on a cluster says where each cell ran.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tta_core.errors import one_line
from tta_core.io.strict_json import write_json
from tta_core.sweep.spec import Cell

#: the report figures a cell keeps of each method's summary
KEEP = ("method", "n_frames", "mean_accuracy", "overall_accuracy", "within_budget",
        "adapted", "throughput_fps")


class _Refused(ValueError):
    """argparse's error as an exception (it would print and exit)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refused(message)


@dataclass(frozen=True)
class BenchCLI:
    """`tta bench`'s argument definitions and its options -> BenchConfig, handed in by the
    command layer (tta_core.cli.commands.bench) so the sweep never imports the CLI."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    config_from_args: Callable[[argparse.Namespace], Any]

    def parser(self) -> argparse.ArgumentParser:
        """Bench's own parser, raising instead of exiting."""
        parser = _Parser(prog="tta bench", add_help=False)
        self.add_arguments(parser)
        return parser

    def options(self) -> list[str]:
        """The option names a spec may use: bench's long options, underscored (`set`,
        `batch_size`, ...)."""
        return [o[2:].replace("-", "_") for a in self.parser()._actions
                for o in a.option_strings if o.startswith("--")]


def _data_identity(options: dict[str, Any], cwd: Path) -> dict[str, Any]:
    data = str(options.get("data") or "")
    if not data:
        return {"kind": "synthetic-signs"}
    from tta_core.eval.report_identity import folder_identity

    kind, _, root = data.partition(":")
    path = (cwd / Path(root).expanduser())
    return {"kind": kind, **(folder_identity(path) if path.is_dir() else {"missing": str(path)})}


def cell_key(cell: Cell, cwd: Path, code: str) -> str:
    """Hash of what decides a cell's result: its arguments, its data, the code version."""
    blob = json.dumps({"argv": cell.argv(), "data": _data_identity(cell.as_dict, cwd),
                       "code": code, "cwd": str(cwd)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def node() -> dict[str, str]:
    """The Ray node this process runs on: its id, IP and host name (empty outside Ray)."""
    import ray

    if not ray.is_initialized():
        return {}
    return {"id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}


def _segmentation_cell(args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    """A `--task segmentation` cell: the mIoU bench (eval.seg_bench), its per-method
    figures (mean mIoU, online error, cache MiB, mIoU per condition)."""
    from tta_core.eval.seg_bench import config_from_args, run_seg_bench, sweep_summaries

    results, _ = run_seg_bench(config_from_args(args), Path(out), progress=False)
    return sweep_summaries(results)


def run_cell(bench: BenchCLI, argv: Sequence[str], out: str, cwd: str) -> dict[str, Any]:
    """One bench run (in a Ray worker): the kept figures, or the one-line error, and the
    node that ran it; a `--task segmentation` cell runs the mIoU bench instead."""
    os.chdir(cwd)
    t0 = time.perf_counter()
    where = node()
    try:
        args = bench.parser().parse_args([*argv, "--no-progress"])
        if getattr(args, "task", "") == "segmentation":
            return {"status": "done", "node": where, "streaming": [],
                    "summaries": _segmentation_cell(args, out),
                    "seconds": time.perf_counter() - t0}
        from tta_core.eval.bench_run import run_bench

        cfg = bench.config_from_args(args)
        with contextlib.redirect_stdout(io.StringIO()):
            run_bench(cfg, out, progress=False, log=lambda _line: None)
    except Exception as exc:  # any failure of the cell is its result
        return {"status": "failed", "error": one_line(exc), "seconds": time.perf_counter() - t0,
                "node": where}
    report = json.loads((Path(out) / "report.json").read_text())
    stream = Path(out) / "streaming.json"
    return {"status": "done", "seconds": time.perf_counter() - t0, "node": where,
            "summaries": [{k: s.get(k) for k in KEEP} for s in report["summaries"]],
            "streaming": ([{k: r[k] for k in ("method", "hz", "strict", "streaming",
                                              "answered", "deadline_met")}
                           for r in json.loads(stream.read_text())["runs"]]
                          if stream.exists() else [])}


@dataclass
class CellState:
    """A cell, its cache key and folder, and its result once known."""

    cell: Cell
    key: str
    folder: Path
    result: dict[str, Any] | None = None
    cached: bool = False


@dataclass
class SweepRun:
    """Every cell's state after a sweep, and how many ran now (the rest came from cache)."""

    cells: list[CellState] = field(default_factory=list)
    ran: int = 0

    @property
    def failed(self) -> list[CellState]:
        return [c for c in self.cells if c.result and c.result["status"] == "failed"]


def plan_cells(cells: Sequence[Cell], out: Path, code: str, cwd: Path,
               retry_failed: bool = False) -> SweepRun:
    """States of the cells, with the cached results loaded (failed ones dropped when
    retrying)."""
    run = SweepRun()
    for cell in cells:
        key = cell_key(cell, cwd, code)
        st = CellState(cell, key, out / "cells" / key)
        path = st.folder / "result.json"
        if path.exists():
            res = json.loads(path.read_text())
            if not (retry_failed and res.get("status") == "failed"):
                st.result, st.cached = res, True
        run.cells.append(st)
    return run


def _record(st: CellState, result: dict[str, Any]) -> None:
    st.result = {**result, "argv": st.cell.argv(), "options": st.cell.as_dict}
    write_json(st.folder / "result.json", st.result)


def init_ray(address: str, workers: int, cpus_per_cell: float) -> None:
    """Join `address` ('auto', 'ray://host:port') or start a local Ray with `workers` x
    `cpus_per_cell` CPUs (nothing to start by hand)."""
    import ray

    if ray.is_initialized():
        return
    opts: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                            "configure_logging": False}
    if address:
        ray.init(address=address, **opts)
    else:
        ray.init(num_cpus=max(1, int(workers * cpus_per_cell)), **opts)


def execute(run: SweepRun, bench: BenchCLI, cwd: Path, cpus_per_cell: float = 1.0,
            gpus_per_cell: float = 0.0,
            progress: Callable[[int, int, int], None] | None = None) -> SweepRun:
    """Run the cells without a result as Ray tasks; record each as it finishes."""
    import ray

    todo = [c for c in run.cells if c.result is None]
    if not todo:
        return run
    task = ray.remote(num_cpus=cpus_per_cell, num_gpus=gpus_per_cell,
                      max_retries=0)(run_cell)
    pending = {task.remote(bench, st.cell.argv(), str(st.folder / "bench"), str(cwd)): st
               for st in todo}
    for st in todo:
        st.folder.mkdir(parents=True, exist_ok=True)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        st = pending.pop(done[0])
        try:
            result = ray.get(done[0])
        except Exception as exc:  # the worker died (killed, out of memory)
            result = {"status": "failed", "error": one_line(exc)}
        _record(st, result)
        run.ran += 1
        if progress is not None:
            progress(run.ran, len(pending), len(run.failed))
    return run
