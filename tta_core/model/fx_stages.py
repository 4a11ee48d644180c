"""Stages of a model outside the known families, cut from its torch.fx graph.

The traced graph (the parameter-owning layers kept whole, as leaves) is cut where at most
`MAX_CROSSING` values cross from the nodes before to those after, between two top-level
blocks (`_block`: the first module below the Sequential/ModuleList containers on a node's
path, under the chain of single-child wrappers at the root). Each piece becomes a
GraphModule over the model's own layers, so the pieces chained equal the model's forward;
a piece after a cut that several values cross takes (and the piece before returns) them
as a tuple, in the order they were computed. A segmentation net crosses several: its
input (whose shape the last upsampling reads) and a low-level feature its head joins. A
cut is kept only where `model(x)` shows each value: the last one computed as the input of
a module called once that starts right after the cut (a forward pre-hook) or as the output
of a layer called once that ends right before it (a forward hook); an earlier one as the
output of the layer called once that computed it, or the model's input -- `Tap`;
`check_split` then confirms by running both (`units.decompose` falls back to one stage
otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx, nn

log = logging.getLogger(__name__)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
#: the most values a cut may cross (a segmentation net: its input, a skip feature, the trunk)
MAX_CROSSING = 3


@dataclass(frozen=True)
class Tap:
    """Where model.forward shows a stage's input: `path`'s first input (pre) or output
    (path "": the model's own input)."""

    path: str
    pre: bool


@dataclass
class Segment:
    """One stage: the graph piece, the names of the modules it runs, how to see its input
    (one tap per value crossing the cut before it, in the order they were computed: the
    piece's arguments; the last tap fires at the cut)."""

    name: str
    module: fx.GraphModule
    cut: int  # position of the cut before it (split's `drop`); -1 for the first
    owners: set[str] = field(default_factory=set)  # module paths called / read in it
    taps: tuple[Tap, ...] = ()  # () for the first segment (its input is the model's)

    @property
    def tap(self) -> Tap | None:
        """The tap that fires at the cut (the last value computed); None for the first."""
        return self.taps[-1] if self.taps else None


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


def _wrapper_depth(model: nn.Module) -> int:
    """How many single-child wrappers sit at the root (a module whose forward calls one
    model that holds all the layers: the segmentation card's net around torchvision's)."""
    depth, cur = 0, model
    while len(cur._modules) == 1:
        child = next(iter(cur._modules.values()))
        if child is None or not child._modules or any(
                cur._parameters.values()) or any(cur._buffers.values()):
            break
        depth, cur = depth + 1, child
    return depth


def _block(model: nn.Module, path: str, skip: int = 0) -> str:
    """The top-level block holding module `path`: below the `skip` root wrappers
    (`_wrapper_depth`) and the containers whose children hold modules of their own (an
    EfficientNet stage: its MBConvs are the blocks)."""
    if not path:
        return ""
    cur, parts = model, path.split(".")
    for i, part in enumerate(parts):
        if i < skip:
            cur = cur._modules.get(part)
            if cur is None:
                return path
            continue
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
    skip = _wrapper_depth(model)
    keys = [_block(model, _node_path(n), skip) for n in nodes]
    nxt = ""
    for i in range(len(keys) - 1, -1, -1):
        keys[i] = keys[i] or nxt
        nxt = keys[i]
    prev = ""
    for i, k in enumerate(keys):
        keys[i] = k or prev
        prev = keys[i]
    return keys


def _crossing(nodes: list[fx.Node]) -> list[tuple[fx.Node, ...] | None]:
    """Per position i: the values computed at or before nodes[i] and used after it, in the
    order they were computed; None where there are none or more than MAX_CROSSING
    (parameters, get_attr, never count)."""
    pos = {n: i for i, n in enumerate(nodes)}
    live: dict[fx.Node, None] = {}  # insertion order: computation order
    out: list[tuple[fx.Node, ...] | None] = []
    ends: dict[int, list[fx.Node]] = {}
    for i, n in enumerate(nodes):
        users = [pos[u] for u in n.users if u in pos]
        if users:
            live[n] = None
            ends.setdefault(max(users), []).append(n)
        for done in ends.pop(i, []):
            live.pop(done, None)
        out.append(tuple(live) if 0 < len(live) <= MAX_CROSSING else None)
    return out


def _tap(tracer: _Tracer, value: fx.Node, nxt: fx.Node | None,
         starting: dict[fx.Node, list[tuple[str, fx.Node | None]]]) -> Tap | None:
    """How model.forward shows `value` at the cut before compute node `nxt` (None: a value
    computed before the last one crossing): a module called once whose first input it is
    and whose call begins with `nxt` (outermost first), else the layer called once that
    computed it, or the model's input itself."""
    for path, first in starting.get(nxt, []) if nxt is not None else []:
        if first is value and tracer.num_calls.get(path) == 1:
            return Tap(path, pre=True)
    if value.op == "call_module" and tracer.num_calls.get(str(value.target)) == 1:
        return Tap(str(value.target), pre=False)
    if value.op == "placeholder":
        return Tap("", pre=True)
    return None


def _taps(tracer: _Tracer, values: tuple[fx.Node, ...], nxt: fx.Node,
          starting: dict[fx.Node, list[tuple[str, fx.Node | None]]]
          ) -> tuple[Tap, ...] | None:
    """A tap per value crossing a cut (the last at the cut itself); None if one has none."""
    taps = [_tap(tracer, v, None, starting) for v in values[:-1]]
    taps.append(_tap(tracer, values[-1], nxt, starting))
    return None if None in taps else tuple(t for t in taps if t is not None)


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
          ) -> tuple[list[fx.Node], list[tuple[int, tuple[fx.Node, ...], tuple[Tap, ...]]],
                     list[str]] | None:
    """Compute nodes, the cuts (position in them, the values crossing, their taps),
    blocks."""
    everything = list(graph.nodes)
    starting = _starting(tracer, everything)
    nodes = [n for n in everything if n.op not in ("get_attr", "output")]
    if sum(n.op == "placeholder" for n in nodes) != 1 or nodes[0].op != "placeholder":
        return None
    keys = _block_keys(model, nodes)
    live = _crossing(nodes)
    cuts = []
    for i in range(1, len(nodes) - 1):
        values = live[i]
        if keys[i] == keys[i + 1] or values is None:
            continue
        taps = _taps(tracer, values, nodes[i + 1], starting)
        if taps is not None:
            cuts.append((i, values, taps))
    return nodes, cuts, keys


def _piece(model: nn.Module, nodes: list[fx.Node], inp: tuple[fx.Node, ...],
           out: tuple[fx.Node, ...]) -> tuple[fx.GraphModule, set[str]]:
    """GraphModule running `nodes` from values `inp` to values `out` (one: that value;
    more: a tuple of them), and its owners."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {v: g.placeholder(f"x{k}" if k else "x")
                                   for k, v in enumerate(inp)}
    owners: set[str] = set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = g.get_attr(a.target)
                owners.add(str(a.target).rpartition(".")[0])
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "call_module":
            owners.add(str(n.target))
    g.output(env[out[0]] if len(out) == 1 else tuple(env[v] for v in out))
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
    bounds = [(0, (nodes[0],), ()), *((i + 1, v, t) for i, v, t in cuts if i not in drop)]
    segments = []
    for (start, inp, taps), (end, out, _t) in zip(
            bounds, [*bounds[1:], (len(nodes), (result,), ())], strict=True):
        piece = [n for n in nodes[start:end] if n.op != "placeholder"]
        gm, owners = _piece(model, piece, inp, out)
        first, last = keys[max(start, 1)], keys[end - 1]
        name = first if first == last else f"{first}..{last}"
        segments.append(Segment(name or "model", gm, start - 1, owners, taps))
    return segments


def run_piece(module: nn.Module, x: Tensor | tuple[Tensor, ...]) -> object:
    """A piece on its input: one value, or the tuple of the values crossing its cut."""
    return module(*x) if isinstance(x, tuple) else module(x)


def check_split(model: nn.Module, segments: list[Segment], x: Tensor) -> list[int]:
    """The segments (from 1) whose inputs model(x) does not show once each and unchanged
    at the end of the forward, equal to the chain's; [0] where only the chained output
    differs from model(x). Empty: the split holds on x."""
    seen: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = {}
    handles = []
    for s, seg in enumerate(segments[1:], start=1):
        for k, tap in enumerate(seg.taps):
            def keep(t: object, key: tuple[int, int] = (s, k)) -> None:
                if isinstance(t, Tensor):
                    seen.setdefault(key, []).append((t, t.clone()))
            mod = model.get_submodule(tap.path)
            handles.append(mod.register_forward_pre_hook(lambda _m, a, f=keep: f(a[0]))
                           if tap.pre else
                           mod.register_forward_hook(lambda _m, _a, o, f=keep: f(o)))
    try:
        with torch.no_grad():
            full = model(x)
    finally:  # before the chain: the pieces run the same layers
        for handle in handles:
            handle.remove()
    bad: list[int] = []
    h: object = x
    with torch.no_grad():
        for s, seg in enumerate(segments):
            parts = h if isinstance(h, tuple) else (h,)
            if s and (len(parts) != len(seg.taps) or not all(
                    _seen_once(seen.get((s, k), []), p) for k, p in enumerate(parts))):
                bad.append(s)
            h = run_piece(seg.module, h)
    if not bad and not (isinstance(h, Tensor) and _same(h, full)):
        bad.append(0)
    return bad


def _seen_once(got: list[tuple[Tensor, Tensor]], chained: object) -> bool:
    """One sighting, unchanged since, equal to the chain's value."""
    return (len(got) == 1 and isinstance(chained, Tensor) and _same(got[0][0], got[0][1])
            and _same(got[0][1], chained))


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))
