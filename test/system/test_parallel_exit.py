"""AdaShadow's parallel mode at interpreter exit: a script that builds the method, steps and
returns without `close()` exits 0, and the update in flight at exit is finished, not lost
(an atexit hook, which runs after Python has waited for the update thread, sees its
backward time filled in and the weights moved)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT

SCRIPT = r"""
import atexit
import torch
from tta_core.registry import build_method
from tta_core.model.zoo import build_model

torch.set_num_threads(1)
torch.manual_seed(0)
method = build_method("adashadow", build_model("resnet18", 10), input_shape=(3, 64, 64),
                      arch="resnet18", mode="parallel", sigma=1.0)
params = [p for p in method.model.parameters() if p.requires_grad]
results = []
for i in range(4):
    method.engine.sync()
    before = [p.detach().clone() for p in params]
    results.append(method.step(torch.randn(4, 3, 64, 64) * (1 + 0.5 * i) + 0.3 * i))

def report():
    last = results[-1]
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, params))
    print(f"LAST adapted={last.adapted} backward_ms={last.times.backward_ms:.3f} moved={moved}",
          flush=True)

atexit.register(report)
"""


@pytest.mark.slow
def test_parallel_mode_exits_cleanly_without_close():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    # the five runs side by side (one thread each): the same check, a third of the time
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for _ in range(5)]
    for run, proc in enumerate(procs):
        stdout, stderr = proc.communicate()
        assert proc.returncode == 0, (run, proc.returncode, stderr[-2000:])
        assert "terminate called" not in stderr
        last = [ln for ln in stdout.splitlines() if ln.startswith("LAST ")]
        assert last, stdout
        fields = dict(kv.split("=") for kv in last[0].split()[1:])
        assert fields["adapted"] == "True", last  # the last batch had an update in flight
        assert float(fields["backward_ms"]) > 0.0 and fields["moved"] == "True", last
