"""What ran and where it is written: the model's and data's identity, report.json's
`meta.ran`, and the report files with the bench's header.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tta_core.eval.bench_config import BenchConfig
from tta_core.eval.bench_inputs import Batch
from tta_core.eval.report import RunRecord, lr_markdown
from tta_core.eval.report_files import ReportFiles, write_report
from tta_core.eval.report_identity import samples_text
from tta_core.eval.saved_memory import saved_note
from tta_core.eval.shifts import shifts_markdown


def model_identity(cfg: BenchConfig) -> dict[str, Any]:
    """The model that ran: the --model spec and weights (path, sha256 prefix), or the model
    card and its checkpoint."""
    from tta_core.eval.report_identity import sha256_prefix
    from tta_core.model.source import find_card, load_card

    um = cfg.user_model
    if um is not None:
        w = Path(um.weights)
        return {"model": um.model, "weights": str(w.resolve()), "weights_sha256":
                sha256_prefix(w), "input_size": um.input_size, "kwargs": dict(um.kwargs)}
    path = find_card(cfg.model_card)
    card = load_card(path)
    ckpt = path.parent / card.checkpoint
    return {"model_card": str(cfg.model_card), "arch": card.arch,
            "weights": str(ckpt.resolve()), "weights_sha256": sha256_prefix(ckpt)}


def data_identity(cfg: BenchConfig) -> dict[str, Any]:
    """The data that ran: kind, folder and its content identity (file count, bytes, listing
    hash), or the synthetic stream's settings."""
    common = {"order": cfg.order, "severity": cfg.severity, "seed": cfg.seed,
              **({"corruptions": list(cfg.corruptions)} if cfg.corruptions else {})}
    if not cfg.data:
        return {"kind": "synthetic-signs", **common}
    from tta_core.data.sources import parse_data
    from tta_core.eval.report_identity import folder_identity

    spec = parse_data(cfg.data)
    out = {"kind": spec.kind, **folder_identity(spec.root), **common}
    if spec.kind == "bag":
        from tta_core.io.bag import bag_info

        out["labels"] = ("ground truth" if bag_info(spec.root).has_ground_truth else
                         "source predictions (accuracy = agreement with the unadapted model)")
    return out


def ran_meta(cfg: BenchConfig, stream: Sequence[Batch],
             left_out: dict[str, str]) -> dict[str, Any]:
    """report.json `meta.ran`: samples used, model, data, code version, methods left out."""
    from tta_core.eval.report_identity import code_version, samples_used

    domains = [b.domain for b in stream for _ in range(len(b.labels))]
    return {"samples": samples_used(domains, cfg.samples_per_domain),
            "model": model_identity(cfg), "data": data_identity(cfg),
            "code_version": code_version(), "methods_left_out": left_out}


def describe_inputs(cfg: BenchConfig) -> str:
    """The model and data of a bench, for the report header."""
    um = cfg.user_model
    model = (f"model card: {cfg.model_card}" if um is None else
             f"model: {um.model}, weights {um.weights}, {um.input_size} px")
    return f"{model}; data: {cfg.data or 'synthetic signs'}"


def write_bench(runs: list[RunRecord], out: Path, cfg: BenchConfig,
                clean_accuracy: float) -> tuple[ReportFiles, str]:
    """Write the report files; the markdown gets a header naming stream and model and a
    table of the learning rate each method ran with."""
    title = (f"tta bench — {cfg.order} stream, severity {cfg.severity}, batch {cfg.batch_size},"
             f" {cfg.mode}, seed {cfg.seed}"
             + (f", {cfg.precision}" if cfg.precision != "fp32" else ""))
    files = write_report(runs, out, title=title)
    text = files.markdown.read_text()
    clean = "–" if math.isnan(clean_accuracy) else f"{100 * clean_accuracy:.1f}%"
    ran = runs[0].meta.get("ran") if runs else None
    samples = (samples_text(ran["samples"]) if isinstance(ran, dict)
               else f"{cfg.samples_per_domain} samples per domain")
    head = (f"{describe_inputs(cfg)}; clean accuracy {clean}; "
            f"{samples}; torch threads {cfg.threads or 'all'}"
            + (f"; code {ran['code_version']}" if isinstance(ran, dict) else "") + "\n\n")
    text = (text.replace("Accuracy in %", head + "Accuracy in %", 1)
            + saved_note(cfg.measures_activations) + lr_markdown(runs)
            + shifts_markdown(runs))
    files.markdown.write_text(text)
    return files, text
