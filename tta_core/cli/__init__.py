"""The `tta` command. Subcommands are the command modules named by the `tta.commands` entry
points (declared in setup.py, so tta_core never names tta_ros or any other provider); each
module defines

    NAME: str                      # subcommand name (= the entry point's name)
    HELP: str                      # one line for `tta --help`
    def add_arguments(parser) -> None
    def run(args) -> int           # exit status

so adding a command never edits a shared list. An install made before the group existed has
no `tta.commands` entry points: then the modules in tta_core.cli.commands are scanned
instead (no ROS 2 commands); a fresh `make setup` (pip install -e .) installs the group.

Every command module is imported to build the parser, so a command module stays light at
import: torch, numpy, rclpy and the tta_core modules that use them are imported inside
run(), and choices or defaults that live in such modules are copied (tta_core.cli.choices,
constants in the command module; test/system/test_cli_fast.py checks them). `tta --help`
and `tta <cmd> --help` then answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from importlib import metadata
from types import ModuleType

from tta_core import __version__
from tta_core.errors import one_line_errors
from tta_core.runtime.malloc_tuning import keep_freed_memory

ENTRY_POINT_GROUP = "tta.commands"
FALLBACK_PACKAGE = "tta_core.cli.commands"
COMMAND_ATTRIBUTES = ("NAME", "HELP", "add_arguments", "run")


def _load(ep: metadata.EntryPoint) -> ModuleType:
    """The command module of one entry point, checked for the command attributes."""
    try:
        mod = ep.load()
    except Exception as exc:
        raise ImportError(f"tta command {ep.name!r} ({ep.value}) cannot be loaded: "
                          f"{type(exc).__name__}: {exc}") from exc
    missing = [a for a in COMMAND_ATTRIBUTES if not hasattr(mod, a)]
    if missing:
        raise TypeError(f"tta command {ep.name!r} ({ep.value}) is not a command module: "
                        f"it lacks {', '.join(missing)}")
    if mod.NAME != ep.name:
        raise ValueError(f"tta command entry point {ep.name!r} ({ep.value}) names a module "
                         f"whose NAME is {mod.NAME!r}")
    return mod


def _scan(package: str) -> list[ModuleType]:
    """Every public module of `package` (the fallback without entry points)."""
    pkg = importlib.import_module(package)
    return [importlib.import_module(f"{package}.{info.name}")
            for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name)
            if not info.name.startswith("_")]


def discover() -> list[ModuleType]:
    """The command modules, sorted by name: the entry points, else the fallback package."""
    eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not eps:
        return _scan(FALLBACK_PACKAGE)
    names = [ep.name for ep in eps]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tta commands declared more than once: {', '.join(dup)}")
    return [_load(ep) for ep in eps]


def build_parser() -> argparse.ArgumentParser:
    """Parser with every discovered subcommand."""
    parser = argparse.ArgumentParser(
        prog="tta", description="Responsive test-time adaptation for ROS 2 vehicles."
    )
    parser.add_argument("--version", action="version", version=f"tta {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of its one-line message")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in discover():
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
    with one_line_errors("tta", debug=args.debug):  # bad input found past argparse
        return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
