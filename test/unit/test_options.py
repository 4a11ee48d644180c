"""Method options that describe themselves (tta_core.runtime.options): every registered
method's config is annotated (help, a type a host can express, ranges that hold the
default), and `option` / `describe` / `check_value` behave as a host relies on."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from tta_core.registry import available_methods, method_class
from tta_core.runtime.options import OptionInfo, check_value, describe, option


def _infos() -> list[tuple[str, OptionInfo]]:
    return [(m, i) for m in available_methods() for i in describe(method_class(m).config_cls)]


def test_every_method_option_has_help_and_a_plain_type() -> None:
    missing = [f"{m}.{i.name}" for m, i in _infos() if not i.help.strip()]
    assert not missing, f"config fields without option(..., help): {missing}"
    odd = [f"{m}.{i.name}: {i.type}" for m, i in _infos() if not i.expressible]
    assert not odd, f"config fields no host can set: {odd}"


def test_every_default_lies_within_its_own_range_and_choices() -> None:
    bad = [f"{m}: {reason}" for m, i in _infos()
           if (reason := check_value(i, list(i.default) if i.is_list and i.default is not None
                                     else i.default))]
    assert not bad, bad
    assert all(i.low is None or i.high is None or i.low <= i.high for _, i in _infos())


def test_model_card_fields_are_not_user_settings() -> None:
    for m in available_methods():
        unset = {i.name for i in describe(method_class(m).config_cls) if not i.settable}
        assert unset == {"input_shape", "arch"}, (m, unset)


@dataclass
class _Demo:
    """A config of every kind of field."""

    rate: float = option(0.5, "a rate", low=0.0, high=1.0)
    count: int = option(3, "a count", low=1)
    name: str = option("a", "a choice", choices=("a", "b"))
    flag: bool = option(False, "a flag")
    limit: float | None = option(None, "an optional limit", low=0.0)
    shape: tuple[int, ...] = option((), "a tuple", settable=False)
    words: list[str] = option(["x"], "a mutable list")
    where: str | Path | None = option(None, "a file", path="read")
    raw: dict | None = None  # not annotated, no plain type


def test_describe_maps_annotations_to_plain_types() -> None:
    got = {i.name: (i.type, i.optional) for i in describe(_Demo)}
    assert got == {"rate": ("float", False), "count": ("int", False), "name": ("str", False),
                   "flag": ("bool", False), "limit": ("float", True),
                   "shape": ("list[int]", False), "words": ("list[str]", False),
                   "where": ("str", True), "raw": (got["raw"][0], True)}
    raw = next(i for i in describe(_Demo) if i.name == "raw")
    assert raw.type.startswith("unsupported") and not raw.expressible and raw.help == ""
    where = next(i for i in describe(_Demo) if i.name == "where")
    assert where.path == "read" and where.help == "a file"
    assert not next(i for i in describe(_Demo) if i.name == "shape").settable


def test_option_copies_mutable_defaults_per_instance() -> None:
    a, b = _Demo(), _Demo()
    a.words.append("y")
    assert b.words == ["x"]
    assert {f.name for f in fields(_Demo)} >= {"rate", "words"}


def test_check_value_names_the_option_and_the_value() -> None:
    info = {i.name: i for i in describe(_Demo)}
    assert check_value(info["rate"], 0.25) == ""
    assert check_value(info["rate"], 1.5) == "rate=1.5 above 1"
    assert check_value(info["count"], 0) == "count=0 below 1"
    assert check_value(info["name"], "c") == "name='c' not one of a, b"
    assert check_value(info["rate"], float("nan")) == "rate=nan is not finite"
    assert check_value(info["limit"], None) == ""
    assert "a value is required" in check_value(info["rate"], None)


def test_option_refuses_an_empty_range_and_an_unknown_path_kind() -> None:
    with pytest.raises(ValueError, match="empty"):
        option(1.0, "x", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="path 'dir'"):
        option("", "x", path="dir")
