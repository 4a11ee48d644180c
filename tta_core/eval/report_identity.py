"""What a report ran on, exactly: the samples used, the model and its weights (path and
sha256 prefix), the data (kind, folder and a content identity), and the code version;
`tta bench` records it as `meta.ran` of every run in report.json, so that a figure can be
traced to exactly what produced it."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tta_core import __version__

HASH_CHARS = 16  # hex digits of a sha256 kept: 64 bits, enough to tell files apart


def sha256_prefix(path: str | Path, chars: int = HASH_CHARS) -> str:
    """The first `chars` hex digits of the file's sha256 (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:chars]


def code_version() -> str:
    """`git describe --always --dirty` of the checkout tta_core runs from, else
    "tta <package version>" (an installed package, or no git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
            desc = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                                  capture_output=True, text=True, timeout=30)
            if desc.returncode == 0 and desc.stdout.strip():
                return desc.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"tta {__version__}"


def folder_identity(root: str | Path) -> dict[str, Any]:
    """A folder's content identity without reading every byte: file count, total size and
    the sha256 prefix of its sorted listing ("relative path<TAB>size" per file)."""
    root = Path(root).resolve()
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            p = Path(dirpath) / name
            entries.append((p.relative_to(root).as_posix(), p.stat().st_size))
    entries.sort()
    listing = "".join(f"{rel}\t{size}\n" for rel, size in entries)
    return {"path": str(root), "files": len(entries), "bytes": sum(s for _, s in entries),
            "listing_sha256": hashlib.sha256(listing.encode()).hexdigest()[:HASH_CHARS]}


def samples_used(domains: Sequence[str], requested: int) -> dict[str, Any]:
    """Samples per domain actually in the stream (frames of each domain name, all visits),
    the length of each visit (a run of consecutive frames of one domain), their total and
    the --samples-per-domain asked for."""
    runs: list[list[Any]] = []
    for d in domains:
        if runs and runs[-1][0] == d:
            runs[-1][1] += 1
        else:
            runs.append([d, 1])
    return {"total": len(domains), "per_domain": dict(Counter(domains)),
            "visits": [[d, n] for d, n in runs] if len(runs) <= 1000 else None,
            "requested_per_domain": requested}


def samples_text(samples: dict[str, Any]) -> str:
    """'200 samples per domain'; '40 samples per domain visit, 2 visits each (240 in
    all)' for a recurring stream; '8–12 samples per domain (40 in all)' when they differ."""
    counts = list(samples["per_domain"].values()) or [0]
    lo, hi = min(counts), max(counts)
    visits = samples.get("visits") or []
    lengths = {n for _, n in visits}
    per_domain = Counter(d for d, _ in visits)
    if len(lengths) == 1 and len(set(per_domain.values())) == 1 and len(visits) > len(
            per_domain) and min(lengths) > 1:
        return (f"{lengths.pop()} samples per domain visit, {next(iter(per_domain.values()))} "
                f"visits each ({samples['total']} in all)")
    if lo == hi:
        return f"{lo} samples per domain"
    return f"{lo}–{hi} samples per domain ({samples['total']} in all)"
