"""README.md as a user reads it: short, no run history, links that resolve, and every
fenced block marked `runnable` actually runs (with small settings appended).

A block is runnable when its info string carries the word: ```` ```bash runnable ````,
```` ```python runnable ````. Each bash line (backslash continuations joined, comments
dropped) runs from the repository root with the arguments of `SMALL` for its command
appended (argparse keeps the last value, so they override the README's); a command in
`SERVICES` runs until its nodes say they are ready and then gets SIGINT. Python blocks run
as scripts.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = [pytest.mark.system]

README = ROOT / "README.md"
MAX_LINES = 250
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.M | re.S)
# No run history in a user's document: dates, numbered work periods, machine moods.
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bsession \d+\b|\bquiet VM\b|\bissue #\d+\b", re.I)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def small_args(out: Path) -> dict[str, list[str]]:
    """Per command prefix, arguments that make a README command finish in seconds."""
    return {
        "tta demo": ["--max-frames", "24", "--out", str(out / "demo")],
        "tta bench": ["--samples-per-domain", "8", "--out", str(out / "bench")],
        "tta sweep": ["--out", str(out / "sweep")],
    }


SERVICES = ("python -m tta_ros.bringup",)
# Commands of blocks not marked runnable (they set up, or need a system ROS 2 / network):
# the test or script that runs each one, and a word that file must contain.
ELSEWHERE: dict[str, tuple[str, str]] = {
    "make demo": ("test/system/test_demo_adapts.py", "demo"),  # the target runs `tta demo`
    "make test": (".ci/run", "make test"),  # CI itself
    "rosdep install": ("test/system/test_packaging.py", "rosdep"),  # keys vs package.xml
    "pip install": ("test/system/test_install_lines.py", "pip"),
    "colcon build": ("test/system/test_colcon_workspace.py", "colcon"),
    "source install/setup.bash": ("test/ros/test_launch_sync.py", "vehicle.launch.py"),
    "tta sweep": ("test/system/test_sweep.py", "sweep"),  # a minute of Ray cells
}
READY_LINES = 3  # bringup's three nodes each log "ready:"


@dataclass(frozen=True)
class Block:
    lang: str
    runnable: bool
    body: str


def blocks(text: str) -> list[Block]:
    return [Block(m[1], "runnable" in m[2].split(), m[3]) for m in FENCE.finditer(text)]


def commands(body: str) -> list[str]:
    """Shell lines of a block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(shlex.join(words))
    return out


def _text() -> str:
    return README.read_text()


def _runnable(lang: str) -> list[str]:
    found = []
    for b in blocks(_text()):
        if b.runnable and b.lang == lang:
            found += commands(b.body) if lang == "bash" else [b.body]
    return found


def test_readme_is_short_and_has_no_history() -> None:
    text = _text()
    assert len(text.splitlines()) <= MAX_LINES
    assert [m[0] for m in HISTORY.finditer(text)] == []


def test_readme_links_stay_in_the_repository_and_resolve() -> None:
    for target in LINK.findall(_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path = (ROOT / target).resolve()
        assert path.is_relative_to(ROOT), f"README links outside the repository: {target}"
        assert path.exists(), f"README links to a missing file: {target}"


def test_every_runnable_block_has_commands() -> None:
    assert _runnable("bash"), "README has no runnable bash block"
    assert _runnable("python"), "README has no runnable python block"


def test_every_other_command_is_run_elsewhere() -> None:
    """A bash block not marked runnable holds only commands another test runs."""
    for b in blocks(_text()):
        if b.lang != "bash" or b.runnable:
            continue
        for line in commands(b.body):
            key = next((k for k in ELSEWHERE if line.startswith(k)), None)
            assert key, f"README command run by no test: {line}"
            path, word = ELSEWHERE[key]
            assert word in (ROOT / path).read_text(), (line, path)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run_service(cmd: list[str]) -> None:
    """Start, wait for every node's "ready" line, SIGINT, expect exit 0."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, ready = [], 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            ready += "ready:" in line
            if ready >= READY_LINES:
                break
        assert ready >= READY_LINES, "".join(seen[-20:])
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(seen[-10:]) + rest[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("line", _runnable("bash"))
def test_readme_bash_command_runs(line: str, tmp_path: Path) -> None:
    cmd = shlex.split(line)
    if line.startswith(SERVICES):
        cmd[0] = sys.executable if cmd[0] == "python" else cmd[0]
        _run_service(cmd)
        return
    for prefix, extra in small_args(tmp_path).items():
        if line.startswith(prefix):
            cmd += extra
    if cmd[0] == "python":
        cmd[0] = sys.executable
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("source", _runnable("python"))
def test_readme_python_block_runs(source: str, tmp_path: Path) -> None:
    script = tmp_path / "readme_example.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
