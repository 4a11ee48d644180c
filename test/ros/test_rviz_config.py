"""tta_ros.rviz_config: the RViz file follows the image topic and namespace; the shipped
config/tta.rviz is its output for the defaults, so the two cannot drift."""

from __future__ import annotations

import pytest
import yaml
from helpers import ROOT

from tta_ros import bringup
from tta_ros.rviz_config import main, render, resolve_topic, write_rviz_config

SHIPPED = ROOT / "config" / "tta.rviz"


def _topics(doc: dict) -> dict[str, str]:
    return {d["Class"]: d["Topic"]["Value"] for d in doc["Visualization Manager"]["Displays"]
            if "Topic" in d}


def test_shipped_config_is_the_generators_default_output() -> None:
    assert SHIPPED.read_text() == render()
    assert _topics(yaml.safe_load(SHIPPED.read_text()))[
        "rviz_default_plugins/Image"] == "/image"


@pytest.mark.parametrize(("topic", "ns", "image", "markers"), [
    ("/camera/front/image_raw", "", "/camera/front/image_raw", "/layer_markers"),
    ("image", "car1", "/car1/image", "/car1/layer_markers"),
    ("cam/raw", "/fleet/car2/", "/fleet/car2/cam/raw", "/fleet/car2/layer_markers"),
    ("/abs/image", "car1", "/abs/image", "/car1/layer_markers"),
])
def test_written_file_is_yaml_with_the_given_topics(tmp_path, topic, ns, image,
                                                    markers) -> None:
    path = write_rviz_config(tmp_path / "sub" / "v.rviz", topic, ns, fixed_frame="map")
    doc = yaml.safe_load(path.read_text())
    assert _topics(doc) == {"rviz_default_plugins/Image": image,
                            "rviz_default_plugins/MarkerArray": markers}
    assert doc["Visualization Manager"]["Global Options"]["Fixed Frame"] == "map"


def test_default_fixed_frame_is_the_schedulers_marker_frame() -> None:
    doc = yaml.safe_load(render())
    sched = bringup.load_params(ROOT / "config" / "vehicle.yaml")["scheduler"]
    assert doc["Visualization Manager"]["Global Options"]["Fixed Frame"] == \
        sched["marker_frame_id"]


def test_private_or_empty_topic_is_refused() -> None:
    for bad in ("", "~/image"):
        with pytest.raises(ValueError, match="topic"):
            resolve_topic(bad, "car1")


def test_cli_writes_the_file_and_reports_bad_topics(tmp_path, capsys) -> None:
    out = tmp_path / "car1.rviz"
    assert main(["--image-topic", "/cam", "--namespace", "car1", "-o", str(out)]) == 0
    assert _topics(yaml.safe_load(out.read_text()))["rviz_default_plugins/Image"] == "/cam"
    assert main(["--image-topic", "~/x"]) == 2
    assert "error: topic" in capsys.readouterr().err
    assert main([]) == 0
    assert capsys.readouterr().out == render()


@pytest.mark.parametrize(("ns", "prefix"), [("", ""), ("car1", "/car1")])
def test_segmentation_mask_and_overlay_are_shown_in_the_namespace(ns, prefix) -> None:
    doc = yaml.safe_load(render(namespace=ns))
    shown = {d["Name"]: d for d in doc["Visualization Manager"]["Displays"]}
    mask, over = shown["Segmentation mask"], shown["Segmentation overlay"]
    assert mask["Topic"]["Value"] == f"{prefix}/segmentation" and mask["Enabled"]
    assert over["Topic"]["Value"] == f"{prefix}/segmentation_overlay" and over["Enabled"]
    assert mask["Class"] == over["Class"] == "rviz_default_plugins/Image"
    assert mask["Normalize Range"] and not over["Normalize Range"]  # ids 0-18: stretched
    assert shown["Camera"]["Topic"]["Value"] == f"{prefix}/image"
