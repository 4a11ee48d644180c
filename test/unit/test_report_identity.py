"""Own-data runs report what ran (issue #33, item 9): `tta bench --data cifar10c:DIR
--model pkg.mod:fn --weights W` states the samples actually used per domain in the header,
and report.json `meta.ran` records the samples, the --model spec with the weights' path and
sha256 prefix (not the default card), the data's kind, folder and content identity, and
the code version; every JSON file tta writes is strict (no NaN); the default method list
is every registered method that can run on the model, the others named with the reason."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tta_core import __version__
from tta_core.cli import main as cli_main
from tta_core.eval import report_identity
from tta_core.eval.report_identity import (
    folder_identity,
    samples_text,
    samples_used,
    sha256_prefix,
)
from tta_core.io.strict_json import dumps, strict, write_json
from tta_core.registry import available_methods

N = 6  # rows per severity in the CIFAR-10-C fixture
FACTORY = '''
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet


def tiny(num_classes: int = 10) -> ResNet:
    """A CIFAR-style ResNet-10 (3x3 stride-1 stem, no max-pool): no gated master."""
    m = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m
'''


def _strict_loads(text: str) -> object:
    def refuse(name: str) -> float:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def cifar10c(tmp_path: Path) -> Path:
    root = tmp_path / "CIFAR-10-C"
    root.mkdir()
    rng = np.random.default_rng(1)
    np.save(root / "labels.npy", rng.integers(0, 10, 5 * N))
    for name in ("fog", "snow"):
        np.save(root / f"{name}.npy", rng.integers(0, 256, (5 * N, 32, 32, 3), np.uint8))
    return root


@pytest.fixture
def factory_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tta_idmodels.tiny:tiny importable, and random weights for it."""
    pkg = tmp_path / "site" / "tta_idmodels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    from tta_idmodels.tiny import tiny  # type: ignore[import-not-found]

    torch.manual_seed(0)
    path = tmp_path / "tiny.pt"
    torch.save(tiny().state_dict(), path)
    return path


def _bench(data: Path, weights: Path, out: Path, *extra: str) -> int:
    return cli_main(["bench", "--data", f"cifar10c:{data}", "--model",
                     "tta_idmodels.tiny:tiny", "--weights", str(weights), "--input-size", "32",
                     "--norm", "cifar10", "--num-classes", "10", "--samples-per-domain", "4",
                     "--batch-size", "2", "--threads", "1", "--no-progress",
                     "--out", str(out), *extra])


@pytest.mark.slow
def test_own_data_report_records_exactly_what_ran(cifar10c, factory_weights, tmp_path,
                                                  capsys) -> None:
    out = tmp_path / "bench"
    assert _bench(cifar10c, factory_weights, out, "--methods", "source,tent",
                  "--samples-per-domain", "200") == 0  # asks 200, the folder has N = 6
    text = (out / "report.md").read_text()
    assert f"{N} samples per domain" in text and "200 samples" not in text
    report = _strict_loads((out / "report.json").read_text())
    for run in report["runs"]:
        ran = run["meta"]["ran"]
        assert ran["samples"] == {"total": 2 * N, "per_domain": {"snow/5": N, "fog/5": N},
                                  "visits": [["snow/5", N], ["fog/5", N]],
                                  "requested_per_domain": 200}
        assert ran["model"] == {
            "model": "tta_idmodels.tiny:tiny", "weights": str(factory_weights.resolve()),
            "weights_sha256": hashlib.sha256(factory_weights.read_bytes()).hexdigest()[:16],
            "input_size": 32, "kwargs": {}}
        assert run["meta"]["config"]["model_card"] is None  # not the default card
        files = sorted(p for p in cifar10c.rglob("*") if p.is_file())
        listing = "".join(f"{p.relative_to(cifar10c).as_posix()}\t{p.stat().st_size}\n"
                          for p in files)
        assert ran["data"] == {
            "kind": "cifar10c", "path": str(cifar10c.resolve()), "files": 3,
            "bytes": sum(p.stat().st_size for p in files),
            "listing_sha256": hashlib.sha256(listing.encode()).hexdigest()[:16],
            "order": "continual", "severity": 5, "seed": 0}
        assert ran["code_version"] == report_identity.code_version()
        assert ran["methods_left_out"] == {}


def test_code_version_is_git_describe_in_a_checkout_else_the_package_version(
        monkeypatch) -> None:
    root = Path(report_identity.__file__).resolve().parents[2]
    git = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    if git.returncode == 0:
        assert report_identity.code_version() == git.stdout.strip()

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(report_identity.subprocess, "run", no_git)
    assert report_identity.code_version() == f"tta {__version__}"


def test_folder_identity_changes_with_the_content(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.npy").write_bytes(b"12345")
    (tmp_path / "y.npy").write_bytes(b"1")
    first = folder_identity(tmp_path)
    assert first["files"] == 2 and first["bytes"] == 6
    assert first == folder_identity(tmp_path)
    (tmp_path / "y.npy").write_bytes(b"12")
    assert folder_identity(tmp_path)["listing_sha256"] != first["listing_sha256"]


def test_sha256_prefix_and_samples_text(tmp_path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc" * 1000)
    assert sha256_prefix(f) == hashlib.sha256(b"abc" * 1000).hexdigest()[:16]
    assert samples_text({"total": 40, "per_domain": {"a": 20, "b": 20}}) == \
        "20 samples per domain"
    assert samples_text({"total": 30, "per_domain": {"a": 12, "b": 18}}) == \
        "12–18 samples per domain (30 in all)"
    recurring = samples_used(["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4, 4)
    assert recurring["visits"] == [["a", 4], ["b", 4], ["a", 4], ["b", 4]]
    assert samples_text(recurring) == "4 samples per domain visit, 2 visits each (16 in all)"
    mixed = samples_used(["a", "b", "b", "a", "b", "a"], 3)
    assert samples_text(mixed) == "3 samples per domain"


def test_strict_json_writes_null_for_nan_and_inf(tmp_path) -> None:
    data = {"a": math.nan, "b": [1.0, math.inf, -math.inf], "c": (np.float32(2.5), Path("p")),
            "d": np.array([1, 2]), 3: {"e": np.float64("nan")}}
    expected = {"a": None, "b": [1.0, None, None], "c": [2.5, "p"], "d": [1, 2],
                "3": {"e": None}}
    assert strict(data) == expected
    assert _strict_loads(dumps(data)) == expected
    path = write_json(tmp_path / "x" / "d.json", data)
    assert _strict_loads(path.read_text()) == expected
    with pytest.raises(ValueError, match="NaN"):
        _strict_loads(json.dumps({"a": math.nan}))  # what the plain writer did


@pytest.mark.slow
def test_model_card_is_strict_json_and_loads_back(factory_weights, tmp_path) -> None:
    """`tta model-card` left clean_accuracy NaN (unknown): null in the file, NaN again."""
    from tta_core.model.source import load_card

    card = tmp_path / "tiny.json"
    assert cli_main(["model-card", "--model", "tta_idmodels.tiny:tiny", "--weights",
                     str(factory_weights), "--input-size", "32", "--norm", "cifar10",
                     "--num-classes", "10", "--out", str(card)]) == 0
    raw = _strict_loads(card.read_text())
    assert raw["clean_accuracy"] is None
    assert math.isnan(load_card(card).clean_accuracy)


def test_no_plain_json_writer_is_left_in_the_package() -> None:
    """Every file tta_core and tta_ros write goes through tta_core.io.strict_json: no
    json.dump( / write_text(json.dumps( outside it."""
    root = Path(report_identity.__file__).resolve().parents[2]
    offenders, scanned = [], set()
    for pkg in ("tta_core", "tta_ros"):
        for py in (root / pkg).rglob("*.py"):
            text = py.read_text()
            scanned.add(py.relative_to(root).parts[0])
            if py.name == "strict_json.py":
                continue
            if "json.dump(" in text or "write_text(json.dumps(" in text:
                offenders.append(str(py.relative_to(root)))
    assert scanned == {"tta_core", "tta_ros"}  # both packages were read: not vacuously empty
    assert offenders == []


@pytest.mark.slow
def test_default_methods_are_every_registered_one_that_runs(cifar10c, factory_weights,
                                                            tmp_path, capsys) -> None:
    out = tmp_path / "all"
    assert _bench(cifar10c, factory_weights, out, "--samples-per-domain", "2") == 0
    report = _strict_loads((out / "report.json").read_text())
    ran = [s["method"] for s in report["summaries"]]
    left = report["runs"][0]["meta"]["ran"]["methods_left_out"]
    assert sorted(ran + list(left)) == sorted(available_methods())
    assert ran[0] == "source" and {"darda", "surgeon", "adashadow"} <= set(ran)
    assert list(left) == ["elastic"] and "not a gated master" in left["elastic"]
    err = capsys.readouterr().err
    assert err.count("left out") == 1 and "tta bench: elastic left out" in err


def test_gain_over_source_and_layer_updates_in_the_report(tmp_path) -> None:
    """The demo's report: accuracy gained over source per domain and mean (points), and the
    layers a replay's plans updated with their counts (meta.layer_updates)."""
    from tta_core.eval.report import FrameRecord, RunRecord, gain_over_source, summarize
    from tta_core.eval.report_files import write_report

    def run(method: str, right: dict[str, int], meta: dict | None = None) -> RunRecord:
        frames = [FrameRecord(d, 1, 1 if i < k else 0, i // 2, {"forward": 1.0, "total": 1.0})
                  for d, k in right.items() for i in range(4)]
        return RunRecord(method, frames, 1.0, meta=meta or {})

    lu = {"batches": 4, "adapted": 3, "from_topic_plans": 3, "unnamed": 1,
          "units": {"layer2.0.bn1": 2, "fc": 1}, "units_updated_mean": 1.5}
    runs = [run("source", {"clean": 4, "fog/5": 1}),
            run("adashadow", {"clean": 3, "fog/5": 3}, {"layer_updates": lu})]
    gains = gain_over_source([summarize(r) for r in runs])
    assert gains == {"adashadow": {"clean": -25.0, "fog/5": 50.0, "mean": 12.5}}
    files = write_report(runs, tmp_path)
    md = files.markdown.read_text()
    assert "| adashadow | -25.0 | +50.0 | +12.5 |" in md
    assert ("Layers adashadow updated: 3 of 4 batches adapted (75 %), 1.5 units per batch on "
            "average; 1 adapted batch(es) planned inline, their units unnamed.") in md
    assert "| layer2.0.bn1 | 2 | 50 |" in md and "| fc | 1 | 25 |" in md
    assert "Layers source" not in md
    assert _strict_loads(files.json.read_text())["gain_over_source"] == gains
