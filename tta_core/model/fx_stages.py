"""Stages of a model outside the known families, cut from its torch.fx graph.

The traced graph (the parameter-owning layers kept whole, as leaves) is cut where exactly
one value crosses from the nodes before to those after, between two top-level blocks
(`_block`: the first module below the Sequential/ModuleList containers on a node's path).
Each piece becomes a GraphModule over the model's own layers, so the pieces chained equal
the model's forward. A cut is kept only where `model(x)` shows its value: the input of a
module called once that starts right after the cut (a forward pre-hook) or the output of
a layer called once that ends right before it (a forward hook) -- `Tap`; `check_split`
then confirms by running both (`units.decompose` falls back to one stage otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx, nn

log = logging.getLogger(__name__)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class Tap:
    """Where model.forward shows a stage's input: `path`'s first input (pre) or output."""

    path: str
    pre: bool


@dataclass
class Segment:
    """One stage: the graph piece, the names of the modules it runs, how to see its input."""

    name: str
    module: fx.GraphModule
    cut: int  # position of the cut before it (split's `drop`); -1 for the first
    owners: set[str] = field(default_factory=set)  # module paths called / read in it
    tap: Tap | None = None  # None for the first segment (its input is the model's)


class _Tracer(fx.Tracer):
    """symbolic_trace with `leaves` kept whole, noting where each module call starts."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self.leaves = leaves
        # (module path, node of its first argument, number of graph nodes before the call)
        self.entries: list[tuple[str, fx.Node | None, int]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> object:
        first = args[0].node if args and isinstance(args[0], fx.Proxy) else None
        self.entries.append((self.path_of_module(m), first, len(self.graph.nodes)))
        return super().call_module(m, forward, args, kwargs)


def _block(model: nn.Module, path: str) -> str:
    """The top-level block holding module `path`: below the containers whose children
    hold modules of their own (an EfficientNet stage: its MBConvs are the blocks)."""
    if not path:
        return ""
    cur, parts = model, path.split(".")
    for i, part in enumerate(parts):
        cur = cur._modules.get(part)
        if cur is None:
            return path
        if not (isinstance(cur, _CONTAINERS) and any(c._modules for c in cur.children())):
            return ".".join(parts[: i + 1])
    return path


def _node_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _block_keys(model: nn.Module, nodes: list[fx.Node]) -> list[str]:
    """Per compute node: its block; nodes outside any module take the next node's block
    (the flatten before a head), the last ones the previous block."""
    keys = [_block(model, _node_path(n)) for n in nodes]
    nxt = ""
    for i in range(len(keys) - 1, -1, -1):
        keys[i] = keys[i] or nxt
        nxt = keys[i]
    prev = ""
    for i, k in enumerate(keys):
        keys[i] = k or prev
        prev = keys[i]
    return keys


def _single_live(nodes: list[fx.Node]) -> list[fx.Node | None]:
    """Per position i: the one value computed at or before nodes[i] and used after it,
    None where there are more or none (parameters, get_attr, never count)."""
    pos = {n: i for i, n in enumerate(nodes)}
    live: set[fx.Node] = set()
    out: list[fx.Node | None] = []
    ends: dict[int, list[fx.Node]] = {}
    for i, n in enumerate(nodes):
        users = [pos[u] for u in n.users if u in pos]
        if users:
            live.add(n)
            ends.setdefault(max(users), []).append(n)
        for done in ends.pop(i, []):
            live.discard(done)
        out.append(next(iter(live)) if len(live) == 1 else None)
    return out


def _tap(tracer: _Tracer, value: fx.Node, nxt: fx.Node,
         starting: dict[fx.Node, list[tuple[str, fx.Node | None]]]) -> Tap | None:
    """How model.forward shows `value` at the cut before compute node `nxt`: a module
    called once whose first input it is and whose call begins with `nxt` (outermost
    first), else the layer called once that computed it."""
    for path, first in starting.get(nxt, []):
        if first is value and tracer.num_calls.get(path) == 1:
            return Tap(path, pre=True)
    if value.op == "call_module" and tracer.num_calls.get(str(value.target)) == 1:
        return Tap(str(value.target), pre=False)
    return None


def _starting(tracer: _Tracer, everything: list[fx.Node]
              ) -> dict[fx.Node, list[tuple[str, fx.Node | None]]]:
    """Per compute node: the module calls (path, first argument) that begin with it."""
    out: dict[fx.Node, list[tuple[str, fx.Node | None]]] = {}
    for path, first, start in tracer.entries:  # in call order: outermost first
        i = start
        while i < len(everything) and everything[i].op == "get_attr":
            i += 1
        if i < len(everything):
            out.setdefault(everything[i], []).append((path, first))
    return out


def _cuts(model: nn.Module, tracer: _Tracer, graph: fx.Graph
          ) -> tuple[list[fx.Node], list[tuple[int, fx.Node, Tap]], list[str]] | None:
    """Compute nodes, the cuts (position in them, the value crossing, its tap), blocks."""
    everything = list(graph.nodes)
    starting = _starting(tracer, everything)
    nodes = [n for n in everything if n.op not in ("get_attr", "output")]
    if sum(n.op == "placeholder" for n in nodes) != 1 or nodes[0].op != "placeholder":
        return None
    keys = _block_keys(model, nodes)
    live = _single_live(nodes)
    cuts = []
    for i in range(1, len(nodes) - 1):
        value = live[i]
        if keys[i] == keys[i + 1] or value is None:
            continue
        tap = _tap(tracer, value, nodes[i + 1], starting)
        if tap is not None:
            cuts.append((i, value, tap))
    return nodes, cuts, keys


def _piece(model: nn.Module, nodes: list[fx.Node], inp: fx.Node, out: fx.Node
           ) -> tuple[fx.GraphModule, set[str]]:
    """GraphModule running `nodes` from value `inp` to value `out`, and its owners."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {inp: g.placeholder("x")}
    owners: set[str] = set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = g.get_attr(a.target)
                owners.add(str(a.target).rpartition(".")[0])
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "call_module":
            owners.add(str(n.target))
    g.output(env[out])
    return fx.GraphModule(model, g), owners


def split(model: nn.Module, leaves: set[int], drop: frozenset[int] = frozenset()
          ) -> list[Segment] | None:
    """The model's segments (see the module docstring), without the cuts at the positions
    in `drop` (`Segment.cut`); None where fx cannot trace it or its graph has not one
    input and one output."""
    tracer = _Tracer(leaves)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # any tracing failure: one stage
        log.debug("torch.fx cannot trace %s (%s: %s): one stage, reforward from the input",
                  type(model).__name__, type(exc).__name__, exc)
        return None
    found = _cuts(model, tracer, graph)
    result = next(n for n in graph.nodes if n.op == "output").args[0]
    if found is None or not isinstance(result, fx.Node):
        log.debug("%s: its graph has not one input and one output: one stage",
                  type(model).__name__)
        return None
    nodes, cuts, keys = found
    bounds = [(0, nodes[0], None), *((i + 1, v, t) for i, v, t in cuts if i not in drop)]
    segments = []
    for (start, inp, tap), (end, _v, _t) in zip(
            bounds, [*bounds[1:], (len(nodes), result, None)], strict=True):
        out = result if end == len(nodes) else nodes[end - 1]
        piece = [n for n in nodes[start:end] if n.op != "placeholder"]
        gm, owners = _piece(model, piece, inp, out)
        first, last = keys[max(start, 1)], keys[end - 1]
        name = first if first == last else f"{first}..{last}"
        segments.append(Segment(name or "model", gm, start - 1, owners, tap))
    return segments


def check_split(model: nn.Module, segments: list[Segment], x: Tensor) -> list[int]:
    """The segments (from 1) whose input model(x) does not show once and unchanged at the
    end of the forward, equal to the chain's; [0] where only the chained output differs
    from model(x). Empty: the split holds on x."""
    seen: dict[int, list[tuple[Tensor, Tensor]]] = {}
    handles = []
    for s, seg in enumerate(segments[1:], start=1):
        def keep(t: object, s: int = s) -> None:
            if isinstance(t, Tensor):
                seen.setdefault(s, []).append((t, t.clone()))
        mod = model.get_submodule(seg.tap.path)
        handles.append(mod.register_forward_pre_hook(lambda _m, a, k=keep: k(a[0]))
                       if seg.tap.pre else
                       mod.register_forward_hook(lambda _m, _a, o, k=keep: k(o)))
    try:
        with torch.no_grad():
            full = model(x)
    finally:  # before the chain: the pieces run the same layers
        for handle in handles:
            handle.remove()
    bad, h = [], x
    with torch.no_grad():
        for s, seg in enumerate(segments):
            got = seen.get(s, [])
            if s and (len(got) != 1 or not _same(got[0][0], got[0][1])
                      or not _same(got[0][1], h)):
                bad.append(s)
            h = seg.module(h)
    if not bad and not (isinstance(h, Tensor) and _same(h, full)):
        bad.append(0)
    return bad


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))
