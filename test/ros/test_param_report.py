"""What the nodes say about the parameter values they were given (tta_ros.param_report,
ros_params.start_values, method_params.report_given): only values someone set, each once
at WARN; another method's options in one line naming the method, a value for no parameter
with the closest one, a run-time set of an undeclared parameter with why it is refused;
and nothing at all for the demo's start."""

from __future__ import annotations

import argparse

import pytest
import yaml

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, CONFIG  # noqa: E402
from helpers.ros import RosoutLog  # noqa: E402
from rcl_interfaces.msg import Log  # noqa: E402
from rclpy.exceptions import ParameterNotDeclaredException  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from tta_ros.bringup import build_nodes  # noqa: E402
from tta_ros.commands import demo  # noqa: E402
from tta_ros.launch_params import launch_overrides  # noqa: E402
from tta_ros.nodes.method_params import method_params, option_defaults  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402
from tta_ros.param_report import (  # noqa: E402
    closest,
    foreign_line,
    set_values,
    unknown_line,
    unknown_names,
)
from tta_ros.replay import replay_nodes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SAID = ("not used", "refused", "ignored", "no option", "no parameter")


# ------------------------------------------------------------ the reporting logic
def test_closest_prefers_the_same_last_part_then_the_spelling() -> None:
    declared = ["method.deadline_mode", "method.deadline_ms", "batch_size", "deadline_per"]
    assert closest("deadline_mode", declared) == "method.deadline_mode"
    assert closest("batch_sise", declared) == "batch_size"
    assert closest("frobnicate", declared) == ""
    assert closest("batch_size", ["batch_size"]) == ""  # itself is no suggestion


def test_set_values_drop_defaults_only() -> None:
    defaults = {"method.sigma": [0.33], "method.mode": ["sequential", "faithful"],
                "method.activation_bits": [0], "method.reforward": [True]}
    given = {"method.sigma": 0.33, "method.mode": "faithful", "method.activation_bits": 0.0,
             "method.reforward": 1, "method.lr": 0.005, "method.camera_hz": 30}
    # at a default of some method: no setting; 1 for a bool option and a name without
    # defaults are settings
    assert set_values(given, defaults) == {"method.reforward": 1, "method.lr": 0.005,
                                           "method.camera_hz": 30}
    assert set_values({"method.sigma": 0.5}, defaults) == {"method.sigma": 0.5}


def test_unknown_names_skip_shared_sections_unless_the_node_has_it_renamed() -> None:
    own = ["model_card", "method.deadline_mode", "batch_size"]
    others = {"deadline_mode", "frame_id", "sigma"}  # the scheduler's and monitor's
    given = ["model_card", "deadline_mode", "frame_id", "batch_sise", "method.bank_path"]
    # frame_id: the monitor's, from a shared section; deadline_mode: the scheduler's too,
    # but this node has it as method.deadline_mode; method.bank_path: handled elsewhere
    assert unknown_names(given, own, handled={"method.bank_path"}, others=others) == [
        "batch_sise", "deadline_mode"]
    # without the others' parameters: only names close to one of the node's
    assert unknown_names(["rate_hzz", "model_card"], ["rate_hz", "frame_id"], others=None) \
        == ["rate_hzz"]


def test_lines_name_the_value_the_method_and_the_closest_parameter() -> None:
    line = unknown_line("perception", "deadline_mode", "speed", ["method.deadline_mode"])
    assert line == ("deadline_mode='speed' is no parameter of perception: not used "
                    "(did you mean method.deadline_mode?)")
    assert foreign_line("tent", {}) == ""
    assert foreign_line("tent", {"method.sigma": 0.5, "method.keep": 0.5}) == (
        "method tent has no option method.keep=0.5, method.sigma=0.5: not used")


def test_option_defaults_are_every_methods_in_ros_form() -> None:
    defaults = option_defaults()
    tent = method_params("tent")["method.lr"]
    assert tent.ros_value(tent.info.default) in defaults["method.lr"]
    assert "method.sigma" in defaults and "method.sigma" not in method_params("tent")
    assert set(method_params("adashadow")) <= set(defaults)


# ------------------------------------------------------------ over rclpy
def _warnings(lines: list[Log]) -> list[str]:
    return [m.msg for m in lines if m.level >= Log.WARN]


@pytest.fixture
def rosout(ros_context):
    log = RosoutLog(ros_context)
    try:
        yield log
    finally:
        log.close()


def test_a_params_file_value_for_no_parameter_is_named_once_with_the_closest(
        ros_context, rosout, tmp_path) -> None:
    """perception from a params file holding `deadline_mode: speed` (its parameter is
    method.deadline_mode): one WARN naming both; the file's other values are taken; a
    run-time set of it is refused and said once, with why."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"perception": {"ros__parameters": {
        "model_card": str(CARD), "num_threads": 1, "batch_size": 3, "batch_timeout_s": 0,
        "deadline_mode": "speed"}}}))
    node = PerceptionNode(context=ros_context,
                          cli_args=["--ros-args", "--params-file", str(params)])
    try:
        assert node.get_parameter("batch_size").value == 3  # read from the file
        assert node.get_parameter("batch_timeout_s").value == 0.0  # an int for a float
        assert not node.has_parameter("deadline_mode")
        assert node.get_parameter("method.deadline_mode").value == "sigma"  # untouched
        said = [w for w in _warnings(rosout.until_now(node)) if "deadline_mode" in w]
        assert len(said) == 1 and "method.deadline_mode" in said[0], said
        assert said[0].startswith("deadline_mode='speed' is no parameter of perception")
        for _ in range(2):
            with pytest.raises(ParameterNotDeclaredException):
                node.set_parameters([Parameter("deadline_mode", value="fixed")])
        refused = [w for w in _warnings(rosout.until_now(node)) if "refused" in w]
        assert refused == ["deadline_mode='fixed' refused: no parameter of perception "
                           "(did you mean method.deadline_mode?)"]
    finally:
        node.destroy_node()


def test_another_methods_option_set_is_named_with_the_method(ros_context, rosout) -> None:
    """`method:=tent sigma:=0.5` (launch arguments over the shipped config): one WARN line
    naming method.sigma and tent; the config's values at their defaults are not named; a
    run-time set of method.sigma is refused naming tent; the scheduler and the monitor
    (model_card from the shared `/**` section) say nothing."""
    nodes = build_nodes(CONFIG, {**launch_overrides("tent", "0.5"),
                                 "resource_monitor": {"enable_perf": False}},
                        context=ros_context)
    per = nodes[2]
    try:
        said = [w for w in _warnings(rosout.until_now(per)) if any(s in w for s in SAID)]
        assert len(said) == 1 and said[0].startswith("method tent has no option "), said
        assert "method.sigma=0.5" in said[0]
        assert "method.deadline_ms" not in said[0]  # at adashadow's default: no setting
        with pytest.raises(ParameterNotDeclaredException):
            per.set_parameters([Parameter("method.sigma", value=0.4)])
        assert [w for w in _warnings(rosout.until_now(per)) if "refused" in w] == [
            "method.sigma=0.4 refused: method tent has no option 'sigma'"]
        for other in nodes[:2]:
            assert not [w for w in _warnings(rosout.until_now(other))
                        if any(s in w for s in SAID)], other.get_name()
        assert nodes[1].get_parameter("sigma").value == 0.5  # the scheduler took it
    finally:
        for n in nodes:
            n.destroy_node()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["source", "adashadow"])
def test_the_demo_starts_without_a_word_about_parameters(ros_context, rosout,
                                                         method) -> None:
    """The nodes as `tta demo` starts them (its replay options, the shipped config) log
    no line about an option not used, ignored or refused, for source as for adashadow."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    nodes = replay_nodes(demo.replay_options(parser.parse_args([]), method), ros_context)
    try:
        assert nodes[2].get_parameter("method").value == method
        for node in nodes:
            lines = [m.msg for m in rosout.until_now(node)]
            assert not [w for w in lines if any(s in w for s in SAID)], (node.get_name(),
                                                                         lines)
    finally:
        for n in nodes:
            n.destroy_node()
