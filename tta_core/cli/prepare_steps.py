"""The steps of `tta prepare` (tta_core.cli.commands.prepare: what each builds, the
manifest, resuming), each a call of the library function the matching offline command
runs. Imported inside the command's run() only (torch)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tta_core.cli.offline_args import data_given
from tta_core.data.sources import LabelledImages, training_corruptions
from tta_core.io.strict_json import dumps as json_dumps
from tta_core.io.strict_json import write_json
from tta_core.model.source import ModelCard, find_card, load_card

MANIFEST = "manifest.json"
PARTIAL = ".partial"
OUTPUTS: dict[str, tuple[str, ...]] = {
    "profile": ("profile.json",), "calibrate": ("calibration.json",),
    "encoder": ("corruption_encoder.safetensors",), "darda": ("darda.safetensors",),
    "elastic": ("elastic.json", "elastic.safetensors"), "vehicle": ("vehicle.yaml",)}
# steps whose files another step reads (their checksums enter its key); the vehicle file
# names the artifacts' paths only, so a rebuilt artifact leaves it as it is
NEEDS: dict[str, tuple[str, ...]] = {"darda": ("encoder",)}
# steps whose key covers the data (profile and calibrate time the model on a batch of it)
USES_DATA = ("profile", "calibrate", "encoder", "darda", "elastic")
# the method options of `tta bench --set` / the perception node that read each artifact
METHOD_OPTIONS: dict[str, tuple[str, str, str]] = {
    "profile": ("adashadow", "profile", "profile.json"),
    "darda": ("darda", "bundle_path", "darda.safetensors"),
    "elastic": ("elastic", "master_card", "elastic.json")}


@dataclass
class PrepareResult:
    """What each step did, and the method options that read the artifacts."""

    states: dict[str, str] = field(default_factory=dict)
    method_options: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass
class Context:
    """What every step reads: the card, the data (read once, on first use), the options."""

    args: argparse.Namespace
    card_path: Path
    card: ModelCard
    out: Path
    options: dict[str, dict[str, Any]]
    _images: LabelledImages | None = None

    @property
    def progress(self) -> bool:
        return not self.args.no_progress

    def images(self) -> LabelledImages:
        """The clean labelled images of --data (all of them), read once."""
        if self._images is None:
            from tta_core.cli.offline_inputs import labelled_images

            data = self.args.data if data_given(self.args) else "signs"
            self._images = labelled_images(data, self.card, 0, 0)
        return self._images

    def corruptions(self) -> tuple[str, ...]:
        return training_corruptions(self.args.corruptions, self.args.held_out)

    def bar(self, step: str, total: int) -> tqdm:
        return tqdm(total=total, desc=f"{step}: corrupting", unit="corruption",
                    disable=not self.progress, leave=False)


def sha256(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def data_fingerprint(text: str) -> str:
    """SHA-256 over the data folder's listing (relative path, size, mtime of every file;
    'signs' for the built-in signs): a changed, added or removed file changes it."""
    if text in ("", "signs"):
        return "signs"
    root = Path(text.partition(":")[2]).expanduser()
    h = hashlib.sha256(text.partition(":")[0].encode())
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


#: `tta prepare`'s elastic step: the share of the label loss from the user's net, and Θ*'s
#: share K/N (`tta train-elastic` keeps the paper's pre-training: labels, K = N/4)
PREPARE_ELASTIC_TEACHER = 1.0
PREPARE_ELASTIC_KNOWLEDGE = 1.0


def _defaults(step: str, ctx: Context) -> dict[str, Any]:
    """The options of `step` before --set (its config's fields and defaults)."""
    threads = ctx.args.threads
    if step == "profile":
        return {"batch_size": 4, "repeats": 5, "split": "plans", "bn_mode": "batch",
                "threads": threads}
    if step == "calibrate":
        return {"quick": False, "threads": 0, "batch_size": 4}
    if step == "encoder":
        from tta_core.domain.encoder import EncoderConfig

        return {**dataclasses.asdict(EncoderConfig()), "threads": threads,
                "severity": ctx.args.severity}
    if step == "darda":
        from tta_core.darda.offline import OfflineConfig

        d = dataclasses.asdict(OfflineConfig())
        d.pop("corruptions")
        return {**d, "threads": threads, "severity": ctx.args.severity}
    if step == "elastic":
        from tta_core.elasticdnn.train import ElasticTrainConfig

        d = dataclasses.asdict(ElasticTrainConfig())
        for k in ("source_card", "knowledge_only", "checkpoint_dir", "init_checkpoint"):
            d.pop(k)
        # the user's net is the master's teacher (every pass's label loss from its output)
        # and Θ* has one relevance per filter (the tie asks no lower rank of the filters):
        # both keep the gated master as robust to a shift as the net it comes from
        return {**d, "teacher": PREPARE_ELASTIC_TEACHER,
                "knowledge": PREPARE_ELASTIC_KNOWLEDGE, "threads": threads}
    return {}


def step_options(step: str, ctx: Context) -> dict[str, Any]:
    """`step`'s defaults updated by --set; ValueError naming an unknown key."""
    opts = _defaults(step, ctx)
    given = ctx.options.get(step, {})
    unknown = sorted(set(given) - set(opts))
    if unknown:
        raise ValueError(f"--set {step}.{unknown[0]}: unknown option of step {step!r}; "
                         f"known: {', '.join(sorted(opts))}")
    return {**opts, **given}


def _key(step: str, ctx: Context, opts: dict[str, Any], manifest: dict) -> str:
    """SHA-256 over what `step` is built from (module doc)."""
    parts: dict[str, Any] = {"step": step, "options": opts}
    if step != "vehicle":
        parts["card"] = sha256(ctx.card_path)
        parts["weights"] = sha256(ctx.card_path.parent / ctx.card.checkpoint)
    if step in USES_DATA:
        parts["data"] = data_fingerprint(ctx.args.data if data_given(ctx.args) else "signs")
        parts["corruptions"] = list(ctx.corruptions())
    if step == "vehicle":
        parts["card"] = str(ctx.card_path.resolve())
        parts["out"] = str(ctx.out.resolve())
        parts["methods"] = list(ctx.args.methods)
    parts["needs"] = {n: manifest["steps"].get(n, {}).get("files", {})
                      for n in NEEDS.get(step, ())}
    return hashlib.sha256(json_dumps(parts, sort_keys=True).encode()).hexdigest()


def _done(entry: dict | None, key: str, out: Path, step: str) -> bool:
    """Whether the manifest's entry of `step` matches `key` and every file it wrote is
    there with its checksum."""
    if not entry or entry.get("key") != key:
        return False
    files = entry.get("files", {})
    return all(name in files and (out / name).is_file() and sha256(out / name) == files[name]
               for name in OUTPUTS[step])


def load_manifest(out: Path) -> dict:
    """out/manifest.json, or an empty one (no file, or one that is not a manifest)."""
    path = out / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"steps": {}}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("steps"), dict):
        return {"steps": {}}
    return manifest


def save_manifest(out: Path, manifest: dict) -> None:
    """Write the manifest atomically (strict JSON, a temporary file renamed over it)."""
    write_json(out / MANIFEST, manifest)


def _build(step: str, ctx: Context, opts: dict[str, Any]) -> dict[str, str]:
    """Build `step` into out/.partial/<step>, move its files into place; their SHA-256."""
    tmp = ctx.out / PARTIAL / step
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    BUILDERS[step](ctx, tmp, dict(opts))
    files = {}
    for name in OUTPUTS[step]:
        os.replace(tmp / name, ctx.out / name)
        files[name] = sha256(ctx.out / name)
    shutil.rmtree(tmp, ignore_errors=True)
    return files


def prepare(args: argparse.Namespace, steps: tuple[str, ...],
            options: dict[str, dict[str, Any]]) -> PrepareResult:
    """Build every step not done already (module doc of the command), in order."""
    card_path = find_card(args.model_card)
    ctx = Context(args, card_path, load_card(card_path), args.out, options)
    ctx.out.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(ctx.out)
    manifest["card"] = str(card_path.resolve())
    result = PrepareResult()
    for step in tqdm(steps, desc="prepare", unit="step", disable=not ctx.progress):
        opts = step_options(step, ctx)
        key = _key(step, ctx, opts, manifest)
        if _done(manifest["steps"].get(step), key, ctx.out, step):
            result.states[step] = "skipped (done: key and checksums match)"
            continue
        t0 = time.perf_counter()
        files = _build(step, ctx, opts)
        seconds = round(time.perf_counter() - t0, 1)
        manifest["steps"][step] = {"key": key, "files": files, "options": opts,
                                   "seconds": seconds}
        save_manifest(ctx.out, manifest)
        result.states[step] = f"built in {seconds:g} s"
    for step, (method, option, name) in METHOD_OPTIONS.items():
        if step in steps:
            result.method_options[method] = {option: str((ctx.out / name).resolve())}
    shutil.rmtree(ctx.out / PARTIAL, ignore_errors=True)
    return result


# ------------------------------------------------------------------ the steps


def _profile(ctx: Context, tmp: Path, opts: dict[str, Any]) -> None:
    import torch

    from tta_core.adashadow.profiler import profile_model
    from tta_core.cli.offline_inputs import batch_of
    from tta_core.model.norms import set_bn_mode
    from tta_core.model.source import load_source
    from tta_core.model.units import decompose

    if opts["threads"] > 0:
        torch.set_num_threads(opts["threads"])
    model, card = load_source(ctx.card_path)
    set_bn_mode(model, opts["bn_mode"])
    staged = decompose(model, (3, *card.input_hw), card.arch)
    prof = profile_model(staged, repeats=opts["repeats"], split=opts["split"],
                         inputs=batch_of(ctx.images(), card, opts["batch_size"]))
    prof.save(tmp / "profile.json")


def _calibrate(ctx: Context, tmp: Path, opts: dict[str, Any]) -> None:
    """The device constants, timed on the card's model's forward on a batch of the data."""
    from tta_core.adashadow.calibration import CalibrationConfig, calibrate, forward_fn, n_steps
    from tta_core.cli.offline_inputs import batch_of
    from tta_core.model.source import load_source

    model, card = load_source(ctx.card_path)
    batch = opts.pop("batch_size")
    work = forward_fn(model, batch_of(ctx.images(), card, batch))
    base = CalibrationConfig.quick() if opts.pop("quick") else CalibrationConfig()
    cfg = dataclasses.replace(base, threads=opts.pop("threads") or base.threads, **opts)
    with tqdm(total=n_steps(cfg), desc="calibrate", disable=not ctx.progress,
              leave=False) as bar:
        def tick(msg: str) -> None:
            bar.set_postfix_str(msg)
            bar.update(1)

        report = calibrate(cfg, progress=tick, workload=work,
                           workload_name=f"forward of {ctx.card_path.name} at batch {batch} "
                                         f"on the prepared data's images")
    report.save(tmp / "calibration.json")


def _encoder(ctx: Context, tmp: Path, opts: dict[str, Any]) -> None:
    from tta_core.cli.offline_inputs import encoder_data
    from tta_core.darda.encoder import train_encoder
    from tta_core.domain.encoder import EncoderConfig, save_encoder

    cfg = EncoderConfig(**opts)
    corr = ctx.corruptions()
    with ctx.bar("encoder", len(corr)) as bar:
        data = encoder_data(ctx.images(), corr, cfg.samples, cfg.severity, cfg.seed,
                            ctx.card, lambda c: bar.update(1))
    enc, _ = train_encoder(cfg, tuple(ctx.card.mean), tuple(ctx.card.std), 0, data=data)
    save_encoder(enc, tmp / "corruption_encoder.safetensors")


def _darda(ctx: Context, tmp: Path, opts: dict[str, Any]) -> None:
    from tta_core.cli.offline_inputs import darda_data
    from tta_core.darda.bundle import save_bundle
    from tta_core.darda.offline import OfflineConfig, run_offline
    from tta_core.domain.encoder import load_encoder
    from tta_core.model.source import load_source

    model, card = load_source(ctx.card_path)
    cfg = OfflineConfig(corruptions=ctx.corruptions(), **opts)
    cfg.validate()
    with ctx.bar("darda", 2 * len(cfg.corruptions)) as bar:
        data = darda_data(ctx.images(), cfg.corruptions, cfg.samples, cfg.eval_samples,
                          cfg.severity, cfg.seed, card, lambda c: bar.update(1))
    enc = load_encoder(ctx.out / OUTPUTS["encoder"][0])
    off = run_offline(model, card.image_size, tuple(card.mean), tuple(card.std), cfg, enc,
                      log=ctx.progress, data=data)
    off.report["card"] = card.name
    save_bundle(off, model, tmp / "darda.safetensors")


def _elastic(ctx: Context, tmp: Path, opts: dict[str, Any]) -> None:
    from tta_core.cli.offline_inputs import elastic_data
    from tta_core.elasticdnn.knowledge import save_master
    from tta_core.elasticdnn.train import ElasticTrainConfig, train_master

    cfg = ElasticTrainConfig(source_card=ctx.card_path, **opts)
    cfg.validate()
    li = ctx.images()
    held = min(cfg.val_samples, max(1, len(li.labels) // 5))
    if cfg.train_samples + held < len(li.labels):  # at most train_samples to fit on
        rows = np.random.default_rng([cfg.seed, 3]).permutation(len(li.labels))
        li = li.take(np.sort(rows[:cfg.train_samples + held]))
    corr = ctx.corruptions()
    with ctx.bar("elastic", len(corr)) as bar:
        data = elastic_data(li, corr, ctx.args.severity, held, cfg.seed, ctx.card,
                            lambda c: bar.update(1))
    res = train_master(cfg, progress=ctx.progress, data=data)
    record = {"source_accuracy": res.source_accuracy, "tie_loss": res.tie_loss,
              "accuracy_by_sparsity": {f"{s:g}": a for s, a in res.accuracy.items()},
              "data": data.source, "steps": res.steps}
    save_master(res.master, tmp / "elastic", res.card, clean_accuracy=res.accuracy[0.0],
                metadata={"prepare": json_dumps(record)})


def _vehicle(ctx: Context, tmp: Path, opts: dict[str, Any]) -> None:
    """vehicle.yaml: the tta nodes' parameters with this folder's artifacts (module doc)."""
    out = ctx.out.resolve()
    methods = list(ctx.args.methods)
    option = {m: (o, str(out / n)) for s, (m, o, n) in METHOD_OPTIONS.items()
              if m in methods}
    first = methods[0]
    lines = [f"# Written by `tta prepare` for {ctx.card_path.resolve()}: the offline",
             f"# artifacts in {out} (manifest.json). Start the nodes with",
             f"#   python -m tta_ros.bringup --config {out / 'vehicle.yaml'}",
             "# and another method with --method NAME plus its line below. Every other",
             "# parameter keeps its default (config/vehicle.yaml lists them).",
             "/**:", "  ros__parameters:", f"    model_card: {ctx.card_path.resolve()}", "",
             "perception:", "  ros__parameters:", f"    method: {first}"]
    if first in option:
        lines.append(f"    method.{option[first][0]}: {option[first][1]}")
    for m in methods[1:]:
        if m in option:
            lines.append(f"    # method {m}: method.{option[m][0]}: {option[m][1]}")
    if "adashadow" in methods:
        lines += ["", "resource_monitor:", "  ros__parameters:",
                  f"    calibration: {out / 'calibration.json'}", "",
                  "scheduler:", "  ros__parameters:", f"    profile: {out / 'profile.json'}"]
    (tmp / "vehicle.yaml").write_text("\n".join(lines) + "\n")


BUILDERS: dict[str, Callable[[Context, Path, dict[str, Any]], None]] = {
    "profile": _profile, "calibrate": _calibrate, "encoder": _encoder, "darda": _darda,
    "elastic": _elastic, "vehicle": _vehicle}
