"""Every paper on a user's own torchvision net, CLI only: MobileNetV3-small (10 classes,
64 px) from a factory module outside the zoo, trained briefly here on clean synthetic signs
written as a folder; `tta model-card`, then `tta prepare` (profile, calibration, corruption
encoder, DARDA bundle, gated master with every conv gated) on those images, then one
`tta bench` on a shifted folder stream (other signs under 4 corruptions): source, bn_adapt,
AdaShadow at the camera deadline (30 Hz: a batch of b frames within b / 30 s), darda (the
robot extension) and darda:variant=full from the bundle, the gated master served at 3
sizes.

    python benchmarks/domains/bench_own_model.py [--work runs/own_model] [--epochs 12]

Every step is cached in --work (the trained weights, prepare's manifest); writes
docs/results/own_model.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness

from tta_core.data.corruptions import corrupt_batch
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.model.user_card import NORM_PRESETS

FACTORY = '''import torchvision


def mobilenet(num_classes=10):
    return torchvision.models.mobilenet_v3_small(num_classes=num_classes)
'''
CLASSES = 10
SIZE = 64
STREAM = ("shot_noise", "defocus_blur", "contrast", "jpeg_compression")
TRAINING = "shot_noise,impulse_noise,defocus_blur,contrast,pixelate,jpeg_compression"
SIZES = (1.0, 0.7, 0.5)  # of elastic's default sizes
PREPARE = ("calibrate.quick=true", "encoder.steps=100", "darda.samples=96",
           "darda.epochs=2", "elastic.gate_scope=all", "elastic.stage_epochs=1",
           "elastic.warmup_epochs=1", "elastic.stages=(0.3,0.5)", "elastic.batch_size=64",
           "elastic.calibration_samples=256")


def _write_folder(root: Path, images: np.ndarray, labels: np.ndarray,
                  names: tuple[str, ...]) -> None:
    for i, (im, y) in enumerate(zip(images, labels, strict=True)):
        d = root / names[int(y)]
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(d / f"{i:05d}.png")


def _tta(work: Path, *argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tta_core.cli", *argv], capture_output=True,
                          text=True, env=env, cwd=work)
    if proc.returncode:
        raise SystemExit(f"tta {argv[0]} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def _train(work: Path, images: np.ndarray, labels: np.ndarray, epochs: int,
           threads: int) -> float:
    """The user's own training (AdamW, random flips off: signs have a handedness); the
    held-out fifth's accuracy."""
    sys.path.insert(0, str(work))
    import userzoo

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = userzoo.mobilenet(num_classes=CLASSES)
    x = images_to_tensor(images, *NORM_PRESETS["imagenet"])
    y = torch.as_tensor(labels)
    n = len(y) * 4 // 5
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=epochs * (n // 64 + 1))
    gen = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, 64):
            idx = perm[i:i + 64]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x[n:]).argmax(1) == y[n:]).float().mean().item()
    torch.save(model.state_dict(), work / "user.pt")
    return acc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("runs/own_model"))
    ap.add_argument("--train", type=int, default=4000, help="clean training images")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--stream", type=int, default=200, help="frames per shifted domain")
    ap.add_argument("--severity", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "userzoo.py").write_text(FACTORY)
    total = harness.Stopwatch().start()
    names = tuple(make_signs(CLASSES, SIZE, seed=3, num_classes=CLASSES).class_names[:CLASSES])
    record = work / "train.json"
    if not record.is_file():  # the images are rendered and the net trained once
        signs = make_signs(args.train, SIZE, seed=3, num_classes=CLASSES)
        _write_folder(work / "clean" / "clean", signs.images, signs.labels, names)
        test = make_signs(args.stream * len(STREAM), SIZE, seed=77, num_classes=CLASSES)
        for j, c in enumerate(STREAM):
            rows = slice(j * args.stream, (j + 1) * args.stream)
            _write_folder(work / "stream" / f"{j}_{c}",
                          corrupt_batch(test.images[rows], c, args.severity, j),
                          test.labels[rows], names)
        acc = _train(work, signs.images, signs.labels, args.epochs, args.threads)
        record.write_text(json.dumps({"clean_accuracy": acc, "epochs": args.epochs}))
    trained = json.loads(record.read_text())
    card = work / "user.json"
    _tta(work, "model-card", "--model", "userzoo:mobilenet", "--weights", str(work / "user.pt"),
         "--input-size", str(SIZE), "--norm", "imagenet", "--class-names", ",".join(names),
         "--out", str(card))
    prep = work / "prep"
    sets = [a for s in (*PREPARE, f"elastic.threads={args.threads}") for a in ("--set", s)]
    with harness.Stopwatch() as prepared:
        _tta(work, "prepare", "--model-card", str(card), "--data", f"folder:{work / 'clean'}",
             "--corruptions", TRAINING, "--out", str(prep), "--no-progress",
             "--threads", str(args.threads), *sets)
    master = prep / "elastic.json"
    methods = ["source", "bn_adapt", "adashadow", "darda", "darda@full",
               *(f"elastic@keep{round(100 * s)}" for s in SIZES)]
    bench = [f"adashadow.profile={prep / 'profile.json'}", "adashadow.deadline_mode=camera",
             f"darda@full.bundle_path={prep / 'darda.safetensors'}", "darda@full.variant=full"]
    for s in SIZES:
        bench += [f"elastic@keep{round(100 * s)}.master_card={master}",
                  f"elastic@keep{round(100 * s)}.keep={s:g}"]
    out = work / "bench"
    _tta(work, "bench", "--model-card", str(card), "--data", f"folder:{work / 'stream'}",
         "--methods", ",".join(methods), "--samples-per-domain", str(args.stream),
         "--batch-size", str(args.batch_size), "--threads", "1", "--out", str(out),
         "--no-progress", *[a for s in bench for a in ("--set", s)])
    report = json.loads((out / "report.json").read_text())
    rows = [{k: s.get(k) for k in ("method", "n_frames", "n_batches", "overall_accuracy",
                                   "adapted", "within_budget", "throughput_fps")}
            for s in report["summaries"]]
    manifest = json.loads((prep / "manifest.json").read_text())
    data = {"model": "torchvision mobilenet_v3_small", "classes": CLASSES, "size": SIZE,
            "train_images": args.train, "epochs": trained["epochs"],
            "clean_accuracy": trained["clean_accuracy"], "stream": list(STREAM),
            "severity": args.severity, "frames_per_domain": args.stream,
            "batch_size": args.batch_size, "prepare": list(PREPARE),
            "prepare_steps": sorted(manifest.get("steps", {})), "prepare_s": prepared.s,
            "seconds": total.lap_s(), "rows": rows}
    harness.save("own_model", data, args)
    print(render(data))
    return 0


def render(data: dict) -> str:
    """The page: the user's net, what prepare built, one row per method."""
    lines = [
        f"The user's {data['model']}: a factory module outside the zoo "
        f"(`userzoo:mobilenet`), {data['classes']} classes at "
        f"{data['size']} px, trained here for {data['epochs']} epochs on "
        f"{data['train_images']} clean synthetic signs written as a folder (held-out fifth: "
        f"{100 * data['clean_accuracy']:.1f} %). `tta prepare` built "
        f"{', '.join(data['prepare_steps']) or 'its steps'} from those images (this run "
        f"{data['prepare_s']:.0f} s: a step built before is skipped; options: "
        f"`{' '.join(data['prepare'])}`). Stream: other "
        f"signs under {', '.join(data['stream'])} at severity {data['severity']}, "
        f"{data['frames_per_domain']} frames each, batch {data['batch_size']}, 1 thread; "
        "AdaShadow at the camera deadline (30 Hz), elastic the gated master served at a "
        "pinned size (`keep`).", "",
        "| method | accuracy % | adapted % of batches | within budget % | frames/s |",
        "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        wb = r.get("within_budget")
        lines.append(f"| {r['method']} | {100 * r['overall_accuracy']:.1f} | "
                     f"{100 * (r.get('adapted') or 0):.0f} | "
                     f"{'–' if wb is None else f'{100 * wb:.0f}'} | "
                     f"{r.get('throughput_fps') or 0:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
