"""The perception node's method.* parameters, generated from the selected method's config
(tta_ros.nodes.method_params): a field added to a config is a parameter with its range and
help, bad values are refused with a reason naming them (range, choices, the config's own
validation), accepted ones reach the method (its setter, or a rebuild), and a new `method`
swaps the method.* parameters."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

rclpy = pytest.importorskip("rclpy")
from helpers import CARD, wait_for  # noqa: E402
from rcl_interfaces.msg import ParameterType  # noqa: E402
from rclpy.exceptions import ParameterNotDeclaredException  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from tta_core.methods.source import Source  # noqa: E402
from tta_core.registry import _REGISTRY, register  # noqa: E402
from tta_core.runtime.method import MethodConfig  # noqa: E402
from tta_core.runtime.options import option  # noqa: E402
from tta_ros.lifecycle import activate  # noqa: E402
from tta_ros.nodes.perception import PerceptionNode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class ProbeConfig(MethodConfig):
    """A test-only config: one field more than any shipped method has."""

    gain: float = option(2.0, "test-only logit gain", low=0.5, high=4.0)
    flavour: str = option("plain", "test-only flavour", choices=("plain", "spicy"))
    seed: int = option(0, "test-only seed, read when built", runtime=False)

    def validate(self) -> None:
        """The config's own check of a combination."""
        if self.flavour == "spicy" and self.gain > 3.0:
            raise ValueError(f"gain={self.gain} is too much for flavour 'spicy'")


class ProbeMethod(Source):
    """Source with the probe config."""

    config_cls = ProbeConfig


@pytest.fixture
def probe_method():
    register("params_probe")(ProbeMethod)
    try:
        yield "params_probe"
    finally:
        _REGISTRY.pop("params_probe", None)


def _node(ctx, method: str, **params: object) -> PerceptionNode:
    given = {"model_card": str(CARD), "method": method, "num_threads": 1, **params}
    return activate(PerceptionNode(context=ctx, parameter_overrides=[
        Parameter(k, value=v) for k, v in given.items()]))


def test_a_new_config_field_is_a_parameter_with_its_range_and_help(ros_context,
                                                                   probe_method) -> None:
    node = _node(ros_context, probe_method)
    try:
        gain, flavour = node.describe_parameters(["method.gain", "method.flavour"])
        assert gain.type == ParameterType.PARAMETER_DOUBLE
        assert "test-only logit gain" in gain.description
        rng = gain.floating_point_range[0]
        assert (rng.from_value, rng.to_value) == (0.5, 4.0)
        assert "one of: plain, spicy" in flavour.description
        assert node.get_parameter("method.gain").value == 2.0
        assert not node.has_parameter("method.input_shape")  # filled from the model card
        assert tuple(node.method.config.input_shape) == (3, 32, 32)
        for name, value, needle in (("method.gain", 5.0, "5.0"),
                                    ("method.flavour", "salty", "'salty'")):
            res = node.set_parameters([Parameter(name, value=value)])[0]
            assert not res.successful and needle in res.reason, res.reason
        assert node.set_parameters([Parameter("method.gain", value=3.5)])[0].successful
        res = node.set_parameters([Parameter("method.flavour", value="spicy")])[0]
        assert not res.successful and "gain=3.5 is too much" in res.reason  # its validate
        assert node.get_parameter("method.flavour").value == "plain"
        assert "a change rebuilds the method" in node.describe_parameters(
            ["method.seed"])[0].description
    finally:
        node.destroy_node()


def test_a_bad_start_value_stops_the_node_naming_it(ros_context, probe_method) -> None:
    with pytest.raises(ValueError, match=r"method.gain=9.0 above 4"):
        _node(ros_context, probe_method, **{"method.gain": 9.0})


def test_changes_reach_the_method_live_or_by_a_rebuild(ros_context, probe_method) -> None:
    """lr through set_lr (the same method object, its effective rate changed); a field
    without a setter rebuilds the method between batches, with the new value."""
    node = _node(ros_context, "tent")
    try:
        first = node.method
        assert first.effective_lr(64) == pytest.approx(1e-3)  # 32 px card: Adam 1e-3 preset
        assert node.set_parameters([Parameter("method.lr", value=0.02)])[0].successful
        assert wait_for(lambda: first.effective_lr(64) == pytest.approx(0.02), 5.0)
        assert node.method is first
        assert node.set_parameters([Parameter("method.reforward", value=True)])[0].successful
        assert wait_for(lambda: node.method is not first, 10.0)
        assert node.method.config.reforward is True and node.method.config.lr == 0.02
    finally:
        node.destroy_node()


def test_a_new_method_swaps_the_method_parameters(ros_context, probe_method) -> None:
    node = _node(ros_context, "tent")
    try:
        assert node.has_parameter("method.reforward") and not node.has_parameter("method.gain")
        res = node.set_parameters_atomically([Parameter("method", value=probe_method),
                                              Parameter("method.lr", value=0.1)])
        assert not res.successful and "set method alone" in res.reason
        assert node.set_parameters([Parameter("method", value=probe_method)])[0].successful
        assert node.has_parameter("method.gain") and not node.has_parameter("method.reforward")
        assert wait_for(lambda: isinstance(node.method, ProbeMethod), 10.0)
        assert node.set_parameters([Parameter("method.gain", value=1.0)])[0].successful
        assert wait_for(lambda: node.method.config.gain == 1.0, 10.0)
        built = node.method
        assert node.set_parameters([Parameter("method.seed", value=1)])[0].successful
        assert wait_for(lambda: node.method is not built, 10.0)  # runtime=False: rebuilt
        assert node.method.config.seed == 1 and node.method.config.gain == 1.0
        with pytest.raises(ParameterNotDeclaredException):
            node.set_parameters([Parameter("method.reforward", value=True)])
        assert node.set_parameters([Parameter("method", value="surgeon")])[0].successful
        units = node.describe_parameters(["method.units"])[0]
        assert units.type == ParameterType.PARAMETER_STRING_ARRAY  # typed though empty
        assert node.get_parameter("method.units").value == []
        assert "[None = None]" not in units.description
        lr = node.describe_parameters(["method.lr"])[0]  # optional: 0 stands for None
        assert "[0.0 = None]" in lr.description and node.get_parameter("method.lr").value == 0
    finally:
        node.destroy_node()


def test_precision_is_a_parameter_checked_against_the_method_and_the_device(
        ros_context) -> None:
    """method.precision: bf16 runs on the CPU (a rebuild), fp16 needs CUDA, a method whose
    forward does not take a reduced precision refuses it, an unknown value is named."""
    node = _node(ros_context, "source")
    try:
        desc = node.describe_parameters(["method.precision"])[0]
        assert "one of: fp32, fp16, bf16" in desc.description
        assert node.has_parameter("method.cuda_graphs")
        res = node.set_parameters([Parameter("method.precision", value="fp16")])[0]
        assert not res.successful and "precision='fp16' needs a CUDA device" in res.reason
        res = node.set_parameters([Parameter("method.precision", value="fp8")])[0]
        assert not res.successful and "'fp8'" in res.reason
        first = node.method
        assert node.set_parameters([Parameter("method.precision", value="bf16")])[0].successful
        assert wait_for(lambda: node.method is not first, 10.0)
        assert node.method.config.precision == "bf16"
    finally:
        node.destroy_node()
    with pytest.raises(ValueError, match=r"method\.precision='bf16': method eata serves fp32"):
        _node(ros_context, "eata", **{"method.precision": "bf16"})
