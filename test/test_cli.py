"""The `tta` entry point: version, help, and the doctor's verdict with a dependency hidden."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tta_core import __version__
from tta_core.cli import build_parser, main


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


def _doctor(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tta_core.cli", "doctor", "--no-color"],
                          capture_output=True, text=True, env=env, timeout=180)


def test_doctor_passes_in_the_project_environment():
    proc = _doctor(os.environ.copy())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tta_msgs" in proc.stdout and "all required checks passed" in proc.stdout


def test_doctor_fails_and_names_the_fix_when_tta_msgs_is_hidden():
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if "tta_msgs" not in p
        and "install" not in p
    )
    proc = _doctor(env)
    assert proc.returncode == 1, proc.stdout
    line = next(s for s in proc.stdout.splitlines() if "tta_msgs" in s)
    assert "MISSING" in line
    assert "make setup" in proc.stdout
