"""DARDA's offline phase on a user's folder (CIFAR-10-C layout): which rows are read (the
held-out corruptions never), the evaluation rows past a benchmark's block, one-line
errors; Eq. 9's two readings and Eq. 16's gradient by hand; the bundle's recorded
configuration and data round-tripping; `tta train-darda --data`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import CARD, ROOT
from torch import nn

from tta_core.darda.bundle import load_bundle, save_bundle
from tta_core.darda.offline import OfflineConfig, run_offline
from tta_core.darda.offline_data import folder_data, folder_rows, meta_fingerprint
from tta_core.darda.subnet import cm_loss, eq16_gradient
from tta_core.data.corruptions import CORRUPTIONS, HELD_OUT
from tta_core.errors import InputError
from tta_core.model.source import load_source

TRAIN3 = ("gaussian_noise", "fog", "contrast")


def _folder(root: Path, names: tuple[str, ...], n: int, classes: int = 22,
            seed: int = 0) -> Path:
    """A CIFAR-10-C layout folder: random images, block rows tagged so a test can tell
    which rows were read (pixel [0, 0, 0] = row index % 251)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    labels = np.tile(rng.integers(0, classes, n), 5)
    np.save(root / "labels.npy", labels)
    for name in names:
        arr = rng.integers(0, 256, (5 * n, 32, 32, 3), dtype=np.uint8)
        arr[:, 0, 0, 0] = np.arange(5 * n) % 251
        np.save(root / f"{name}.npy", arr)
    return root


def _unnormalise(x: torch.Tensor, card) -> np.ndarray:
    m = torch.tensor(card.mean).view(1, 3, 1, 1)
    s = torch.tensor(card.std).view(1, 3, 1, 1)
    return torch.round((x * s + m) * 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_eq9_diagonal_and_off_diagonal_by_hand() -> None:
    s = torch.eye(2)
    c = torch.tensor([[0.6, 0.8], [1.0, 0.0]])  # S.C^T = [[.6, 1], [.8, 0]]
    assert float(cm_loss(s, c)) == pytest.approx(math.exp(-0.6) + math.exp(0.0))  # i = j
    assert float(cm_loss(s, c, "off_diagonal")) == pytest.approx(math.exp(-1.0)
                                                                 + math.exp(-0.8))  # printed
    with pytest.raises(ValueError, match="pairs"):
        cm_loss(s, c, "same")


class _Unit(nn.Module):
    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return F.normalize(f, dim=-1)


def test_eq16_gradient_by_hand_and_zero_at_the_floor() -> None:
    """F = W[:, 0] + b (logits on the noise e1), S = F / |F|, C_bar = (0.6, 0):
    dL/dF = -L (I - S S^T) C_bar / |F|; with S along C_bar the loss is at its floor
    exp(-|C_bar|) and the gradient is 0."""
    lin = nn.Linear(2, 2)
    params = [lin.weight, lin.bias]
    noise, c_bar = torch.tensor([[1.0, 0.0]]), torch.tensor([0.6, 0.0])
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.0, 5.0], [1.0, 7.0]]))
        lin.bias.zero_()
    for p in params:
        p.requires_grad_(False)
    probe = eq16_gradient(lin, params, _Unit(), noise, c_bar)
    # S = (0, 1): L = 1, dL/dF = (-0.6, 0) on W[:, 0] and on b, 0 on W[:, 1]
    assert probe.loss == pytest.approx(1.0) and probe.dot == pytest.approx(0.0)
    assert probe.floor == pytest.approx(math.exp(-0.6))
    assert probe.grad_norm == pytest.approx(math.sqrt(2 * 0.36), rel=1e-6)
    assert not any(p.requires_grad for p in params) and lin.weight.grad is None
    with torch.no_grad():
        lin.weight[:, 0] = torch.tensor([2.0, 0.0])  # S = (1, 0), along C_bar
    at_floor = eq16_gradient(lin, params, _Unit(), noise, c_bar)
    assert at_floor.loss == pytest.approx(at_floor.floor) and at_floor.grad_norm < 1e-7


def test_offline_config_refuses_held_out_and_unknown_corruptions() -> None:
    for bad, msg in (((*TRAIN3, "spatter"), "held-out corruption 'spatter'"),
                     (("fog", "sunburn"), "unknown corruption 'sunburn'"),
                     (("fog", "fog"), "distinct")):
        with pytest.raises(ValueError, match=msg):
            OfflineConfig(corruptions=bad).validate()
    with pytest.raises(ValueError, match="cm_pairs"):
        OfflineConfig(cm_pairs="same").validate()


def test_folder_rows_fit_first_evaluate_next_and_never_read_held_out(tmp_path) -> None:
    _, card = load_source(CARD)
    root = _folder(tmp_path / "c", TRAIN3, n=20)
    for name in HELD_OUT:  # not .npy at all: reading one would fail
        (root / f"{name}.npy").write_bytes(b"not an array")
    assert folder_rows(root, TRAIN3) == 20
    data = folder_data(root, TRAIN3, 12, 6, 3, 32, card.mean, card.std, card.class_names)
    tags = _unnormalise(data.train.x, card)[:, 0, 0, 0]
    # severity 3: block rows 40..59; fitting 40..51, evaluation 52..57, per corruption
    assert tags.tolist() == list(range(40, 52)) * 3
    assert _unnormalise(data.held.x, card)[:, 0, 0, 0].tolist() == list(range(52, 58)) * 3
    assert data.train.d.tolist() == [0] * 12 + [1] * 12 + [2] * 12
    labels = np.load(root / "labels.npy")
    assert data.train.y[:12].tolist() == labels[40:52].tolist()
    assert data.source["fit_rows"] == [0, 12] and data.source["eval_rows"] == [12, 18]
    assert data.source["eval_from"] == "file" and data.source["meta_fingerprint"] == ""
    with pytest.raises(ValueError, match="held-out corruption 'saturate'"):
        folder_data(root, ("fog", "saturate"), 4, 4, 5, 32, card.mean, card.std)
    big = folder_data(root, TRAIN3, 4, 2, 5, 48, card.mean, card.std)  # resized
    assert tuple(big.train.x.shape) == (12, 3, 48, 48)


def test_folder_errors_are_one_line(tmp_path) -> None:
    _, card = load_source(CARD)
    root = _folder(tmp_path / "c", ("fog",), n=10)
    cases = [(tmp_path / "none", TRAIN3, 4, "folder not found"),
             (root, ("fog", "contrast"), 4, "contrast.npy not found"),
             (root, ("fog", "fog2"), 11, "--samples 11 but fog.npy holds 10 rows"),
             (root, ("fog",), 8, "no benchmark made by tta")]  # 8 + 4 > 10, no test.npy
    for where, names, samples, msg in cases:
        with pytest.raises(InputError) as exc:
            folder_data(where, names, samples, 4, 5, 32, card.mean, card.std)
        assert msg in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(InputError, match="labels reach"):
        folder_data(root, ("fog",), 4, 4, 5, 32, card.mean, card.std, ("a", "b"))


def test_evaluation_rows_past_the_block_are_a_larger_benchmarks_rows(tmp_path) -> None:
    from tta_core.data.benchmark import BenchmarkConfig, generate

    _, card = load_source(CARD)
    names = ("fog", "contrast")
    small, large = tmp_path / "small", tmp_path / "large"
    for root, n in ((small, 10), (large, 16)):
        generate(root, BenchmarkConfig(train=4, test=20, per_corruption=n, corruptions=names),
                 workers=1, progress=False)
    data = folder_data(small, names, 10, 6, 5, 32, card.mean, card.std, card.class_names)
    assert data.source["eval_from"].startswith("test.npy")
    meta = json.loads((small / "meta.json").read_text())
    assert data.source["meta_fingerprint"] == meta_fingerprint(meta) != ""
    assert data.source["benchmark_config"]["per_corruption"] == 10
    ref = folder_data(large, names, 10, 6, 5, 32, card.mean, card.std, card.class_names)
    assert ref.source["eval_from"] == "file"
    assert torch.equal(data.held.x, ref.held.x) and torch.equal(data.held.y, ref.held.y)
    assert torch.equal(data.train.x, ref.train.x)


TINY3 = OfflineConfig(corruptions=TRAIN3, samples=8, eval_samples=8, epochs=1, batch=8,
                      noise_count=2, s_hidden=8, s_steps=20, encoder_steps=2, threads=1,
                      probe_batch=4)


def test_bundle_records_config_and_data_and_they_round_trip(tmp_path) -> None:
    torch.set_num_threads(1)
    model, card = load_source(CARD)
    root = _folder(tmp_path / "c", TRAIN3, n=16)
    data = folder_data(root, TRAIN3, 8, 8, 5, 32, card.mean, card.std, card.class_names)
    off = run_offline(model, 32, tuple(card.mean), tuple(card.std), TINY3, data=data)
    eq16 = off.report["s"]["eq16"]
    assert eq16["batches"] == 6 and eq16["grad_norm"] > 0 and math.isfinite(eq16["loss"])
    assert eq16["loss"] >= eq16["floor"] - 1e-6
    picked_own = eq16["pick_own"] * eq16["batches"]  # a share of its 6 batches
    assert picked_own == pytest.approx(round(picked_own)), eq16["pick_own"]
    if eq16["pick_own"] == 1.0:  # every batch on its own sub-network: the own accuracy
        assert eq16["picked_accuracy"] == pytest.approx(eq16["own_accuracy"])
    assert off.report["raw_s"]["eq16"]["grad_norm"] > 0
    path = tmp_path / "b.safetensors"
    save_bundle(off, model, path)
    back = load_bundle(path, model)
    assert back.offline_config() == TINY3 and back.config == TINY3.to_dict()
    assert back.data == off.data and back.data["corruptions"] == list(TRAIN3)
    assert back.data["samples_per_corruption"] == dict.fromkeys(TRAIN3, 8)
    assert back.data["own_accuracy"] == dict(zip(TRAIN3, off.accuracy.diagonal().tolist(),
                                                 strict=True))
    assert back.data["source"]["kind"] == "cifar10c"
    assert back.data["source"]["root"] == str(root.resolve())
    assert back.report["s"]["eq16"] == eq16


def test_a_bundle_without_recorded_config_still_loads() -> None:
    model, _ = load_source(CARD)
    shipped = ROOT / "checkpoints" / "small_resnet_signs32_darda.safetensors"
    off = load_bundle(shipped, model)
    assert len(off.names) == 15
    if not off.config:  # written before the offline config was recorded
        assert off.offline_config() is None and off.data == {}


def test_train_darda_data_flag_end_to_end(tmp_path, capsys) -> None:
    from tta_core.cli import main

    root = _folder(tmp_path / "c", CORRUPTIONS, n=6)
    out = tmp_path / "b.safetensors"
    tiny = ["--epochs", "1", "--batch", "8", "--noise-count", "2", "--s-hidden", "8",
            "--s-steps", "5", "--encoder-steps", "2", "--threads", "1", "--eval-samples",
            "2", "--probe-batch", "2", "--cm-pairs", "off_diagonal"]
    assert main(["train-darda", "--data", f"cifar10c:{root}", "--out", str(out), *tiny]) == 0
    text = capsys.readouterr().out
    assert "Eq. 16 at the pick" in text and "offline config: " in text
    model, _ = load_source(CARD)
    back = load_bundle(out, model)
    assert back.config["samples"] == 4 and back.config["cm_pairs"] == "off_diagonal"  # 6 - 2
    assert back.data["source"]["root"] == str(root.resolve())
    printed = json.loads(text.split("offline config: ")[1].splitlines()[0])
    assert printed == back.config
    (root / "fog.npy").unlink()
    with pytest.raises(SystemExit) as exc:
        main(["train-darda", "--data", f"cifar10c:{root}", "--out", str(out), *tiny])
    assert "fog.npy not found" in str(exc.value) and "\n" not in str(exc.value)


def test_eq9_readings_at_the_pick_on_a_tiny_setup() -> None:
    """i = j: S copies the centroids, Eq. 10 picks the own sub-network and Eq. 16 starts
    near its floor (a small, non-zero gradient); i != j (printed): S^i leaves its own
    centroid, so Eq. 10 over the signatures no longer picks the own sub-network, and at
    the nearest centroid's sub-network Eq. 16 sits well above its floor."""
    torch.set_num_threads(1)
    reps = {}
    for pairs in ("diagonal", "off_diagonal"):
        cfg = OfflineConfig(corruptions=("gaussian_noise", "fog", "contrast", "pixelate"),
                            samples=16, eval_samples=8, epochs=1, batch=8, noise_count=2,
                            s_hidden=8, s_steps=200, encoder_steps=30, threads=1,
                            probe_batch=4, cm_pairs=pairs)
        model, card = load_source(CARD)
        reps[pairs] = run_offline(model, 32, tuple(card.mean), tuple(card.std), cfg).report["s"]
    diag, off = reps["diagonal"], reps["off_diagonal"]
    assert diag["own_pick"] == 1.0 and diag["eq16"]["pick_own"] == 1.0
    assert diag["eq16"]["grad_norm"] > 0
    assert off["own_pick"] < 1.0 and off["eq16_centroid_pick"]["pick_own"] == 1.0
    gap = {k: r["eq16_centroid_pick"]["loss"] - r["eq16_centroid_pick"]["floor"]
           for k, r in reps.items()}
    assert gap["off_diagonal"] > 2 * gap["diagonal"] >= 0
    assert off["eq16_centroid_pick"]["grad_norm"] > 2 * diag["eq16_centroid_pick"]["grad_norm"]
