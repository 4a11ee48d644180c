"""Every stream order on `--data` sources (issue #33, item 9): continual, mixed,
dirichlet, recurring and gradual on a CIFAR-10-C-layout folder give the expected domain
sequence and exactly the expected rows of the files; gradual on a folder layout (no
severities) is a one-line error; `tta bench --data ... --order recurring` runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tta_core.cli import main as cli_main
from tta_core.data.sources import DataSpec, load_data
from tta_core.data.streams import (
    GRADUAL_LEVELS,
    ORDERS,
    StreamSpec,
    build_stream,
    dirichlet_order,
)
from tta_core.errors import InputError

N = 12  # rows per severity


@pytest.fixture
def cifar10c(tmp_path: Path) -> Path:
    """fog and snow: row r of severity s holds the value (s, r) in its first pixel, so a
    stream's images say which rows they are."""
    root = tmp_path / "c10c"
    root.mkdir()
    np.save(root / "labels.npy", np.arange(5 * N) % 10)
    for k, name in enumerate(("fog", "snow")):
        arr = np.zeros((5 * N, 32, 32, 3), np.uint8)
        for s in range(5):
            for r in range(N):
                arr[s * N + r, 0, 0] = (s + 1, r, k)
        np.save(root / f"{name}.npy", arr)
    return root


def _rows(stream) -> list[tuple[int, int, int]]:
    """(severity, row, corruption index) of each image."""
    return [tuple(int(v) for v in im[0, 0]) for im in stream.images]


def _load(root: Path, order: str, samples: int = 8, seed: int = 0):
    return load_data(DataSpec("cifar10c", root), 32, 5, samples, seed, order)


def test_continual_is_the_standard_order_at_one_severity(cifar10c) -> None:
    st = _load(cifar10c, "continual")
    assert st.domains.tolist() == ["snow/5"] * 8 + ["fog/5"] * 8  # snow before fog
    assert _rows(st) == [(5, r, 1) for r in range(8)] + [(5, r, 0) for r in range(8)]
    assert st.order == "continual"


def test_recurring_repeats_the_sequence_with_the_same_images(cifar10c) -> None:
    cont, rec = _load(cifar10c, "continual"), _load(cifar10c, "recurring")
    assert rec.domains.tolist() == cont.domains.tolist() * 2
    assert np.array_equal(rec.images, np.concatenate([cont.images, cont.images]))
    assert rec.labels.tolist() == cont.labels.tolist() * 2


def test_mixed_shuffles_the_continual_samples_by_seed(cifar10c) -> None:
    cont, mixed = _load(cifar10c, "continual"), _load(cifar10c, "mixed")
    perm = np.random.default_rng([0, 0x313]).permutation(16)  # the synthetic stream's rule
    assert _rows(mixed) == [_rows(cont)[i] for i in perm]
    assert mixed.labels.tolist() == cont.labels[perm].tolist()
    assert _rows(_load(cifar10c, "mixed", seed=1)) != _rows(mixed)


def test_dirichlet_reorders_within_each_domain_so_classes_cluster(cifar10c) -> None:
    cont, dirich = _load(cifar10c, "continual", 12), _load(cifar10c, "dirichlet", 12)
    assert dirich.domains.tolist() == cont.domains.tolist()  # domains stay in blocks
    for k, a in enumerate((0, 12)):
        block = _rows(dirich)[a:a + 12]
        assert sorted(block) == sorted(_rows(cont)[a:a + 12]) and block != _rows(cont)[a:a + 12]
        # the synthetic stream's rule on the block's labels, seeded by (seed, domain index)
        perm = dirichlet_order(cont.labels[a:a + 12], 10, 0.1, 10,
                               np.random.default_rng([0, k, 0xD1]))
        assert block == [_rows(cont)[a + i] for i in perm]
        assert all(dirich.labels[a + i] == (4 * N + row[1]) % 10 for i, row in enumerate(block))
    again = _load(cifar10c, "dirichlet", 12)
    assert _rows(again) == _rows(dirich)  # deterministic by seed


def test_gradual_steps_through_severities_up_and_down(cifar10c) -> None:
    st = _load(cifar10c, "gradual", samples=18)  # ceil(18 / 9) = 2 per level
    per = 2
    expected_domains, expected_rows = [], []
    for k, c in ((1, "snow"), (0, "fog")):
        seen: dict[int, int] = {}
        for s in GRADUAL_LEVELS:
            v = seen.get(s, 0)
            seen[s] = v + 1
            expected_domains += [f"{c}/{s}"] * per
            expected_rows += [(s, r, k) for r in range(v * per, (v + 1) * per)]
    assert st.domains.tolist() == expected_domains
    assert _rows(st) == expected_rows  # the second visit of a level takes the next rows
    # the synthetic gradual stream has the same shape of sequence
    syn = build_stream(StreamSpec(order="gradual", samples_per_domain=18,
                                  corruptions=("snow", "fog"), image_size=8))
    assert syn.domains.tolist() == expected_domains


def test_every_order_works_on_data(cifar10c) -> None:
    for order in ORDERS:
        st = _load(cifar10c, order, samples=9)
        assert len(st) > 0 and st.order == order


def test_gradual_on_folder_data_is_a_one_line_error(tmp_path) -> None:
    from PIL import Image

    for d in ("day", "night"):
        (tmp_path / d / "cat").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / d / "cat" / "a.png")
    assert len(load_data(DataSpec("folder", tmp_path), 8, order="recurring")) == 4
    with pytest.raises(InputError, match=r"order 'gradual' .* folder data has none") as info:
        load_data(DataSpec("folder", tmp_path), 8, order="gradual")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="--order 'sideways'"):
        load_data(DataSpec("folder", tmp_path), 8, order="sideways")


@pytest.mark.slow
def test_bench_runs_a_recurring_order_on_data(cifar10c, tmp_path) -> None:
    out = tmp_path / "b"
    assert cli_main(["bench", "--data", f"cifar10c:{cifar10c}", "--order", "recurring",
                     "--methods", "source", "--samples-per-domain", "4", "--batch-size", "2",
                     "--threads", "1", "--no-progress", "--out", str(out), "--model",
                     "resnet18", "--weights", str(_resnet18(tmp_path)), "--input-size", "32",
                     "--norm", "cifar10"]) == 0
    report = json.loads((out / "report.json").read_text())
    segs = [(s["domain"], s["stop"] - s["start"]) for s in report["summaries"][0]["segments"]]
    assert segs == [("snow/5", 4), ("fog/5", 4)] * 2
    assert report["runs"][0]["meta"]["ran"]["samples"]["per_domain"] == {"snow/5": 8,
                                                                         "fog/5": 8}
    assert "4 samples per domain visit, 2 visits each (16 in all)" in \
        (out / "report.md").read_text()


def _resnet18(tmp_path: Path) -> Path:
    import torch
    import torchvision

    torch.manual_seed(0)
    path = tmp_path / "r18.pt"
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), path)
    return path
