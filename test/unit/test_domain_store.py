"""Domain bank files: a bit-identical round trip through safetensors, atomic writes, and
one-line refusals of corrupt, truncated or mismatched files (the method starts fresh)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers import CARD
from safetensors import safe_open

from tta_core.darda.store import load_bank, save_bank
from tta_core.errors import InputError
from tta_core.model.source import load_source
from tta_core.model.zoo import build_model
from tta_core.registry import build_method

SHAPE = (3, 32, 32)


def _batches() -> list[torch.Tensor]:
    """Three synthetic 'domains' (different input scales and offsets), 6 batches each."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, *SHAPE, generator=g) * s + o
            for s, o in ((1.0, 0.0), (3.0, 0.0), (0.3, 1.0)) for _ in range(6)]


def _darda(**cfg):
    torch.set_num_threads(1)
    model, _ = load_source(CARD)
    return build_method("darda", model, input_shape=SHAPE, **cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    m = _darda()
    for x in _batches():
        m.step(x)
    path = tmp_path_factory.mktemp("bank") / "bank.safetensors"
    m.save_bank(path)
    return m, path


def test_round_trip_is_bit_identical(trained) -> None:
    m, path = trained
    assert len(m.bank.names) >= 2
    other = _darda()
    other.load_bank(path)
    assert other.bank.names == m.bank.names and other.current_domain() == m.current_domain()
    for name in m.bank.names:
        a, b = m.bank.get(name), other.bank.get(name)
        assert all(torch.equal(a[k], b[k]) for k in a)
    for k, v in m.detector.state()[0].items():
        assert torch.equal(v, other.detector.state()[0][k]), k
    assert {n: g.to_json() for n, g in other.gate.domains.items()} == \
        {n: g.to_json() for n, g in m.gate.domains.items()}
    live = dict(other.model.state_dict())
    active = m.bank.get(m.current_domain())
    assert all(torch.equal(live[k], active[k]) for k in active)  # the active state is live
    with safe_open(str(path), framework="pt") as f:  # a plain safetensors file
        assert f.metadata()["format"] == "tta.domain_bank"


def test_save_is_atomic_and_overwrites(trained, tmp_path) -> None:
    m, _ = trained
    path = tmp_path / "b.safetensors"
    path.write_bytes(b"old")
    m.save_bank(path)
    assert load_bank(path, {})[1]["domains"] == m.bank.names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors"]


def _one_line(exc: pytest.ExceptionInfo, path: Path) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def test_corrupt_and_truncated_files_are_refused_in_one_line(trained, tmp_path) -> None:
    m, path = trained
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a bank" * 10)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 200])
    for bad in (garbage, cut):
        with pytest.raises(InputError) as exc:
            m.load_bank(bad)
        assert "not a readable safetensors file" in _one_line(exc, bad)
    other = tmp_path / "other.safetensors"
    save_bank(other, {"x": torch.zeros(2)}, {"hello": 1})
    with pytest.raises(InputError) as exc:
        m.load_bank(other)
    assert "made for another model" in _one_line(exc, other)


def test_bank_of_another_model_is_refused(trained, tmp_path) -> None:
    _, path = trained
    torch.manual_seed(1)
    random = build_method("darda", build_model("small_resnet", 22), input_shape=SHAPE)
    with pytest.raises(InputError) as exc:
        random.load_bank(path)
    assert "fingerprint" in _one_line(exc, path)
    fewer = build_method("darda", build_model("small_resnet", 10), input_shape=SHAPE)
    with pytest.raises(InputError) as exc:
        fewer.load_bank(path)
    assert "made for another model" in _one_line(exc, path)


def test_method_with_a_bad_bank_path_starts_fresh(tmp_path, caplog) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    with caplog.at_level(logging.WARNING):
        m = _darda(bank_path=str(bad))
    assert m.bank.names == [] and str(bad) in m.bank_error
    assert any("starting with an empty domain bank" in r.message for r in caplog.records)
    assert m.step(_batches()[0]).domain == "d0"


_KILLED_SAVE = """
import os, signal, sys, torch
from tta_core.darda import store
real = store.save_file
def half_then_die(flat, name, metadata=None):
    real(flat, name, metadata=metadata)
    with open(name, "r+b") as f:  # a half-written temporary, then SIGKILL (no cleanup runs)
        f.truncate(os.path.getsize(name) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
store.save_file = half_then_die
store.save_bank(sys.argv[1], {"t": torch.ones(64)}, {"new": True})
"""


def test_killed_save_keeps_the_old_bank_and_the_next_start_removes_its_temp(
        trained, tmp_path) -> None:
    import signal
    import subprocess
    import sys

    from tta_core.darda.store import clean_stale_temps

    m, _ = trained
    path = tmp_path / "bank.safetensors"
    m.save_bank(path)
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path)], check=False)
    assert proc.returncode == -signal.SIGKILL
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].name.startswith(".bank.safetensors.")  # leaked
    assert path.read_bytes() == before  # the previous bank is untouched and loadable
    assert load_bank(path, {})[1]["domains"] == m.bank.names
    live = tmp_path / f".bank.safetensors.{__import__('os').getpid()}.tmp"
    live.write_bytes(b"in progress")  # a live process's save is never removed
    m2 = _darda(bank_path=str(path))  # the next start
    assert m2.bank_error == "" and sorted(m2.bank.names) == sorted(m.bank.names)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bank.safetensors", live.name])
    assert clean_stale_temps(path) == []
    m2.close()
