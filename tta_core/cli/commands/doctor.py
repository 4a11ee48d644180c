"""`tta doctor`: report whether torch, CUDA, rclpy, the rmw, tta_msgs and jtop are usable."""

from __future__ import annotations

import argparse

NAME = "doctor"
HELP = "check the environment (torch, CUDA, rclpy, rmw, tta_msgs, jtop) and print fixes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--no-color."""
    parser.add_argument("--no-color", action="store_true", help="plain output")


def run(args: argparse.Namespace) -> int:
    """Print the table of checks; 0 when every required one passes."""
    from rich.console import Console
    from rich.table import Table

    from tta_core.runtime.doctor import healthy, run_checks

    checks = run_checks()
    table = Table(title="tta doctor", show_lines=False)
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for c in checks:
        status = "OK" if c.ok else ("MISSING" if c.required else "optional")
        style = "green" if c.ok else ("red" if c.required else "yellow")
        table.add_row(c.name, f"[{style}]{status}[/{style}]", c.detail, c.fix)
    console = Console(no_color=args.no_color, width=140)
    console.print(table)
    ok = healthy(checks)
    console.print("all required checks passed" if ok else "some required checks FAILED")
    return 0 if ok else 1
