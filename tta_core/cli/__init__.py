"""The `tta` command. Subcommands are modules discovered in `tta_core.cli.commands`
(and `tta_ros.commands` when tta_ros is installed); each module defines

    NAME: str                      # subcommand name
    HELP: str                      # one line for `tta --help`
    def add_arguments(parser) -> None
    def run(args) -> int           # exit status

so adding a command never edits a shared list.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from tta_core import __version__
from tta_core.runtime.malloc_tuning import keep_freed_memory

_COMMAND_PACKAGES = ("tta_core.cli.commands", "tta_ros.commands")


def _discover() -> list[ModuleType]:
    found: list[ModuleType] = []
    for pkg_name in _COMMAND_PACKAGES:
        try:
            pkg = importlib.import_module(pkg_name)
        except ModuleNotFoundError as exc:
            if exc.name and pkg_name.startswith(exc.name):
                continue  # optional package not installed
            raise
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if not info.name.startswith("_"):
                found.append(importlib.import_module(f"{pkg_name}.{info.name}"))
    return found


def build_parser() -> argparse.ArgumentParser:
    """Parser with every discovered subcommand."""
    parser = argparse.ArgumentParser(
        prog="tta", description="Responsive test-time adaptation for ROS 2 vehicles."
    )
    parser.add_argument("--version", action="version", version=f"tta {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _discover():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tta` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    keep_freed_memory()  # steadier, faster CPU timings (tta_core.runtime.malloc_tuning)
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:  # bad input found past argparse: the message names it
        raise SystemExit(f"tta: error: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
