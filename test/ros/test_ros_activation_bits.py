"""`activation_bits` (DAF) in the perception node: its options reach the method, and a node
adapting at 4 bits over real rclpy + DDS reports the width and rebuilds at another."""

from __future__ import annotations

import pytest

pytest.importorskip("rclpy")
from helpers import wait_for
from helpers.ros import Rig, image_msg

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the unit tier's file


def test_perception_passes_activation_bits_to_methods_that_take_it() -> None:
    from tta_ros.nodes.method_params import MethodOptions, apply_live

    assert MethodOptions("adashadow").config()["activation_bits"] is None  # 0: dense
    for method in ("adashadow", "tent", "surgeon"):
        opts = MethodOptions(method, {"method.activation_bits": 4})
        assert opts.config()["activation_bits"] == 4 and opts.check(opts.values) == ""
    assert "method.activation_bits" not in MethodOptions("bn_adapt").params
    both = {"method.activation_bits": 4, "method.memory_budget_mb": 1.0}
    assert "exclude each other" in MethodOptions("adashadow").check(both)  # its validate
    assert apply_live(object(), {"activation_bits": 8}) == {"activation_bits"}  # rebuild


def test_perception_node_adapts_with_activation_bits_over_rclpy(ros_context) -> None:
    """A perception node with activation_bits 4 answers every frame; its diagnostics say
    the width and the saved MiB measured; setting 8 rebuilds the method at 8 bits, and a
    width the codec has not (3) is refused with the node still serving."""
    from rclpy.parameter import Parameter

    rig = Rig(ros_context, perception={"method": "tent", "method.activation_bits": 4})
    try:
        node = rig.perception
        assert node.method.config.activation_bits == 4
        rig.send([image_msg(1000 + i) for i in range(8)])
        assert wait_for(lambda: len(rig.msgs("pred")) >= 8, 20.0)
        assert wait_for(lambda: any(kv.key == "activation_bits" and kv.value == "4"
                                    for s in rig.statuses("adaptation") for kv in s.values),
                        10.0)
        saved = [float(kv.value) for s in rig.statuses("adaptation") for kv in s.values
                 if kv.key == "saved_activation_mib"]
        assert any(0 < v < 10 for v in saved), saved
        res = node.set_parameters([Parameter("method.activation_bits", value=3)])[0]
        assert not res.successful and "activation_bits=3" in res.reason, res.reason
        assert not node.has_parameter("method.memory_budget_mb")  # tent has none
        assert node.set_parameters([Parameter("method.activation_bits", value=8)])[0].successful
        rig.send([image_msg(1000 + i) for i in range(8, 12)])  # applied between batches
        assert wait_for(lambda: len(rig.msgs("pred")) >= 12, 20.0)
        assert node.method.config.activation_bits == 8
    finally:
        rig.close()



def test_a_memory_budget_change_is_applied_live_where_a_codec_runs() -> None:
    """`method.activation_budget_mb` reaches a running DAF codec without a rebuild (its
    widths follow on the next batch); a method without a codec needs the rebuild."""
    import torch

    from tta_core.model.zoo import build_model
    from tta_core.registry import build_method
    from tta_ros.nodes.method_params import apply_live

    torch.manual_seed(0)
    method = build_method("tent", build_model("small_resnet", 10), activation_budget_mb=0.5)
    x = torch.randn(4, 3, 32, 32)
    first = method.step(x).stats["saved_bytes"]
    assert apply_live(method, {"activation_budget_mb": 0.2}) == set()
    assert method.config.activation_budget_mb == 0.2
    after = method.step(x).stats["saved_bytes"]
    assert after <= 0.2 * 2**20 < first
    dense = build_method("tent", build_model("small_resnet", 10))
    assert apply_live(dense, {"activation_budget_mb": 0.05}) == {"activation_budget_mb"}
