"""The tree stays ruff-clean (configuration in ruff.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers import ROOT


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
