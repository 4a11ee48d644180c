"""`tta sweep --address` on a two-node Ray cluster: a head and a worker node started with
`ray start` on this machine (one CPU and a resource of its own each) run a small spec's
cells, and the cell records name both nodes."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers import wait_for

pytestmark = [pytest.mark.system, pytest.mark.slow]

RAY = shutil.which("ray", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                 os.environ.get("PATH", "")]))

# Prints the alive nodes once there are `want` of them (a driver of its own, not this process).
NODES = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False,
         configure_logging=False)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= int(sys.argv[2]):
        break
    time.sleep(0.2)
print(json.dumps([{"id": n["NodeID"], "resources": n["Resources"]} for n in alive]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every process of the cluster and its drivers shares one token: Ray turns token
# authentication on for a head when ~/.ray/auth_token exists (a local `ray.init` writes it),
# but not for a joining node, so the mode is set explicitly, the same for all.
TOKEN = secrets.token_hex(32)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return env | {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                  "RAY_AUTH_TOKEN": TOKEN}


def _session_pids(sessions: set[int]) -> list[int]:
    """Live (not zombie) processes in the given sessions."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, _pgrp, sid = stat.read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(sid) in sessions and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


class Cluster:
    """Ray nodes started with `ray start --block`, each in a session of its own, so that
    stopping them kills exactly these processes (`ray stop` would stop every Ray of this
    user on the machine)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.address = f"127.0.0.1:{_free_port()}"
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> None:
        """One node; returns once its `ray start` says the runtime started."""
        log = self.root / f"{name}.log"
        with log.open("w") as fh:
            proc = subprocess.Popen(
                [RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                 "--num-gpus=0", "--object-store-memory=100000000", "--disable-usage-stats",
                 f"--temp-dir={self.root / name}", *args],
                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=_env())
        self.procs.append(proc)
        started = wait_for(lambda: "Ray runtime started" in log.read_text()
                           or proc.poll() is not None, timeout=120, poll=0.2)
        assert started and proc.poll() is None, f"ray start {name}:\n{log.read_text()[-3000:]}"

    def nodes(self, want: int) -> list[dict]:
        """The alive nodes, once `want` have joined."""
        res = subprocess.run([sys.executable, "-c", NODES, self.address, str(want), "60"],
                             capture_output=True, text=True, timeout=120, env=_env(),
                             check=False)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        """Kill every process of the nodes (their workers included) and wait for them."""
        sessions = {p.pid for p in self.procs}
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if Path("/proc").is_dir() and not wait_for(lambda: not _session_pids(sessions),
                                                   timeout=10, poll=0.1):
            for pid in _session_pids(sessions):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: not _session_pids(sessions), timeout=10, poll=0.1)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if RAY is None:
        pytest.skip("the `ray` command line is not installed")
    # short: Ray's socket paths under the temp dir must fit a Unix socket name
    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp" if Path("/tmp").is_dir() else None))
    nodes = Cluster(root)
    try:
        nodes.start("head", "--head", f"--port={nodes.address.rsplit(':', 1)[1]}",
                    "--include-dashboard=false", f"--dashboard-port={_free_port()}",
                    f"--dashboard-agent-listen-port={_free_port()}",
                    '--resources={"head_node": 1}')
        nodes.start("worker", f"--address={nodes.address}",
                    f"--dashboard-agent-listen-port={_free_port()}",
                    '--resources={"worker_node": 1}')
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_sweep_cells_run_on_both_nodes(cluster: Cluster, tmp_path: Path) -> None:
    nodes = cluster.nodes(2)
    by_resource = {r: n["id"] for n in nodes for r in ("head_node", "worker_node")
                   if r in n["resources"]}
    assert len(nodes) == 2 and len(by_resource) == 2, nodes
    spec = tmp_path / "two.yaml"  # 4 cells of 1 CPU, 2 nodes of 1 CPU: both run cells
    spec.write_text(yaml.safe_dump({"name": "two", "base": {"samples-per-domain": 1,
                                                            "threads": 1},
                                    "grid": {"methods": ["source", "bn_adapt"],
                                             "seed": [0, 1]}}))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "tta_core.cli", "sweep", str(spec), "--out",
                          str(out), "--address", cluster.address, "--no-progress"],
                         capture_output=True, text=True, timeout=240, env=_env(), check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "4 cells, 4 run now, 0 from cache, 0 failed" in res.stdout, res.stdout
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    ran_on = [c["node"]["id"] for c in cells]
    assert set(ran_on) == set(by_resource.values()), (ran_on, by_resource)
    assert all(c["node"]["ip"] and c["node"]["host"] == socket.gethostname() for c in cells)
    md = (out / "sweep.md").read_text()
    assert "## Ray nodes" in md and by_resource["worker_node"][:12] in md
