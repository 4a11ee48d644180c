"""Start-up errors are one line, Ctrl-C is a clean exit: through the real entry points.

Every bad-input case runs an entry point (`tta bench`, `tta replay`, a node module,
`python -m tta_ros.bringup`) as a subprocess and expects a non-zero exit and exactly one
non-empty stderr line naming the bad file/field/value: no traceback, and never torch's
advice to load a checkpoint with weights_only=False. The cases start together, two at a
time (each one spends ~3 s importing torch). The SIGINT test stops the three nodes while
frames flow: exit 0, nothing about exceptions in the output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import CARD, ROOT

CKPT = ROOT / "checkpoints" / "small_resnet_signs32.pt"
SAMPLE_MCAP = ROOT / "bags" / "signs32_sample" / "signs32_sample.mcap"
PY = sys.executable


def _env(domain: int | None = None) -> dict[str, str]:
    """This environment with the worktree first on PYTHONPATH and its own ROS domain."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    dom = domain if domain is not None else random.randint(1, 200)
    return {**os.environ, "PYTHONPATH": path, "ROS_DOMAIN_ID": str(dom),
            "PYTHONUNBUFFERED": "1", "TTA_DEBUG": ""}


def _card(dirpath: Path, name: str, **changes: object) -> Path:
    """A copy of the shipped card in `dirpath`, with `changes` (None deletes a field)."""
    raw = json.loads(CARD.read_text())
    raw["checkpoint"] = str(CKPT)
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    path = dirpath / f"{name}.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    """Bad model cards, checkpoints, bags and params files, by name."""
    d = tmp_path_factory.mktemp("bad")
    (d / "truncated.pt").write_bytes(CKPT.read_bytes()[: CKPT.stat().st_size // 3])
    (d / "corrupt.pt").write_bytes(random.Random(0).randbytes(4096))
    torch.save(torch.nn.Linear(4, 2).state_dict(), d / "other_arch.pt")
    (d / "not_json.json").write_text('{"arch": "small_resnet", ')
    (d / "garbage.mcap").write_bytes(random.Random(1).randbytes(8192))
    (d / "truncated.mcap").write_bytes(SAMPLE_MCAP.read_bytes()[:50_000])
    files = {
        "truncated": _card(d, "truncated", checkpoint=str(d / "truncated.pt")),
        "corrupt": _card(d, "corrupt", checkpoint=str(d / "corrupt.pt")),
        "other_arch": _card(d, "other_arch", checkpoint=str(d / "other_arch.pt")),
        "not_checkpoint": _card(d, "not_checkpoint", checkpoint=str(CARD)),
        "no_checkpoint": _card(d, "no_checkpoint", checkpoint=str(d / "missing.pt")),
        "image_size": _card(d, "image_size", image_size="big"),
        "no_mean": _card(d, "no_mean", mean=None),
        "arch": _card(d, "arch", arch="vgg_nonesuch"),
        "not_json": d / "not_json.json",
        "garbage.mcap": d / "garbage.mcap",
        "truncated.mcap": d / "truncated.mcap",
    }
    params = d / "vehicle.yaml"
    params.write_text(f"/**:\n  ros__parameters:\n    model_card: {files['corrupt']}\n")
    return {**files, "params": params, "dir": d}


def _bench(card: Path | str, *extra: str) -> list[str]:
    return [PY, "-m", "tta_core.cli", "bench", "--model-card", str(card), "--methods",
            "source", "--samples-per-domain", "2", "--no-progress", "--out", "OUT", *extra]


def _replay(bag: Path, *extra: str) -> list[str]:
    return [PY, "-m", "tta_core.cli", "replay", str(bag), "--config",
            str(ROOT / "config" / "vehicle.yaml"), "--out", "OUT", *extra]


def _node(module: str, card: Path) -> list[str]:
    return [PY, "-m", f"tta_ros.nodes.{module}", "--ros-args", "-p", f"model_card:={card}"]


# name -> (command from the bad files, what its one line must contain); run as subprocesses
CASES = {
    "bench_truncated_checkpoint": (lambda b: _bench(b["truncated"]),
                                   ["truncated.pt is not a valid checkpoint"]),
    "bench_corrupt_checkpoint": (lambda b: _bench(b["corrupt"]),
                                 ["corrupt.pt is not a valid checkpoint"]),
    "perception_node_truncated": (lambda b: _node("perception", b["truncated"]),
                                  ["perception_node: error:", "truncated.pt"]),
    "scheduler_node_wrong_type": (lambda b: _node("scheduler", b["image_size"]),
                                  ["scheduler_node: error:", "image_size", "'big'"]),
    "bringup_corrupt_checkpoint": (
        lambda b: [PY, "-m", "tta_ros.bringup", "--config", str(b["params"])],
        ["corrupt.pt is not a valid checkpoint"]),
    "replay_garbage_bag": (lambda b: _replay(b["garbage.mcap"]), ["garbage.mcap"]),
    "replay_truncated_bag": (lambda b: _replay(b["truncated.mcap"]), ["truncated.mcap"]),
    "replay_corrupt_checkpoint": (
        lambda b: _replay(SAMPLE_MCAP.parent, "--config", str(b["params"])),
        ["corrupt.pt is not a valid checkpoint"]),
}
# more `tta bench` inputs, through tta_core.cli.main in this process (the same code path
# up to the interpreter printing SystemExit's message, which CASES cover)
IN_PROCESS = {
    "other_architecture": (lambda b: _bench(b["other_arch"]),
                           ["other_arch.pt", "does not fit arch 'small_resnet'"]),
    "wrong_type": (lambda b: _bench(b["image_size"]), ["image_size.json", "image_size",
                                                       "'big'"]),
    "json_as_checkpoint": (lambda b: _bench(b["not_checkpoint"]),
                           [f"{CARD} is not a valid checkpoint"]),
    "missing_checkpoint": (lambda b: _bench(b["no_checkpoint"]), ["missing.pt"]),
    "missing_card": (lambda b: _bench(b["dir"] / "nope.json"), ["nope.json"]),
    "missing_field": (lambda b: _bench(b["no_mean"]), ["no_mean.json", "'mean'"]),
    "unknown_arch": (lambda b: _bench(b["arch"]), ["arch.json", "'vgg_nonesuch'"]),
    "not_json": (lambda b: _bench(b["not_json"]), ["not_json.json", "not valid JSON"]),
    "sigma_nan": (lambda b: _bench(CARD, "--methods", "adashadow", "--set",
                                   "adashadow.sigma=nan"), ["sigma", "nan"]),
    "sigma_word": (lambda b: _bench(CARD, "--methods", "adashadow", "--set",
                                    "adashadow.sigma=big"), ["sigma", "'big'"]),
    "device_word": (lambda b: _bench(CARD, "--device", "gpu"),
                    ["device='gpu' is not a torch device"]),
}
HAVE_ROS = all(importlib.util.find_spec(m) is not None for m in ("rclpy", "tta_msgs"))
ROS_CASES = {n for n in CASES if n.startswith(("perception", "scheduler", "bringup", "replay"))}


def _argv(cmd: list[str], bad: dict[str, Path]) -> list[str]:
    return [str(bad["dir"] / "out") if c == "OUT" else c for c in cmd]


def _check_line(line: str, expected: list[str], report: str) -> None:
    """One line that names what `expected` lists and never advises unsafe loading."""
    assert "\n" not in line.strip() and "Traceback" not in line, report
    assert "weights_only=False" not in line, report
    for text in expected:
        assert text in line, f"{text!r} not named\n{report}"


@pytest.fixture(scope="module")
def results(bad) -> dict[str, subprocess.CompletedProcess]:
    """Every subprocess case run once, two at a time."""
    commands = {name: _argv(make(bad), bad) for name, (make, _) in CASES.items()
                if HAVE_ROS or name not in ROS_CASES}

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(),
                              cwd=ROOT)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, cmd) for name, cmd in commands.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.ros] if c in ROS_CASES
                                                 else []) for c in sorted(CASES)])
def test_bad_input_is_one_line(case: str, results) -> None:
    if case not in results:
        pytest.skip("needs rclpy and tta_msgs")
    proc = results[case]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    report = f"{case}: rc={proc.returncode}\nstderr:\n{proc.stderr}"
    assert proc.returncode != 0, report
    assert len(lines) == 1 and "Traceback" not in proc.stderr, report
    _check_line(lines[0], CASES[case][1], report)


@pytest.mark.parametrize("case", sorted(IN_PROCESS))
def test_more_bad_bench_input_is_one_line(case: str, bad) -> None:
    from tta_core.cli import main

    make, expected = IN_PROCESS[case]
    with pytest.raises(SystemExit) as exc:
        main(_argv(make(bad), bad)[3:])
    message = str(exc.value.code)
    _check_line(message, expected, f"{case}: {message}")
    assert message.startswith("tta: error: ")


def test_debug_raises_with_the_traceback(bad) -> None:
    from tta_core.cli import main
    from tta_core.errors import InputError

    with pytest.raises(InputError, match=r"truncated\.pt is not a valid checkpoint"):
        main(["--debug", *_argv(_bench(bad["truncated"]), bad)[3:]])


@pytest.mark.ros
@pytest.mark.skipif(not HAVE_ROS, reason="needs rclpy and tta_msgs")
def test_sigint_while_frames_flow_exits_cleanly(ros_context) -> None:
    """Ctrl-C with the perception worker busy: the nodes stop before the context, exit 0."""
    import numpy as np
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image
    from tta_msgs.msg import ClassPrediction

    proc = subprocess.Popen(
        [PY, "-m", "tta_ros.bringup", "--set", "perception.batch_size=2"],
        env=_env(ros_context.get_domain_id()), cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    node = None
    try:
        import rclpy

        node = rclpy.create_node("sigint_test", context=ros_context)
        pub = node.create_publisher(Image, "image", qos_profile_sensor_data)
        got: list[int] = []
        node.create_subscription(ClassPrediction, "predictions", lambda m: got.append(1), 100)
        msg = Image(height=32, width=32, encoding="rgb8", step=96)
        msg.data = np.random.default_rng(0).integers(0, 255, 32 * 32 * 3, np.uint8).tobytes()
        executor = rclpy.executors.SingleThreadedExecutor(context=ros_context)
        executor.add_node(node)
        end = time.monotonic() + 60
        while len(got) < 10 and time.monotonic() < end and proc.poll() is None:
            pub.publish(msg)
            executor.spin_once(timeout_sec=0.01)
        assert len(got) >= 10, "no predictions before the interrupt"
        proc.send_signal(signal.SIGINT)
        for _ in range(30):  # frames keep coming while it stops
            pub.publish(msg)
            executor.spin_once(timeout_sec=0.01)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        if node is not None:
            node.destroy_node()
    assert proc.returncode == 0, out
    for word in ("Traceback", "Exception", "RCLError", "[ERROR]"):
        assert word not in out, out
