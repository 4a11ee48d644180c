"""Shipped model cards are found from any working directory, by one lookup
(tta_core.io.shipped) that every `tta` command, the card loader and the ROS nodes share; a
card found nowhere is refused in one line naming every place it was looked for.

The commands run in this process (`tta_core.cli.main`, the console script's entry point)
with the working directory moved to a temporary folder under /tmp: a fresh interpreter
would spend its time importing torch, not looking up cards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import CARD, ROOT

from tta_core.cli import main
from tta_core.io import shipped
from tta_core.model.source import load_card, load_source

REL = "checkpoints/small_resnet_signs32.json"


def test_bench_finds_the_default_card_outside_the_checkout(tmp_path, monkeypatch) -> None:
    """`tta bench` from /tmp/...: the default card (relative, checkpoints/...) is the
    checkout's, and its checkpoint (relative to the card) loads with it."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    assert not (work / REL).exists()
    out = tmp_path / "out"
    rc = main(["bench", "--methods", "source", "--samples-per-domain", "2", "--batch-size",
               "2", "--corruptions", "fog", "--no-progress", "--out", str(out)])
    assert rc == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ["source"]
    assert runs[0]["meta"]["config"]["model_card"] == str(CARD.resolve())
    assert len(runs[0]["frames"]) == 2  # one corruption, two samples


def test_missing_card_names_every_place_looked(tmp_path, monkeypatch, capsys) -> None:
    """A card found nowhere: one line naming the card and each place, in lookup order: the
    working directory, the checkout, then a `tta.data_roots` provider's folder."""
    share = tmp_path / "share"
    share.mkdir()
    provider = SimpleNamespace(name="fake", load=lambda: lambda: share)
    monkeypatch.setattr(shipped.metadata, "entry_points",
                        lambda group: [provider] if group == shipped.ENTRY_POINT_GROUP else [])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--methods", "source", "--model-card", "checkpoints/nope.json"])
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("tta: error: model card 'checkpoints/nope.json' "
                                              "not found; looked in ")
    places = [str(tmp_path / "checkpoints/nope.json"), str(ROOT / "checkpoints/nope.json"),
              str(share / "checkpoints/nope.json")]
    at = [msg.find(p) for p in places]
    assert -1 not in at and at == sorted(at), msg
    with pytest.raises(SystemExit, match=r"looked in /abs/nope\.json "):
        main(["bench", "--methods", "source", "--model-card", "/abs/nope.json"])


def test_card_only_in_a_provided_folder_loads_with_its_weights(tmp_path, monkeypatch) -> None:
    """A colcon install: the card exists only under the share folder a provider names; the
    loader finds it there and its checkpoint next to it (not in the working directory)."""
    share = tmp_path / "share"
    (share / "checkpoints").mkdir(parents=True)
    card = load_card(CARD)
    shutil.copy(CARD, share / "checkpoints" / "only_shared.json")
    shutil.copy(CARD.parent / card.checkpoint, share / "checkpoints" / card.checkpoint)
    provider = SimpleNamespace(name="fake", load=lambda: lambda: share)
    monkeypatch.setattr(shipped.metadata, "entry_points", lambda group: [provider])
    monkeypatch.chdir(tmp_path)
    found = shipped.find_data_file("checkpoints/only_shared.json")
    assert found == (share / "checkpoints" / "only_shared.json").resolve()
    model, loaded = load_source("checkpoints/only_shared.json")
    assert loaded == card
    ref, _ = load_source(CARD)
    assert all(a.equal(b) for a, b in zip(model.state_dict().values(),
                                          ref.state_dict().values(), strict=True))


def test_ros_nodes_use_the_same_lookup(tmp_path, monkeypatch) -> None:
    """tta_ros.ros_params.resolve_data_path (model_card, profile of the nodes) answers as
    tta_core.io.shipped does, from outside the checkout too."""
    pytest.importorskip("rclpy")
    from tta_ros.ros_params import resolve_data_path

    monkeypatch.chdir(tmp_path)
    assert Path(resolve_data_path(REL)) == shipped.find_data_file(REL) == CARD.resolve()


def test_bench_library_finds_a_relative_card_and_its_weights(tmp_path, monkeypatch) -> None:
    """A BenchConfig made in code (not the CLI) with the relative default card, outside the
    checkout: the model identity names the checkout's checkpoint (found next to the card)."""
    from tta_core.eval.bench_config import BenchConfig
    from tta_core.eval.bench_report import model_identity

    monkeypatch.chdir(tmp_path)
    ident = model_identity(BenchConfig(methods=["source"], model_card=Path(REL)))
    assert ident["weights"] == str((CARD.parent / load_card(CARD).checkpoint).resolve())
