"""The user's data and model (issue #18): `tta bench --data cifar10c:DIR --model resnet18
--weights FILE`, `tta model-card` for a torchvision arch or a factory, the card loading
through the path the perception node and the replay use, one-line errors for a missing
file, a wrong layout and weights that do not fit, and the effective learning rate in the
report. Tiny fixtures made here: a CIFAR-10-C-layout folder, random-init weights."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import save_file

from tta_core.cli import main as cli_main
from tta_core.cli.commands import model_card as model_card_cmd
from tta_core.data.loaders import CIFAR10_CLASSES
from tta_core.data.preprocess import images_to_tensor
from tta_core.errors import InputError, one_line_errors
from tta_core.io.image_msg import Preprocess, to_tensor
from tta_core.model.source import load_source
from tta_core.model.user_card import NORM_PRESETS
from tta_core.model.weights import read_safetensors
from tta_core.model.zoo import SmallResNet
from tta_core.registry import build_method

N = 4  # rows per severity in the fixture (the release has 10000)
CIFAR_MEAN, CIFAR_STD = NORM_PRESETS["cifar10"]
FAST = ("--samples-per-domain", "4", "--batch-size", "2", "--threads", "1", "--no-progress")
FACTORY_MODULE = '''
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet


def resnet_cifar(num_classes: int = 10, width: int = 8) -> ResNet:
    """A CIFAR-style ResNet: 3x3 stride-1 stem, no max-pool."""
    m = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m
'''


@pytest.fixture
def cifar10c(tmp_path: Path) -> Path:
    """DIR/<corruption>.npy (5*N, 32, 32, 3) uint8, severities stacked, + DIR/labels.npy."""
    root = tmp_path / "CIFAR-10-C"
    root.mkdir()
    rng = np.random.default_rng(0)
    np.save(root / "labels.npy", rng.integers(0, 10, 5 * N))
    for name in ("fog", "snow"):
        np.save(root / f"{name}.npy", rng.integers(0, 256, (5 * N, 32, 32, 3), np.uint8))
    return root


@pytest.fixture
def resnet18_weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "resnet18_c10.pt"
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), path)
    return path


def tta(*argv: str) -> int:
    """`tta bench ...` through the installed command, `tta model-card ...` through its
    module (the same parser and one-line error handling as tta_core.cli.main)."""
    if argv[0] != "model-card":
        return cli_main(list(argv))
    parser = argparse.ArgumentParser(prog="tta model-card")
    model_card_cmd.add_arguments(parser)
    with one_line_errors("tta"):
        return model_card_cmd.run(parser.parse_args(list(argv[1:])))


def one_line_error(*argv: str) -> str:
    """The message `tta` exits with; asserts it is a single `tta: error:` line."""
    with pytest.raises(SystemExit) as info:
        tta(*argv)
    text = str(info.value.code)
    assert text.startswith("tta: error: ") and "\n" not in text, text
    return text


def bench_user(data: Path, weights: Path, out: Path, *extra: str) -> list[str]:
    return ["bench", "--data", f"cifar10c:{data}", "--model", "resnet18", "--weights",
            str(weights), "--input-size", "32", "--norm", "cifar10", "--out", str(out),
            *FAST, *extra]


@pytest.mark.slow
def test_bench_runs_on_cifar10c_with_a_torchvision_resnet18(cifar10c, resnet18_weights,
                                                            tmp_path) -> None:
    out = tmp_path / "bench"
    assert tta(*bench_user(cifar10c, resnet18_weights, out, "--methods",
                           "source,bn_adapt")) == 0
    report = json.loads((out / "report.json").read_text())
    assert [s["method"] for s in report["summaries"]] == ["source", "bn_adapt"]
    assert list(report["summaries"][0]["accuracy"]) == ["snow/5", "fog/5"]  # standard order
    # the source run is resnet18 with these weights on the severity-5 rows, CIFAR-normalised
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(resnet18_weights, weights_only=True))
    rows = np.concatenate([np.load(cifar10c / f"{c}.npy")[4 * N:] for c in ("snow", "fog")])
    with torch.no_grad():
        expected = model.eval()(images_to_tensor(rows, CIFAR_MEAN, CIFAR_STD)).argmax(1)
    frames = report["runs"][0]["frames"]
    assert [f["prediction"] for f in frames] == expected.tolist()
    labels = np.load(cifar10c / "labels.npy")[4 * N:]
    assert [f["label"] for f in frames] == [*labels.tolist(), *labels.tolist()]
    text = (out / "report.md").read_text()
    assert f"data: cifar10c:{cifar10c}" in text and "| bn_adapt | – |" in text


@pytest.mark.parametrize("case", ["missing_dir", "no_labels", "wrong_shape", "not_npy"])
def test_bad_data_is_a_one_line_error_naming_the_layout(case, cifar10c, resnet18_weights,
                                                        tmp_path) -> None:
    data = cifar10c
    if case == "missing_dir":
        data = tmp_path / "nowhere"
    elif case == "no_labels":
        (cifar10c / "labels.npy").unlink()
    elif case == "wrong_shape":
        np.save(cifar10c / "fog.npy", np.zeros((5 * N, 28, 28), np.uint8))
    else:
        (cifar10c / "snow.npy").write_bytes(b"not an array")
    text = one_line_error(*bench_user(data, resnet18_weights, tmp_path / "o",
                                      "--methods", "source"))
    expect = {"missing_dir": ["nowhere", "not found"],
              "no_labels": ["labels.npy", "not found", "expected DIR/<corruption>.npy"],
              "wrong_shape": ["fog.npy has shape (20, 28, 28)", "(5*n, 32, 32, 3) uint8"],
              "not_npy": ["snow.npy", "is not a .npy array file",
                          "expected DIR/<corruption>.npy"]}[case]
    for part in expect:
        assert part in text, text


def test_weights_that_do_not_fit_name_the_keys_in_one_line(cifar10c, tmp_path) -> None:
    state = torchvision.models.resnet18(num_classes=100).state_dict()
    del state["layer4.1.bn2.bias"]
    state["head.extra.weight"] = torch.zeros(3)
    weights = tmp_path / "other.pt"
    torch.save(state, weights)
    text = one_line_error(*bench_user(cifar10c, weights, tmp_path / "o", "--methods", "source"))
    assert "missing keys [layer4.1.bn2.bias]" in text
    assert "unexpected keys [head.extra.weight]" in text
    assert "fc.weight (100, 512) vs model (10, 512)" in text
    missing = one_line_error(*bench_user(cifar10c, tmp_path / "nope.pt", tmp_path / "o"))
    assert "weights file" in missing and "nope.pt" in missing and "not found" in missing


@pytest.mark.parametrize("drop, expect", [
    ("--input-size", "needs --input-size"), ("--norm", "needs its normalisation")])
def test_input_size_and_normalisation_are_never_assumed(drop, expect, cifar10c,
                                                        resnet18_weights, tmp_path) -> None:
    argv = bench_user(cifar10c, resnet18_weights, tmp_path / "o")
    i = argv.index(drop)
    del argv[i:i + 2]
    assert expect in one_line_error(*argv)


def test_model_classes_must_match_the_data(cifar10c, tmp_path) -> None:
    weights = tmp_path / "r18_5.pt"
    torch.save(torchvision.models.resnet18(num_classes=5).state_dict(), weights)
    text = one_line_error(*bench_user(cifar10c, weights, tmp_path / "o", "--num-classes", "5"))
    assert "5 classes" in text and "has 10 (airplane" in text


def _factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    pkg = tmp_path / "site" / "tta_test_models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cifar.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return importlib.import_module("tta_test_models.cifar")


def test_model_card_for_a_factory_loads_like_the_node_loads_cards(tmp_path, monkeypatch,
                                                                  capsys) -> None:
    mod = _factory(tmp_path, monkeypatch)
    torch.manual_seed(0)
    model = mod.resnet_cifar(num_classes=10)
    with torch.no_grad():  # non-default BN statistics: the card must carry the weights
        model.bn1.running_mean.uniform_(-0.5, 0.5)
    (tmp_path / "w").mkdir()
    torch.save(model.state_dict(), tmp_path / "w" / "cifar.pt")
    card_path = tmp_path / "w" / "cifar.json"
    assert tta("model-card", "--model", "tta_test_models.cifar:resnet_cifar", "--weights",
               str(tmp_path / "w" / "cifar.pt"), "--input-size", "32", "--norm", "cifar10",
               "--class-names", "cifar10") == 0
    raw = json.loads(card_path.read_text())
    assert raw["factory"] == "tta_test_models.cifar:resnet_cifar"
    assert raw["kwargs"] == {"num_classes": 10} and raw["arch"] == "resnet_cifar"
    assert raw["checkpoint"] == "cifar.pt" and raw["image_size"] == 32
    # what the perception node (and the replay, through it) does with a card path
    loaded, card = load_source(card_path)
    pre = Preprocess.from_card(card)
    assert card.class_names == list(CIFAR10_CLASSES) and pre.image_size == 32
    frames = [np.random.default_rng(i).integers(0, 256, (24, 40, 3), np.uint8)
              for i in range(4)]
    x = to_tensor(frames, pre)
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))
    meth = build_method("adashadow", loaded, input_shape=(3, pre.image_size, pre.image_size),
                        arch=card.arch)
    assert meth.staged.input_shape == (3, 32, 32)
    assert meth.step(x).logits.shape == (4, 10)


def test_a_card_factory_cannot_name_stock_code(tmp_path) -> None:
    state = SmallResNet(num_classes=10).state_dict()
    torch.save(state, tmp_path / "w.pt")
    card = {"arch": "system", "num_classes": 2, "class_names": ["a", "b"], "image_size": 32,
            "mean": [0, 0, 0], "std": [1, 1, 1], "checkpoint": "w.pt",
            "factory": "os:system", "kwargs": {"command": "echo hacked"}}
    (tmp_path / "card.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match="'os' is not a model package"):
        load_source(tmp_path / "card.json")


def test_safetensors_weights_load_and_bad_ones_are_named(tmp_path) -> None:
    torch.manual_seed(1)
    state = SmallResNet(num_classes=4).state_dict()
    weights = tmp_path / "small.safetensors"
    save_file(state, str(weights))
    read = read_safetensors(weights)
    assert read.keys() == state.keys() and all(torch.equal(read[k], v) for k, v in state.items())
    assert tta("model-card", "--model", "small_resnet", "--weights", str(weights),
               "--input-size", "32", "--mean", "0.5,0.5,0.5", "--std", "0.25,0.25,0.25",
               "--class-names", "a,b,c,d") == 0
    model, card = load_source(tmp_path / "small.json")
    assert card.mean == [0.5] * 3 and card.class_names == ["a", "b", "c", "d"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated: offsets past the end
    with pytest.raises(InputError, match=r"small\.safetensors is not a valid safetensors"):
        load_source(tmp_path / "small.json")


@pytest.mark.slow
def test_adashadow_never_traces_at_an_assumed_size(cifar10c, resnet18_weights, tmp_path,
                                                   monkeypatch) -> None:
    with pytest.raises(ValueError, match="adashadow needs input_shape"):
        build_method("adashadow", SmallResNet(num_classes=10))
    import tta_core.adashadow.method as ada

    traced: list[tuple[int, ...]] = []

    def decompose(model, input_shape, arch=None):
        traced.append(tuple(input_shape))
        return real(model, input_shape, arch)

    real = ada.decompose
    monkeypatch.setattr(ada, "decompose", decompose)
    assert tta(*bench_user(cifar10c, resnet18_weights, tmp_path / "o", "--methods",
                           "adashadow", "--input-size", "40")) == 0  # the last one counts
    assert traced == [(3, 40, 40)]  # CIFAR's 32 px images resized to the given 40


@pytest.mark.slow
def test_report_lists_the_effective_learning_rate(tmp_path) -> None:
    """An SGD lr set as the rate at batch 64 is scaled linearly: batch 2 runs 5e-3 * 2 / 64
    (tent's own CIFAR-scale preset, Adam 1e-3, is not scaled)."""
    out = tmp_path / "b"
    sgd = ("--set", "tent.optimizer=sgd", "--set", "tent.lr=0.005")
    assert tta("bench", "--methods", "source,tent", "--samples-per-domain", "2",
               "--batch-size", "2", "--threads", "1", "--no-progress", "--out", str(out),
               *sgd, "--set", "tent.lr_ref_batch=64") == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert runs[0]["meta"]["lr"] is None
    assert runs[1]["meta"]["lr"] == {"lr": 5e-3, "ref_batch": 64,
                                     "effective": {"2": pytest.approx(5e-3 * 2 / 64)}}
    text = (out / "report.md").read_text()
    assert "| tent | 0.005 | 64 | 0.000156 at batch 2 |" in text
    assert tta("bench", "--methods", "tent", "--samples-per-domain", "2", "--batch-size", "2",
               "--threads", "1", "--no-progress", "--out", str(out),
               *sgd, "--set", "tent.lr_ref_batch=0") == 0
    lr = json.loads((out / "report.json").read_text())["runs"][0]["meta"]["lr"]
    assert lr["effective"] == {"2": 5e-3} and lr["ref_batch"] == 0


def test_mismatch_hints_at_training_checkpoints_and_dataparallel() -> None:
    from tta_core.model.weights import state_dict_mismatch

    model = SmallResNet(num_classes=4)
    state = model.state_dict()
    assert state_dict_mismatch(model, state) == ""
    wrapped = state_dict_mismatch(model, {"state_dict": state, "epoch": 3})
    assert "unexpected keys [state_dict, epoch]" in wrapped
    assert "under 'state_dict'" in wrapped and "save model.state_dict() itself" in wrapped
    prefixed = state_dict_mismatch(model, {f"module.{k}": v for k, v in state.items()})
    assert "(+" in prefixed and "strip that prefix" in prefixed and "\n" not in prefixed


def test_scheduler_layout_builds_a_factory_card(tmp_path) -> None:
    """The scheduler node plans from layout_from_card: a factory card (not a zoo arch)
    gives the factory's units, as perception decomposes them."""
    from tta_core.adashadow.planning import layout_from_card
    from tta_core.model.units import decompose

    card = {"arch": "narrow_small_resnet", "num_classes": 4, "class_names": list("abcd"),
            "image_size": 32, "mean": [0.5] * 3, "std": [0.25] * 3, "checkpoint": "w.pt",
            "factory": "tta_core.model.zoo:SmallResNet",
            "kwargs": {"num_classes": 4, "width": 8, "blocks": 2}}
    (tmp_path / "card.json").write_text(json.dumps(card))
    layout = layout_from_card(tmp_path / "card.json")
    expected = decompose(SmallResNet(num_classes=4, width=8, blocks=2), (3, 32, 32))
    assert layout.unit_names == [u.name for u in expected.units]
    assert layout.macs_fwd.tolist() == [float(u.macs_fwd) for u in expected.units]
