"""The offline timings on the user's model and data: `tta calibrate --model-card --data`
times the card's model's forward on a batch of the user's images instead of a matmul, and
`tta profile --model-card --data` profiles on such a batch instead of a random one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tta_core.cli import main

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"


def test_the_calibration_workload_is_the_cards_forward_on_the_datas_batch() -> None:
    from tta_core.cli.commands.calibrate import model_workload
    from tta_core.cli.offline_inputs import timed_batch
    from tta_core.model.source import load_card, load_source

    fn, name = model_workload(CARD, "signs", 3)
    x = timed_batch("signs", load_card(CARD), 3)
    assert x.shape == (3, 3, 32, 32)
    model, _ = load_source(CARD)
    with torch.no_grad():
        want = model.eval()(x)
    torch.testing.assert_close(fn(), want)  # the user's model on the user's images
    assert name == "forward of small_resnet_signs32.json at batch 3 on signs images"
    rand, _ = model_workload(CARD, None, 2)
    assert rand().shape == (2, want.shape[1])
    assert model_workload(None, None, 4) == (None, "")  # the matmul


def test_calibrate_records_the_model_it_timed(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The command runs the model's forward as its workload (counted) and names it."""
    from tta_core.adashadow import calibration

    calls = []
    real = calibration.forward_fn

    def counted(model, x):
        fn = real(model, x)
        return lambda: calls.append(1) or fn()

    monkeypatch.setattr(calibration, "forward_fn", counted)
    monkeypatch.setattr(calibration, "probe_bandwidth", lambda repeats: 1.0)
    monkeypatch.setattr(calibration, "measure_bandwidth", lambda s: (2.0, 1.0, 1, 2))
    monkeypatch.setattr(calibration, "_time_k", lambda work, k, cfg: work.run() * (1 + k))
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--quick", "--model-card", str(CARD), "--data", "signs",
                 "--batch-size", "2", "--out", str(out), "--no-progress"]) == 0
    m = json.loads(out.read_text())["measurements"]
    assert m["workload"] == "forward of small_resnet_signs32.json at batch 2 on signs images"
    assert calls  # the model ran as the timed computation
    default = tmp_path / "mm.json"
    assert main(["calibrate", "--quick", "--out", str(default), "--no-progress"]) == 0
    assert json.loads(default.read_text())["measurements"]["workload"] == "matmul 256x256"


def test_profile_runs_on_the_datas_batch(tmp_path: Path) -> None:
    from tta_core.adashadow.profiler import profile_model
    from tta_core.cli.offline_inputs import timed_batch
    from tta_core.model.source import load_card, load_source
    from tta_core.model.units import decompose

    model, card = load_source(CARD)
    x = timed_batch("signs", load_card(CARD), 2)
    staged = decompose(model, (3, *card.input_hw), card.arch)
    first = staged.units[0].module
    seen = []
    first.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().clone()))
    profile_model(staged, batch=7, repeats=1, inputs=x)  # the batch sets the size
    assert seen and all(torch.equal(s, x) for s in seen)  # every timed forward: the batch
    out = tmp_path / "p.json"
    assert main(["profile", "--model-card", str(CARD), "--data", "signs", "--batch-size",
                 "2", "--repeats", "1", "--split", "macs", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["unit_names"]


@pytest.mark.parametrize("cmd", ["calibrate", "profile"])
def test_data_without_a_model_card_is_refused_in_one_line(cmd: str) -> None:
    argv = [cmd, "--data", "signs"] + (["--arch", "small_resnet"] if cmd == "profile" else [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code)
    assert re.fullmatch(r"tta: error: --data signs needs --model-card \(.*\)", msg), msg
