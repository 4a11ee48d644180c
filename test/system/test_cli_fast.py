"""`tta --help` and `tta <cmd> --help` import neither torch, torchvision, numpy nor rclpy
(they answer in a fraction of a second), and the choices and defaults the command modules
copy to stay light equal the ones of the torch-importing modules they come from."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tta_core.cli import build_parser, discover, model_args
from tta_core.cli import choices as cli_choices
from tta_core.cli.commands import (
    bench,
    make_benchmark,
    predictor_bench,
    train_corruption_encoder,
    train_elastic,
    train_source,
)

HEAVY = ("torch", "torchvision", "numpy", "rclpy", "tta_msgs")
COMMANDS = sorted(mod.NAME for mod in discover())


def _imported(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `argv` with the import profiler on; the process and every module it imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    names = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
             if line.startswith("import time:") and "[us]" not in line}  # not the header
    return proc, names


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_import_profile_lists_modules():
    """The profile parser sees imports at all (else the light checks would pass vacuously)."""
    proc, modules = _imported([sys.executable, "-c", "import json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "json" in modules and "json.decoder" in modules


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_nothing_heavy(command: str):
    argv = [sys.executable, "-m", "tta_core.cli", *([command] if command else []), "--help"]
    proc, modules = _imported(argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: tta" in proc.stdout
    assert "tta_core.cli" in modules
    assert _heavy(modules) == [], f"`tta {command} --help` imports {_heavy(modules)[:8]}"


def test_console_script_help_is_light():
    """The installed `tta` script itself (entry-point discovery of every command)."""
    tta = shutil.which("tta")
    if tta is None:
        pytest.skip("the tta console script is not on PATH (run `source build/env.sh`)")
    for argv in ([tta, "--help"], [tta, "bench", "--help"]):
        proc, modules = _imported(argv)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert _heavy(modules) == [], f"{argv[1:]} imports {_heavy(modules)[:8]}"
    assert all(name in proc.stdout for name in ("--methods", "--stream-hz", "--model"))


def test_every_command_is_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert {"bench", "doctor", "demo", "replay"} <= set(COMMANDS)
    assert all(name in out for name in COMMANDS)


def test_copied_choices_equal_the_real_ones():
    from tta_core.adashadow.profiler import SPLITS
    from tta_core.eval import bench_config as eval_bench
    from tta_core.eval import predictor_bench as eval_pb
    from tta_core.model.user_card import NORM_PRESETS
    from tta_core.model.zoo import ARCHS
    from tta_core.runtime.precision import PRECISIONS

    assert cli_choices.ARCHS == ARCHS
    assert cli_choices.SPLITS == SPLITS
    assert model_args.NORM_NAMES == tuple(NORM_PRESETS)
    assert bench.DEFAULT_METHODS == eval_bench.DEFAULT_METHODS
    assert bench.DEFAULT_CARD == eval_bench.DEFAULT_CARD
    assert bench.MODES == eval_bench.MODES
    assert bench.PRECISIONS == PRECISIONS
    assert predictor_bench.CONDITIONS == tuple(eval_pb.CONDITIONS)
    assert predictor_bench.MODELS == eval_pb.MODELS
    assert predictor_bench.PI2_MODES == eval_pb.PI2_MODES


def test_default_methods_are_registered():
    from tta_core.registry import available_methods

    assert set(bench.DEFAULT_METHODS) <= set(available_methods())


def _parsed_defaults(command: str, argv: list[str]) -> dict[str, Any]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return vars(sub.choices[command].parse_args(argv))


def _config_defaults(config: type) -> dict[str, Any]:
    d = config()
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(config)}


# (command, its config class, the defaults it copies, options whose default differs on
# purpose: bench --model-card None means "DEFAULT_CARD unless --model is given";
# bench --corruptions "" is the config's () (the standard set), parsed when the cell runs;
# train-source's sample counts None mean "the config default, or all rows with --data")
CONFIGS = [
    ("bench", "tta_core.eval.bench_config:BenchConfig", bench.DEFAULTS,
     {"model_card", "corruptions"}),
    ("train-source", "tta_core.model.source:TrainConfig", train_source.DEFAULTS,
     {"train_samples", "val_samples"}),
    ("train-elastic", "tta_core.elasticdnn.train:ElasticTrainConfig", train_elastic.DEFAULTS,
     set()),
    ("train-corruption-encoder", "tta_core.domain.encoder:EncoderConfig",
     train_corruption_encoder.ENCODER_DEFAULTS, set()),
    ("predictor-bench", "tta_core.eval.predictor_bench:BenchConfig", {}, set()),
]


@pytest.mark.parametrize(("command", "config", "copied", "differ"), CONFIGS)
def test_option_defaults_equal_the_config_defaults(command: str, config: str,
                                                   copied: dict[str, Any], differ: set[str]):
    """Every option named like a config field defaults to the field's default, and every
    copied default names a real field."""
    module, _, cls = config.partition(":")
    real = _config_defaults(getattr(importlib.import_module(module), cls))
    assert set(copied) <= set(real), set(copied) - set(real)
    parsed = _parsed_defaults(command, [])
    shared = set(parsed) & set(real) - differ
    assert len(shared) >= 5, shared  # the options really are named like the fields
    assert set(copied) - differ <= shared
    assert {k: parsed[k] for k in shared} == {k: real[k] for k in shared}
    assert {k: copied[k] for k in copied} == {k: real[k] for k in copied}


def test_make_benchmark_defaults_equal_the_config_defaults():
    from tta_core.data.benchmark import BenchmarkConfig

    real = _config_defaults(BenchmarkConfig)
    parsed = _parsed_defaults("make-benchmark", [])
    assert make_benchmark.DEFAULTS == {k: real[k] for k in make_benchmark.DEFAULTS}
    assert {k: parsed[k] for k in make_benchmark.DEFAULTS} == make_benchmark.DEFAULTS


def test_encoder_options_cover_every_config_field():
    """train-corruption-encoder has one option per EncoderConfig field, in field order."""
    from tta_core.domain.encoder import EncoderConfig

    real = _config_defaults(EncoderConfig)
    assert list(train_corruption_encoder.ENCODER_DEFAULTS.items()) == list(real.items())
    assert all(type(v) is type(real[k])
               for k, v in train_corruption_encoder.ENCODER_DEFAULTS.items())
