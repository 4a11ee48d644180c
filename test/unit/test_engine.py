"""AdaShadow engine: exact reforward reuse, real gradient cut, parallel == sequential."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer

from tta_core.adashadow import profiler
from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.adashadow.planner import backward_cost
from tta_core.adashadow.planning import UnitLayout, mac_profile
from tta_core.adashadow.predictor import UnitProfile
from tta_core.api import PhaseClock, Plan
from tta_core.cli import main as cli_main
from tta_core.model.norms import set_bn_mode
from tta_core.model.units import StagedModel, decompose, stage_input_hooks
from tta_core.model.zoo import build_model

torch.set_num_threads(2)


def _staged(arch: str, size: int, bn_mode: str = "batch") -> StagedModel:
    torch.manual_seed(0)
    if arch == "tiny_vit":
        model: nn.Module = VisionTransformer(image_size=size, patch_size=16, num_layers=2,
                                             num_heads=2, hidden_dim=32, mlp_dim=64,
                                             num_classes=10)
    else:
        model = build_model(arch, 10)
    set_bn_mode(model, bn_mode)
    return decompose(model, (3, size, size))


def _plan(n: int, units: list[int]) -> Plan:
    update = np.zeros(n, dtype=bool)
    update[units] = True
    first = int(np.flatnonzero(update)[0]) if update.any() else n
    return Plan(update=update, first_updated=first, objective=0.0, predicted_total_ms=0.0,
                budget_ms=0.0, full_ms=0.0, solve_ms=0.0)


def _mid_and_later(staged: StagedModel) -> list[int]:
    """A unit in the middle of a middle stage plus every other unit after it."""
    st = staged.stages[len(staged.stages) // 2]
    first = st.first_unit + st.n_units // 2
    return list(range(first, len(staged.units), 2))


@pytest.mark.parametrize("arch,size,bn_mode", [
    ("small_resnet", 32, "batch"), ("resnet18", 64, "batch"), ("mobilenet_v2", 64, "batch"),
    ("small_resnet", 32, "source"), ("tiny_vit", 32, "batch"),
])
def test_reforward_reuse_equals_full_forward(arch: str, size: int, bn_mode: str) -> None:
    staged = _staged(arch, size, bn_mode)
    eng = AdaShadowEngine(staged, EngineConfig(lr=0.05, bn_mode=bn_mode, trainable="all"))
    x = torch.randn(4, 3, size, size)
    before = [p.detach().clone() for p in eng.params]
    plan = _plan(len(staged.units), _mid_and_later(staged))
    res = eng.step(x, plan=plan)
    assert res.adapted and res.units_updated == int(plan.update.sum())
    changed = sum(not torch.equal(a, p) for a, p in zip(before, eng.params, strict=True))
    assert changed > 0  # the update really happened, so a stale reforward would differ
    with torch.no_grad():
        full = staged.model(x)
    assert (res.logits - full).abs().max().item() <= 1e-5
    eng.close()


def test_reforward_replays_the_first_updated_layers_input() -> None:
    """§4 reuse at the layer: the first updated unit a BN fed by its stage's first conv,
    the reforward does not run that conv (it replays the conv's output, kept from the
    forward by robust BN) and predicts what the reforward from the stage input does."""
    logits, conv_calls = {}, {}
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    for replay in (True, False):
        staged = _staged("resnet18", 64, "source")
        if not replay:  # neither the producer nor any unit output may be replayed
            for u in staged.units:
                u.producer, u.replayable = None, False
        eng = AdaShadowEngine(staged, EngineConfig(lr=0.05, bn_mode="robust"))
        st = staged.stages[3]
        conv, bn = staged.units[st.first_unit], staged.units[st.first_unit + 1]
        assert bn.kind == "bn" and bn.producer == (conv.index if replay else None)
        calls: list[int] = []
        conv.module.register_forward_hook(lambda *_a, calls=calls: calls.append(1))
        later = [u.index for u in staged.units[bn.index:] if u.kind == "bn"]
        res = eng.step(x, plan=_plan(len(staged.units), later[::2]))
        assert res.adapted
        logits[replay], conv_calls[replay] = res.logits, len(calls)
        eng.close()
    assert conv_calls == {True: 1, False: 2}
    torch.testing.assert_close(logits[True], logits[False], rtol=0.0, atol=1e-5)


@pytest.mark.parametrize("graph", ["lazy", "full"])
def test_reuse_starts_at_first_updated_stage(graph: str) -> None:
    staged = _staged("small_resnet", 32)
    # its init runs a probe forward
    eng = AdaShadowEngine(staged, EngineConfig(trainable="all", graph=graph))
    calls: list[str] = []
    for st in staged.stages:
        st.module.register_forward_pre_hook(lambda m, a, name=st.name: calls.append(name))
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        staged.model(x)
    in_forward, calls[:] = list(calls), []
    plan = _plan(len(staged.units), [staged.stages[2].first_unit + 1])
    eng.step(x, plan=plan)
    names = [s.name for s in staged.stages]
    # stem wrapper and layer1 run once (the forward); from stage 2 on the model runs again
    # for the reforward, and in lazy mode also once before it, with autograd, for the loss
    tails = 2 if graph == "lazy" else 1
    assert calls == in_forward + names[2:] * tails
    assert "layer1.0" in in_forward


def _attach_grad_probes(staged: StagedModel, fired: dict[str, int]) -> None:
    """Tensor hooks on every stage input and unit input recorded during the forward."""
    def probe(key: str):
        def pre(_m, args):
            t = args[0]
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g: fired.__setitem__(key, fired.get(key, 0) + 1))
        return pre
    def stage_probe(s: int, t: torch.Tensor) -> None:
        if t.requires_grad:
            t.register_hook(lambda g: fired.__setitem__(f"stage:{s}", 1))
    stage_input_hooks(staged, stage_probe)
    seen: set[int] = set()
    for u in staged.units:
        if id(u.module) not in seen:
            seen.add(id(u.module))
            u.module.register_forward_pre_hook(probe(f"unit:{u.index}"))


@pytest.mark.parametrize("arch,size", [("resnet18", 64), ("mobilenet_v2", 64)])
def test_sparse_backward_cuts_the_graph(arch: str, size: int) -> None:
    staged = _staged(arch, size)
    eng = AdaShadowEngine(staged, EngineConfig(trainable="all"))
    fired: dict[str, int] = {}
    _attach_grad_probes(staged, fired)
    selected = _mid_and_later(staged)
    d = selected[0]
    eng.step(torch.randn(4, 3, size, size), plan=_plan(len(staged.units), selected))
    below = [k for k in fired if (k.startswith("unit:") and int(k[5:]) <= d)
             or (k.startswith("stage:") and staged.stages[int(k[6:])].first_unit <= d)]
    assert below == [], f"gradients computed below the first updated unit {d}: {below}"
    assert any(k.startswith("unit:") and int(k[5:]) > d for k in fired)  # probes work
    for u in staged.units:
        for p in u.parameters():
            assert (p.grad is not None) == (u.index in selected), u.name


def test_full_backward_reaches_the_input_when_first_unit_selected() -> None:
    staged = _staged("small_resnet", 32)
    eng = AdaShadowEngine(staged, EngineConfig(trainable="all"))
    fired: dict[str, int] = {}
    _attach_grad_probes(staged, fired)
    eng.step(torch.randn(4, 3, 32, 32), plan=_plan(len(staged.units), [0, 1]))
    assert "stage:1" in fired  # gradient flows down to the stem's output


def test_nothing_updated_returns_forward_logits() -> None:
    staged = _staged("small_resnet", 32)
    eng = AdaShadowEngine(staged, EngineConfig(trainable="all"))
    w0 = [p.detach().clone() for p in eng.params]
    x = torch.randn(4, 3, 32, 32)
    res = eng.step(x, plan=_plan(len(staged.units), []))
    assert not res.adapted and res.units_updated == 0 and res.times.reforward_ms == 0.0
    assert all(torch.equal(a, p) for a, p in zip(w0, eng.params, strict=True))
    with torch.no_grad():
        assert torch.allclose(res.logits, staged.model(x), atol=1e-6)


@pytest.mark.parametrize("units", [[], [12, 15]])
def test_external_plan_sets_where_the_graph_starts(units: list[int]) -> None:
    staged = _staged("small_resnet", 32)
    eng = AdaShadowEngine(staged, EngineConfig(trainable="all"))
    seen: dict[int, bool] = {}  # stage -> its input required grad (first call: the forward)

    def record(s: int, t: torch.Tensor) -> None:  # a pre-hook's return value replaces input
        seen.setdefault(s, t.requires_grad)
    stage_input_hooks(staged, record)
    eng.step(torch.randn(4, 3, 32, 32), plan=_plan(len(staged.units), units))
    first = staged.units[units[0]].stage if units else len(staged.stages)
    assert 0 < first or not units
    assert seen and all(req == (s > first) for s, req in seen.items()), (first, seen)


def _run(mode: str, plans: list[Plan], xs: list[torch.Tensor], loss: str) -> list[torch.Tensor]:
    staged = _staged("small_resnet", 32)
    eng = AdaShadowEngine(staged, EngineConfig(mode=mode, loss=loss, lr=0.05, trainable="all"))
    for x, plan in zip(xs, plans, strict=True):
        eng.step(x, plan=plan)
    eng.sync()
    return [p.detach().clone() for p in eng.params]


@pytest.mark.parametrize("loss", ["entropy", "multilayer_kl"])
def test_parallel_matches_sequential(loss: str) -> None:
    torch.manual_seed(1)
    xs = [torch.randn(4, 3, 32, 32) for _ in range(4)]
    n = len(_staged("small_resnet", 32).units)
    plans = [_plan(n, [3, 7, 10]), _plan(n, list(range(5, n))), _plan(n, []),
             _plan(n, [n - 1])]
    seq = _run("sequential", plans, xs, loss)
    par = _run("parallel", plans, xs, loss)
    src = [p.detach() for u in _staged("small_resnet", 32).units for p in u.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(seq, src, strict=True))
    for a, b in zip(seq, par, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_parallel_returns_forward_logits_and_times_backward() -> None:
    staged = _staged("small_resnet", 32)
    eng = AdaShadowEngine(staged, EngineConfig(mode="parallel", trainable="all"))
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        before = staged.model(x)
    res = eng.step(x, plan=_plan(len(staged.units), [len(staged.units) - 1]))
    eng.sync()  # fills the backward time into the step's own result
    assert res.times.backward_ms > 0 and res.times.reforward_ms == 0
    assert torch.allclose(res.logits, before, atol=1e-6)


def test_planner_drives_updates_and_sigma() -> None:
    staged = _staged("small_resnet", 32)
    counts = {}
    for sigma in (0.2, 1.0):
        s = _staged("small_resnet", 32)
        eng = AdaShadowEngine(s, EngineConfig(sigma=sigma, fixed_cost_feedback=0.0))
        prof = mac_profile(UnitLayout.from_staged(s), 10.0, 4)
        eng.profile = prof  # fixed times: the plan depends on importance and sigma only
        torch.manual_seed(3)
        n_up = []
        for i in range(3):
            r = eng.step(torch.randn(4, 3, 32, 32) * (1 + 0.5 * i))
            n_up.append(r.units_updated)
            if r.adapted:
                assert r.predicted_total_ms <= r.budget_ms + 1e-9
        counts[sigma] = n_up
    assert counts[0.2][0] == counts[1.0][0] == 0  # first batch: no history, no importance
    assert sum(counts[1.0]) > sum(counts[0.2])
    assert len(staged.units) == 19


def test_graph_is_recorded_only_from_the_lowest_feasible_stage() -> None:
    """Stages no feasible plan can reach run without autograd; the update is unchanged."""
    results = {}
    for floor in (True, False):
        staged = _staged("resnet18", 64)
        # MAC times scaled to the measured forward and no fixed-cost feedback: the plan
        # does not depend on timing
        eng = AdaShadowEngine(staged, EngineConfig(sigma=0.5, fixed_cost_feedback=0.0,
                                                   plan_ahead=False))  # the inline floor
        seen: dict[int, bool] = {}  # stage -> its input required grad in the forward

        def record(s: int, t: torch.Tensor, eng=eng, seen=seen) -> None:
            if eng._collector.capture:  # the forward phase, not the reforward
                seen[s] = t.requires_grad
        stage_input_hooks(staged, record)
        if not floor:
            eng._grad_stage_for = lambda plan, floor: 0  # the paper's pipeline: graph everywhere
        torch.manual_seed(5)
        steps = [eng.step(torch.randn(4, 3, 64, 64) * (1 + 0.5 * i)) for i in range(3)]
        results[floor] = (steps, [p.detach().clone() for p in eng.params], seen, eng)
    (s_on, w_on, seen_on, eng), (s_off, w_off, seen_off, _) = results[True], results[False]
    grad_stage = eng._grad_stage
    assert 0 < grad_stage < len(eng.staged.stages)
    assert not any(seen_on[s] for s in seen_on if s < grad_stage)
    assert any(seen_on[s] for s in seen_on if s > grad_stage)
    assert any(seen_off[s] for s in seen_off if 0 < s < grad_stage)
    assert any(r.adapted for r in s_on)
    for a, b in zip(s_on, s_off, strict=True):
        assert np.array_equal(a.plan.update, b.plan.update)
        assert not a.adapted or eng.staged.units[a.plan.first_updated].stage >= grad_stage
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(w_on, w_off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("graph", ["full", "lazy"])
def test_forward_keeps_stage_inputs_only_where_a_plan_can_start(graph: str) -> None:
    """Full graph: the stage inputs below the recorded graph (no plan can start a
    reforward there) are not held by the forward; lazy (a plan may start anywhere): all."""
    staged = _staged("resnet18", 64)
    eng = AdaShadowEngine(staged, EngineConfig(sigma=0.5, fixed_cost_feedback=0.0,
                                               graph=graph))
    x = torch.randn(4, 3, 64, 64)
    eng.step(x)  # a measured forward: the graph floor is known
    stage = eng._grad_stage_for(None)
    n = len(staged.stages)
    assert stage == n if graph == "lazy" else 0 < stage < n
    _, _, inputs = eng._recorded_forward(x, stage)
    kept = [i for i, t in enumerate(inputs) if t is not None]
    assert kept == list(range(0 if graph == "lazy" else stage, n))


def test_config_validation() -> None:
    staged = _staged("small_resnet", 32)
    with pytest.raises(ValueError, match="mode"):
        AdaShadowEngine(staged, EngineConfig(mode="fast"))
    with pytest.raises(ValueError, match="loss"):
        AdaShadowEngine(staged, EngineConfig(loss="ce"))
    bad = mac_profile(UnitLayout.from_staged(_staged("resnet18", 64)), 1.0, 4)
    with pytest.raises(ValueError, match="units"):
        AdaShadowEngine(staged, EngineConfig(), profile=bad)


def test_plan_fit_recovers_the_cost_model_exactly() -> None:
    """fit_plan_times identifies w and x (x_0 aside) from suffix and single-unit plans."""
    from tta_core.adashadow.planner import backward_cost

    rng = np.random.default_rng(11)
    for n in (1, 2, 7, 19):
        w, x = rng.random(n) * 3, rng.random(n)
        x[0] = 0.0
        idx = np.arange(n)
        suffix = np.array([backward_cost(w, x, idx >= d) for d in range(n)])
        single = np.array([backward_cost(w, x, idx == d) for d in range(n)])
        fw, fx = profiler.fit_plan_times(suffix, single)
        for _ in range(5):  # any plan's cost is reproduced
            plan = rng.random(n) < 0.5
            assert backward_cost(fw, fx, plan) == pytest.approx(backward_cost(w, x, plan))
        if n > 1:  # w_0 and x_1 always occur together: only their sum is identified
            w[0], x[1] = w[0] + x[1], 0.0
        np.testing.assert_allclose(fw, w, atol=1e-9)
        np.testing.assert_allclose(fx, x, atol=1e-9)
    with pytest.raises(ValueError, match="finite"):
        profiler.fit_plan_times(np.array([1.0, np.nan]), np.array([1.0, 1.0]))


def test_plans_split_profiles_sparse_backwards(monkeypatch) -> None:
    staged = _staged("small_resnet", 32)
    calls: list[int] = []
    real = torch.autograd.grad

    def spy(outputs, inputs, *a, **k):
        assert not k.get("retain_graph"), "each plan is timed after its own forward"
        calls.append(len(inputs))
        return real(outputs, inputs, *a, **k)
    monkeypatch.setattr(torch.autograd, "grad", spy)
    prof = profiler.profile_model(staged, batch=2, repeats=4, split="plans")
    n = len(staged.units)
    n_params = sum(1 for _ in staged.model.parameters())
    # one full warm-up, then every one of the 4 repeats times N suffix + N single plans
    assert len(calls) == 1 + 4 * 2 * n and calls[0] == calls[-2] == n_params  # suffix d = 0
    assert (prof.w_ms >= 0).all() and (prof.x_ms >= 0).all() and prof.w_ms.sum() > 0
    assert prof.x_ms[0] == 0.0  # never enters a cost
    assert all(p.requires_grad for p in staged.model.parameters())  # restored
    # the forward reference is the forwards timed among the plans (same moment as w, x)
    assert prof.g_ms.sum() == pytest.approx(prof.forward_ms, rel=1e-6)
    with pytest.raises(ValueError, match="split"):
        profiler.profile_model(staged, batch=2, repeats=1, split="guess")


def test_plans_profile_rescales_the_forward_to_the_plan_phase(monkeypatch) -> None:
    """A machine twice as slow while the plans are timed: r, g and T_f follow it."""
    staged = _staged("small_resnet", 32)
    n = len(staged.units)
    g, r = np.linspace(1.0, 2.0, n), np.linspace(0.5, 1.5, n)
    monkeypatch.setattr(profiler, "_one_run", lambda *_a: (g, np.ones(n), float(g.sum())))
    monkeypatch.setattr(profiler, "_nograd_run", lambda *_a: r)
    monkeypatch.setattr(profiler, "_plan_times", lambda *_a: (
        np.arange(n, 0, -1, dtype=float), np.ones(n), 2.0 * g.sum()))
    prof = profiler.profile_model(staged, batch=2, repeats=1, split="plans")
    assert prof.forward_ms == pytest.approx(2.0 * g.sum())
    np.testing.assert_allclose(prof.g_ms, 2.0 * g)
    np.testing.assert_allclose(prof.r_ms, 2.0 * r)
    plain = profiler.profile_model(staged, batch=2, repeats=1, split="macs")
    np.testing.assert_allclose(plain.r_ms, r)  # no plans: as measured
    assert plain.forward_ms == pytest.approx(g.sum())

def test_profiler_sums_and_cli(tmp_path) -> None:
    staged = _staged("small_resnet", 32)
    r, b, fwd = profiler._one_run(staged, torch.randn(2, 3, 32, 32),
                                  profiler._clock(False))
    assert r.sum() == pytest.approx(fwd, rel=1e-9)  # every forward ms charged to a unit
    assert (r >= 0).all() and (b >= 0).all() and b.sum() > 0
    out = tmp_path / "p.json"
    assert cli_main(["profile", "--arch", "small_resnet", "--batch-size", "2",
                     "--image-size", "32", "--repeats", "2", "--split", "macs",
                     "--out", str(out)]) == 0
    prof = UnitProfile.load(out)
    assert prof.unit_names == [u.name for u in staged.units] and prof.device == "cpu"
    ratio = prof.w_ms / np.maximum(prof.w_ms + prof.x_ms, 1e-12)
    dw = np.array([u.macs_dw / (u.macs_dw + u.macs_dx) for u in staged.units])
    np.testing.assert_allclose(ratio[prof.w_ms > 0], dw[prof.w_ms > 0], rtol=1e-6)
    eng = AdaShadowEngine(staged, EngineConfig(), profile=prof)
    eng.step(torch.randn(2, 3, 32, 32))
    res = eng.step(torch.randn(2, 3, 32, 32) * 3)
    # T (forward + full backward + reforward, scaled to this batch) exceeds this forward
    assert res.plan is not None and res.plan.full_ms > res.times.forward_ms


@pytest.mark.parametrize("feedback", ["uniform", "off"])
def test_forward_feedback_rescales_profile(feedback: str) -> None:
    staged = _staged("small_resnet", 32)
    prof = mac_profile(UnitLayout.from_staged(staged), 1000.0, 4)  # from a 1 s forward
    prof.g_ms = 3.0 * prof.r_ms  # recording the graph triples a unit's forward
    eng = AdaShadowEngine(staged, EngineConfig(forward_feedback=feedback, graph="full"),
                          profile=prof)
    x = torch.randn(4, 3, 32, 32)
    res = eng.step(x)
    tf = res.times.forward_ms
    rest = prof.w_ms.sum() + prof.x_ms[1:].sum() + prof.r_ms.sum()
    # the forward recorded the graph from the floor's first unit on: compared with that
    grad_from = eng._grad_from(eng._grad_stage_for(None))
    assert 0 < grad_from < len(staged.units)
    ref = prof.r_ms[:grad_from].sum() + prof.g_ms[grad_from:].sum()
    k = tf / ref if feedback == "uniform" else 1.0
    assert res.plan.full_ms == pytest.approx(tf + k * rest, rel=1e-9)


def test_engine_rejects_an_unknown_feedback_mode() -> None:
    with pytest.raises(ValueError, match="forward_feedback 'yes'"):
        AdaShadowEngine(_staged("small_resnet", 32), EngineConfig(forward_feedback="yes"))


def test_norm_only_engine_refuses_a_plan_with_conv_units_and_plans_only_norms() -> None:
    staged = _staged("small_resnet", 32)
    eng = AdaShadowEngine(staged, EngineConfig(sigma=1.0))  # trainable="norm" by default
    kinds = [u.kind for u in staged.units]
    assert all(staged.units[i].kind == "bn" for i in range(len(kinds))
               if eng.candidates[i]) and eng.candidates.sum() == kinds.count("bn")
    with pytest.raises(ValueError, match=r"not trainable.*conv1"):
        eng.step(torch.randn(4, 3, 32, 32), plan=_plan(len(kinds), [0]))
    x = torch.randn(4, 3, 32, 32)
    for _ in range(3):
        res = eng.step(x * 3)
    assert res.adapted and all(kinds[i] == "bn" for i in np.flatnonzero(res.plan.update))
    assert (res.importance[[k != "bn" for k in kinds]] == 0).all()
    eng.close()


def test_lazy_graph_gives_the_same_update_as_the_full_graph() -> None:
    """Re-running only the tail with autograd yields the same loss, weights and logits."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 3, 32, 32, generator=g) * (1 + i) for i in range(3)]
    out = {}
    for graph in ("lazy", "full"):
        staged = _staged("small_resnet", 32)
        eng = AdaShadowEngine(staged, EngineConfig(trainable="all", graph=graph, lr=0.05))
        plans = [_plan(len(staged.units), u) for u in ([5, 9], [12], [3, 15])]
        res = [eng.step(x, plan=p) for x, p in zip(xs, plans, strict=True)]
        out[graph] = ([p.detach().clone() for p in eng.params], res)
    for a, b in zip(out["lazy"][0], out["full"][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for ra, rb in zip(out["lazy"][1], out["full"][1], strict=True):
        assert ra.loss == pytest.approx(rb.loss, rel=1e-5)
        torch.testing.assert_close(ra.logits, rb.logits, rtol=1e-4, atol=1e-5)
    assert not out["lazy"][1][0].logits.requires_grad


class _FakeClock(PhaseClock):
    """The engine's phase clock (`now()` in s), moved only by the test: no wall clock."""

    def __init__(self) -> None:
        self.t = 0.0
        super().__init__("cpu")

    def now(self) -> float:
        return self.t


def test_backward_feedback_learns_a_profile_that_underpredicts_the_backward() -> None:
    """A profile whose backward times are 20x too small, on a machine (a fake clock) whose
    forward takes exactly what the profile says and whose backward takes 20x what the
    profile predicts for the plan: with feedback on, the factor rises (to its clip, 4) and
    the predicted backward of later plans moves 4x towards the measured one; off, it stays
    1 and every batch is underpredicted 20x. Plans themselves stay within the planner's
    contract. (Real backwards vs predictions: `tta predictor-bench`,
    benchmarks/speed/bench_backward_feedback.py.)"""
    true_ratio = 20.0
    staged = _staged("small_resnet", 32)
    true = mac_profile(UnitLayout.from_staged(staged), 1.0, 4)  # the machine: 1 ms forward
    prof = mac_profile(UnitLayout.from_staged(staged), 1.0, 4)
    prof.w_ms, prof.x_ms = prof.w_ms / true_ratio, prof.x_ms / true_ratio
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 32, 32, generator=gen) * (1 + i % 3) for i in range(12)]
    factors, errs, corrections = {}, {}, {}
    for alpha in (0.0, 0.5):
        torch.manual_seed(0)
        eng = AdaShadowEngine(_staged("small_resnet", 32), EngineConfig(
            sigma=0.9, backward_feedback=alpha, fixed_cost_feedback=0.0), profile=prof)
        clock = _FakeClock()
        eng.clock = clock
        # the engine's forward phase takes the profile's forward, so the forward feedback
        # scales nothing; its backward takes the true profile's cost of the plan
        eng.staged.model.register_forward_hook(
            lambda *_a, c=clock: setattr(c, "t", c.t + true.forward_ms / 1e3))
        backward_phase = eng._backward

        def backward(loss, update, backward_phase=backward_phase, clock=clock):
            backward_phase(loss, update)  # the real sparse backward and optimizer step
            clock.t += backward_cost(true.w_ms, true.x_ms, update) / 1e3

        eng._backward = backward
        ratios, per_plan = [], []
        for x in xs:
            res = eng.step(x)
            assert res.times.forward_ms == pytest.approx(true.forward_ms)
            if res.adapted:
                assert res.predicted_total_ms <= res.budget_ms * (1 + 1e-9)
                ratios.append(res.times.backward_ms / res.planning.predicted_backward_ms)
                # the prediction over what the (20x too small) profile alone says
                per_plan.append(res.planning.predicted_backward_ms
                                / backward_cost(prof.w_ms, prof.x_ms, res.plan.update))
        factors[alpha] = eng.planning.backward_fb.factor
        errs[alpha], corrections[alpha] = ratios, per_plan
    assert factors[0.0] == 1.0 and factors[0.5] == pytest.approx(4.0)  # clipped at 4
    assert len(errs[0.5]) >= 6 and len(errs[0.0]) >= 6
    # measured / predicted: 20 without feedback; with it, 20 on the first plan, then 4x
    # closer (the factor clips at 4: log 20 * 0.5 > log 4 after one batch)
    assert errs[0.0] == [pytest.approx(true_ratio)] * len(errs[0.0])
    assert errs[0.5] == [pytest.approx(true_ratio)] + [pytest.approx(5.0)] * (len(errs[0.5]) - 1)
    # later plans are predicted with the learnt factor, the first one without
    assert corrections[0.0] == [pytest.approx(1.0)] * len(corrections[0.0])
    assert corrections[0.5] == [pytest.approx(1.0)] + [pytest.approx(4.0)] * (
        len(corrections[0.5]) - 1)
    assert np.median(errs[0.0][-4:]) > 3.0 * np.median(errs[0.5][-4:])


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_the_steps_bookkeeping_outside_its_phases_counts_in_its_plan_phase(
        plan_ahead: bool) -> None:
    """Work of a step outside its named phases (here 0.5 ms of fake time in the memory
    tail's stats, read after the reforward) is on the batch's path: its times sum to all
    of the step's time and the plan phase the budget leaves room for learns it."""
    eng = AdaShadowEngine(_staged("small_resnet", 32), EngineConfig(
        sigma=1.0, plan_ahead=plan_ahead))
    clock = _FakeClock()
    eng.clock = clock
    eng.staged.model.register_forward_hook(lambda *_a: setattr(clock, "t", clock.t + 1e-3))
    stats = eng.tail.stats

    def slow_stats():
        clock.t += 0.5e-3
        return stats()

    eng.tail.stats = slow_stats
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        start = clock.t
        res = eng.step(torch.randn(4, 3, 32, 32, generator=gen))
        assert res.times.total_ms == pytest.approx((clock.t - start) * 1e3)
        assert res.times.plan_ms >= 0.5 - 1e-9
        eng.idle()
    assert eng.planning.plan_phase_ms == pytest.approx(0.5, rel=0.05)


def test_phases_settle_counts_the_time_no_phase_counted() -> None:
    from tta_core.runtime.phases import Phases

    clock = _FakeClock()
    phases = Phases(clock=clock)
    clock.t += 1e-3  # before any phase
    with phases("forward"):
        clock.t += 2e-3
    clock.t += 0.25e-3  # between phases
    assert phases.settle() == pytest.approx(1.25)
    assert phases.settle("post") == pytest.approx(0.0)
    assert phases.times().plan_ms == pytest.approx(1.25)
    assert phases.times().total_ms == pytest.approx(3.25)
    with pytest.raises(ValueError, match="unknown phase 'wait'"):
        phases.settle("wait")


def test_backward_feedback_rejects_a_bad_alpha() -> None:
    with pytest.raises(ValueError, match="alpha must be in"):
        AdaShadowEngine(_staged("small_resnet", 32), EngineConfig(backward_feedback=1.5))


def test_the_step_of_the_selected_units_equals_the_optimizer_step() -> None:
    """engine._sgd_step on the parameters given gradients equals torch.optim.SGD.step over
    every candidate (momentum buffers included), step after step and after an lr change;
    parameters without a gradient are not touched."""
    from tta_core.adashadow.engine import _sgd_step

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(5)) for _ in range(4)]
    got = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    opt_got = torch.optim.SGD(got, lr=0.1, momentum=0.9)
    for step, chosen in enumerate(([0, 1], [1, 2], [0, 1, 2], [1])):
        if step == 2:
            for opt in (opt_ref, opt_got):
                opt.param_groups[0]["lr"] = 0.03
        grads = [torch.randn(5) for _ in chosen]
        for p in ref:
            p.grad = None
        for i, g in zip(chosen, grads, strict=True):
            ref[i].grad = g.clone()
        opt_ref.step()
        _sgd_step(opt_got, [got[i] for i in chosen], tuple(g.clone() for g in grads))
        for a, b in zip(ref, got, strict=True):
            assert torch.allclose(a, b, atol=1e-7)
    assert torch.equal(got[3], ref[3]) and got[3] not in opt_got.state
