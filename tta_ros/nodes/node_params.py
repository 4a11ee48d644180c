"""Every tta node's parameter names, by node: what one node is given for another is no
mistake when it comes from a section all nodes share (tta_ros.param_report.shared_elsewhere:
a `/**` model_card reaches the resource monitor too)."""

from __future__ import annotations

NODES = ("perception", "scheduler", "resource_monitor")


def parameter_names() -> dict[str, frozenset[str]]:
    """The parameters each node may declare, by node (perception: its own and every
    method's options)."""
    from tta_ros.nodes.fleet_wiring import NAMESPACES_PARAM
    from tta_ros.nodes.method_params import option_defaults
    from tta_ros.nodes.perception import param_specs
    from tta_ros.nodes.resource_monitor import PARAMS as MONITOR
    from tta_ros.nodes.scheduler import PARAMS as SCHEDULER

    return {"perception": frozenset({*(s.name for s in param_specs()), *option_defaults()}),
            "scheduler": frozenset({*(s.name for s in SCHEDULER), NAMESPACES_PARAM}),
            "resource_monitor": frozenset(s.name for s in MONITOR)}


def taken_elsewhere(node: str) -> frozenset[str]:
    """The parameters of the nodes other than `node` (one of NODES)."""
    if node not in NODES:
        raise ValueError(f"no tta node {node!r}; known: {', '.join(NODES)}")
    return frozenset().union(*(names for name, names in parameter_names().items()
                               if name != node))
