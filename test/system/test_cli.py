"""The `tta` entry point: version, help, subcommands from the `tta.commands` entry points,
and the doctor's verdict with a dependency hidden."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tta_core import __version__
from tta_core.cli import ENTRY_POINT_GROUP, build_parser, main

CORE_COMMANDS = {"bench", "calibrate", "doctor", "make-bag", "make-benchmark", "model-card",
                 "predictor-bench", "prepare", "profile", "sweep", "train-corruption-encoder",
                 "train-darda", "train-elastic", "train-source"}


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_every_discovered_command_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "doctor" in sub.choices
    for name, p in sub.choices.items():
        assert p.description, name


def _commands() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return set(sub.choices)


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    """`importlib.metadata.entry_points` answering the tta.commands group with `values`."""
    eps = metadata.EntryPoints(metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)
                               for name, value in values.items())

    def entry_points(**params: str) -> metadata.EntryPoints:
        assert params == {"group": ENTRY_POINT_GROUP}, params
        return eps

    monkeypatch.setattr(metadata, "entry_points", entry_points)


def _command_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str,
                    body: str) -> None:
    (tmp_path / f"{module}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_commands_come_from_the_entry_point_group(tmp_path, monkeypatch, capsys):
    _command_module(tmp_path, monkeypatch, "tta_test_hello_cmd", (
        "NAME = 'hello'\nHELP = 'say hello'\n"
        "def add_arguments(p):\n    p.add_argument('--who', default='world')\n"
        "def run(args):\n    print(f'hello {args.who}')\n    return 3\n"))
    _fake_entry_points(monkeypatch, hello="tta_test_hello_cmd",
                       doctor="tta_core.cli.commands.doctor")
    assert _commands() == {"hello", "doctor"}  # only the group: nothing scanned besides
    assert main(["hello", "--who", "tta"]) == 3
    assert capsys.readouterr().out == "hello tta\n"


def test_without_the_group_the_core_commands_are_scanned(monkeypatch):
    """An install older than the group (no `make setup` since): tta_core's commands only."""
    _fake_entry_points(monkeypatch)
    assert _commands() == CORE_COMMANDS


def test_bad_command_entry_points_are_named(tmp_path, monkeypatch):
    _command_module(tmp_path, monkeypatch, "tta_test_runless_cmd",
                    "NAME = 'runless'\nHELP = 'no run'\ndef add_arguments(p):\n    pass\n")
    _fake_entry_points(monkeypatch, runless="tta_test_runless_cmd")
    with pytest.raises(TypeError, match=r"'runless' .* lacks run"):
        build_parser()
    _fake_entry_points(monkeypatch, ghost="tta_test_no_such_module")
    with pytest.raises(ImportError, match=r"'ghost' .* cannot be loaded"):
        build_parser()
    _fake_entry_points(monkeypatch, doc="tta_core.cli.commands.doctor")
    with pytest.raises(ValueError, match=r"'doc' .* NAME is 'doctor'"):
        build_parser()


def _doctor(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tta_core.cli", "doctor", "--no-color"],
                          capture_output=True, text=True, env=env, timeout=180)


def test_doctor_passes_in_the_project_environment():
    proc = _doctor(os.environ.copy())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tta_msgs" in proc.stdout and "all required checks passed" in proc.stdout


def test_doctor_reports_a_missing_module_as_a_row_not_a_crash():
    """tta_kernels unimportable (a workspace whose install folder is not sourced): the
    table still prints, with that row MISSING and its fix, exit 1."""
    code = ("import sys; sys.modules['tta_kernels'] = None; sys.argv = ['tta', 'doctor', "
            "'--no-color']; import runpy; runpy.run_module('tta_core.cli', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    line = next(s for s in proc.stdout.splitlines() if "tta_kernels" in s)
    assert "MISSING" in line and "ModuleNotFoundError" in line
    assert "some required checks FAILED" in proc.stdout


def test_doctor_fails_and_names_the_fix_when_tta_msgs_is_hidden():
    """Only the PYTHONPATH entries holding tta_msgs are dropped (in a colcon workspace
    tta_kernels sits in another install folder and must stay importable)."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not (Path(p) / "tta_msgs").exists()
    )
    proc = _doctor(env)
    assert proc.returncode == 1, proc.stdout
    line = next(s for s in proc.stdout.splitlines() if "tta_msgs" in s)
    assert "MISSING" in line
    assert "make setup" in proc.stdout
