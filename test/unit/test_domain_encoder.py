"""DARDA's learnt corruption encoder (tta_core.domain.encoder, trained by
tta_core.darda.encoder): Eq. 7 SupCon against a brute-force loop, safetensors round trip
and refusal, a short training run through the `tta train-corruption-encoder` command, and
its part of the domain embedding."""

from __future__ import annotations

import argparse
import math

import pytest
import safetensors.torch
import torch
from helpers import CARD

from tta_core.cli.commands import train_corruption_encoder as cmd
from tta_core.darda.encoder import supcon_loss
from tta_core.domain.embedding import DomainEmbedder, EmbeddingConfig
from tta_core.domain.encoder import CorruptionEncoder, EncoderConfig, load_encoder, save_encoder
from tta_core.model.source import load_source


def test_supcon_matches_a_brute_force_loop() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(7, 5, generator=g, dtype=torch.float64), dim=1)
    y = torch.tensor([0, 1, 0, 2, 1, 0, 3])  # class 3 has no positive: contributes 0
    tau, total = 0.2, 0.0
    for i in range(7):
        den = sum(math.exp(float(z[i] @ z[k]) / tau) for k in range(7) if k != i)
        pos = [j for j in range(7) if j != i and y[j] == y[i]]
        if pos:
            total += -sum(float(z[i] @ z[j]) / tau - math.log(den) for j in pos) / len(pos)
    assert float(supcon_loss(z, y, tau)) == pytest.approx(total / 7, rel=1e-9)


def test_round_trip_and_a_foreign_file_is_refused(tmp_path) -> None:
    enc = CorruptionEncoder(EncoderConfig(width=4, dim=6)).eval()
    save_encoder(enc, tmp_path / "e.safetensors")
    back = load_encoder(tmp_path / "e.safetensors")
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), enc(x)) and back.config == enc.config
        assert torch.allclose(back(x).norm(dim=1), torch.ones(3))
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"other.safetensors: not a tta-corruption-encoder"):
        load_encoder(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"^corruption encoder .*junk.safetensors: "):
        load_encoder(tmp_path / "junk.safetensors")


def test_command_trains_and_the_embedding_reads_it(tmp_path, capsys) -> None:
    """The command module itself (the `tta.commands` entry point of an install made before
    this command is only there after `make setup`)."""
    out = tmp_path / "enc.safetensors"
    parser = argparse.ArgumentParser(prog=f"tta {cmd.NAME}")
    cmd.add_arguments(parser)
    assert cmd.run(parser.parse_args([
        "--model-card", str(CARD), "--out", str(out), "--steps", "3", "--samples", "4",
        "--per-class", "2", "--width", "4", "--dim", "8", "--threads", "1",
        "--log-every", "0"])) == 0
    assert "SupCon" in capsys.readouterr().out and out.is_file()
    enc = load_encoder(out)
    assert enc.config.steps == 3 and enc.config.dim == 8
    model, _ = load_source(CARD)
    emb = DomainEmbedder(model, (3, 32, 32), EmbeddingConfig(
        layers=0, include_input=False, residual=False, encoder=str(out)))
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(x)
        z = enc(x).double()
    vec, within = emb.embedding()
    assert emb.dim == 8 and emb.keys == ["encoder"]
    assert torch.allclose(vec, z.mean(0)) and within is not None
    assert torch.allclose(within, z.var(0, correction=0) / 5)
    emb.close()
