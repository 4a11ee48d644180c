"""Files of the streaming benchmark (`tta bench --stream-hz`): streaming.md (method × frame
rate: strict, streaming and answered %, and the batches that met their deadline),
streaming.json (the summaries) and streaming.png (accuracy vs frame rate per method, strict
solid, streaming dashed). Metric definitions: tta_core.eval.streaming."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from tta_core.eval.report import write_json_atomic
from tta_core.eval.streaming import StreamSummary

# (method, summary at one rate)
StreamRow = tuple[str, StreamSummary]


def _rates(rows: Sequence[StreamRow]) -> list[float]:
    return sorted({s.hz for _, s in rows})


def _methods(rows: Sequence[StreamRow]) -> list[str]:
    return list(dict.fromkeys(m for m, _ in rows))


def _hz(hz: float) -> str:
    return f"{hz:g} Hz"


def _head(rows: Sequence[StreamRow], batch_size: int, queue_size: int, track: int) -> str:
    lat = ", ".join(f"{_hz(s.hz)}: {s.latency_ms:.3g} ms" for s in
                    {s.hz: s for _, s in rows}.values())
    return ("Streaming accuracy in % (strict / streaming / answered by the deadline), batch "
            f"{batch_size}, keep-latest queue {queue_size}, each sign seen over {track} "
            f"frames; step time = measured wall time. A frame's deadline is its arrival + L "
            f"(L per rate: {lat}); strict: its own prediction by then and right; streaming: "
            "the newest prediction by then for it or an earlier frame, right for it.\n\n")


def streaming_table(rows: Sequence[StreamRow], batch_size: int, queue_size: int,
                    track: int = 1, offline: Mapping[str, float] | None = None) -> str:
    """Markdown: one row per method, per rate the cells strict / streaming / answered in %;
    `offline` (method -> share right when every batch is waited for, the offline report's
    accuracy over all frames) adds a reference column."""
    rates = _rates(rows)
    by = {(m, s.hz): s for m, s in rows}
    offline = dict(offline or {})
    head = _head(rows, batch_size, queue_size, track)
    if offline:
        head += ("offline: the same method on the same frames, every batch waited for "
                 "(report.md's accuracy over all frames).\n\n")
    head += ("Deadline met in %: batches whose step time was within their deadline, "
             "len(frames) / rate (the batch is done before as many new frames have arrived; "
             "AdaShadow plans against it: deadline_mode camera at the stream's rate).\n\n")
    ref = " offline |" if offline else ""
    lines = ["| method |" + ref + " " + " | ".join(_hz(r) for r in rates) + " |",
             "|---|" + "---|" * (len(rates) + bool(offline))]
    met = ["", "| method | " + " | ".join(_hz(r) for r in rates) + " |",
           "|---|" + "---|" * len(rates)]
    for m in _methods(rows):
        cells, met_cells = [], []
        for r in rates:
            s = by.get((m, r))
            cells.append("–" if s is None else
                         f"{100 * s.strict:.1f} / {100 * s.streaming:.1f} / "
                         f"{100 * s.answered:.1f}")
            met_cells.append("–" if s is None else f"{100 * s.deadline_met:.1f}")
        if offline:
            acc = offline.get(m)
            cells.insert(0, "–" if acc is None else f"{100 * acc:.1f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
        met.append(f"| {m} | " + " | ".join(met_cells) + " |")
    return head + "\n".join(lines) + "\n\nDeadline met in %:\n" + "\n".join(met) + "\n"


def _plot(rows: Sequence[StreamRow], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in _methods(rows):
        pts = sorted((s.hz, s.strict, s.streaming) for name, s in rows if name == m)
        line, = ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", label=m)
        ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], "x--", color=line.get_color())
    rates = _rates(rows)
    ax.set_xscale("log")  # rates are usually chosen geometrically (30, 60, 120, ...)
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.minorticks_off()
    ax.set_xlabel("frame rate (Hz)")
    ax.set_ylabel("streaming accuracy (%)")
    ax.set_title("streaming accuracy vs frame rate (solid strict, dashed streaming)")
    top = max((100 * max(s.strict, s.streaming) for _, s in rows), default=100.0)
    ax.set_ylim(0, min(100.0, top + 10.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_streaming(rows: Sequence[StreamRow], out_dir: str | Path, batch_size: int,
                    queue_size: int, track: int = 1,
                    offline: Mapping[str, float] | None = None) -> tuple[list[Path], str]:
    """Write streaming.md, streaming.json and streaming.png; returns paths and markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = streaming_table(rows, batch_size, queue_size, track, offline)
    md = out / "streaming.md"
    md.write_text("# tta bench — streaming accuracy\n\n" + text)
    js = out / "streaming.json"
    write_json_atomic(js, {"batch_size": batch_size, "queue_size": queue_size,
                           "track_length": track, "offline": dict(offline or {}),
                           "runs": [{"method": m, **asdict(s)} for m, s in rows]})
    return [md, js, _plot(rows, out / "streaming.png")], text
