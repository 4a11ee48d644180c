"""The streaming benchmark (`tta bench --stream-hz`): each method at a camera rate with the
perception node's keep-latest queue and batching (eval.streaming).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from itertools import groupby
from typing import Any

import numpy as np
import torch
from torch import nn

from tta_core.api import DeadlineTunable, WarmsUp
from tta_core.eval.bench_config import BenchConfig, method_base, method_options
from tta_core.eval.bench_inputs import Batch, batches_from_arrays, build_stream
from tta_core.eval.streaming import (
    NODE_BATCH_WAIT_MS,
    NODE_QUEUE_SIZE,
    StreamResult,
    StreamSummary,
    simulate_stream,
    timed_step,
)
from tta_core.registry import build_method, method_class
from tta_core.runtime.gc_pauses import frozen_heap


def streaming_stream(cfg: BenchConfig, card: object, stream: list[Batch]) -> list[Batch]:
    """The stream of the streaming benchmark: the synthetic signs with tracks of
    cfg.stream_track frames (re-rendered views); a --data stream gets each image repeated
    stream_track times (no jitter), cut at its domain's length so domains keep their size."""
    k = cfg.stream_track
    if k == 1:
        return stream
    if not cfg.data:
        return build_stream(cfg, card, False, k)
    x = torch.cat([b.x for b in stream])
    labels = np.concatenate([b.labels for b in stream])
    domains = [b.domain for b in stream for _ in range(len(b.labels))]
    idx, start = [], 0
    for n in (len(list(g)) for _, g in groupby(domains)):  # each domain's run
        idx += [start + (j // k) * k for j in range(n)]
        start += n
    return batches_from_arrays(x[idx], labels[idx], [domains[i] for i in idx], cfg.batch_size)


def stream_options(name: str, cfg: BenchConfig, input_shape: tuple[int, ...],
                   hz: float) -> dict:
    """method_options for streaming at `hz`: a method with deadline modes (AdaShadow)
    plans against the camera's deadline at the stream's rate (deadline_mode "camera",
    camera_hz = hz) unless its deadline_mode is set by --set."""
    opts = method_options(name, cfg, input_shape)
    if "deadline_mode" in method_class(method_base(name)).config_cls.__dataclass_fields__:
        opts.setdefault("deadline_mode", "camera")
        if opts["deadline_mode"] == "camera":
            opts["camera_hz"] = float(hz)
    return opts


def stream_batch_wait_ms(hz: float, batch_size: int) -> float:
    """How long the streaming benchmark's node waits for a batch to fill: the camera's fill
    time, (batch_size - 1/2) frame periods, at least the node's default NODE_BATCH_WAIT_MS.
    A user sets the node's batch_timeout_s so at a slow camera (30 Hz, batch 4: 117 ms);
    with the default 50 ms there, batches close at 2 frames and batch statistics of 2
    images are what every BN-based method would be judged on."""
    return max(NODE_BATCH_WAIT_MS, (batch_size - 0.5) * 1000.0 / hz)


def warm_up(model: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of a copy of `model` on `x`: the process's first kernels
    at a shape pay one-time setup (kernel selection, allocations) that a camera node pays
    before its first frame; without this the first method's first steps would put tens of
    ms of it on the stream. `model` itself is untouched (its state and statistics)."""
    probe = copy.deepcopy(model).train()
    with torch.enable_grad():
        probe(x).logsumexp(1).mean().backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize()


def start_method(name: str, model: nn.Module, options: dict[str, Any],
                 sample: torch.Tensor) -> Any:
    """Method `name` (or a variant `name@label`) built on `model` with `options`, started
    as the perception node starts it: the process's first kernels at the shape of
    `sample` run first (`warm_up`), and a method that learns its run-time costs
    (api.WarmsUp) learns them on noise of that shape."""
    warm_up(model, sample)
    meth = build_method(method_base(name), model, **options)
    if isinstance(meth, WarmsUp):
        meth.warm_up(torch.randn_like(sample))
    return meth


def stream_method(name: str, model: nn.Module, stream: Sequence[Batch], cfg: BenchConfig,
                  hz: float, on_step: Callable[[Any], None] | None = None) -> StreamResult:
    """Method `name` in streaming mode at `hz` (eval.streaming) with the perception node's
    queue (keep-latest, NODE_QUEUE_SIZE frames) and batching (batch_size frames, waiting
    at most stream_batch_wait_ms after the first); its step time is its measured wall
    time. AdaShadow plans against each batch's deadline at `hz` (stream_options).
    `on_step` sees each step's StepResult (e.g. the sizes an elastic method served)."""
    torch.manual_seed(cfg.seed)
    x = torch.cat([b.x for b in stream])
    labels = np.concatenate([b.labels for b in stream]).tolist()
    domains = [b.domain for b in stream for _ in range(len(b.labels))]
    meth = start_method(name, model, stream_options(name, cfg, tuple(x.shape[1:]), hz),
                        x[:cfg.batch_size])
    cuda = x.device.type == "cuda"
    late_aware = isinstance(meth, DeadlineTunable)

    def run(frames: Sequence[int], late_ms: float) -> list[int]:
        if late_aware:
            meth.set_lateness(late_ms)  # as the node does: a backlog shortens the deadline
        res = meth.step(x[list(frames)])
        pred = res.logits.argmax(1)
        if on_step is not None:
            on_step(res)
        if cuda:
            torch.cuda.synchronize()
        return pred.tolist()

    try:
        with frozen_heap():  # as the node serves: full collections skip start-up objects
            return simulate_stream(labels, hz, timed_step(run), cfg.batch_size,
                                   NODE_QUEUE_SIZE, domains,
                                   stream_batch_wait_ms(hz, cfg.batch_size),
                                   cfg.stream_latency_ms)
    finally:
        meth.finish()
        meth.close()


def run_streaming(stream: Sequence[Batch], make_model: Callable[[], nn.Module],
                  cfg: BenchConfig) -> list[tuple[str, StreamSummary]]:
    """Every method of `cfg` at every rate of `cfg.stream_hz`, each on a fresh model."""
    cfg.validate()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    rows = []
    for name in cfg.methods:
        for hz in cfg.stream_hz:
            model = make_model().to(stream[0].x.device)
            rows.append((name, stream_method(name, model, stream, cfg, hz).summary))
            del model
    return rows
