"""tta_core results <-> tta_msgs messages, shared by the nodes (no algorithm, no node)."""

from __future__ import annotations

import math
import resource

import numpy as np
import torch
from std_msgs.msg import Header
from tta_msgs.msg import AdaptationStatus, ClassPrediction, LayerImportance, LayerPlan

from tta_core.adashadow.planning import Plan, PlanOutcome
from tta_core.api import StepResult


def msg_to_plan(msg: LayerPlan) -> Plan:
    """LayerPlan -> Plan (full_ms recovered from budget / sigma)."""
    update = np.asarray(msg.update, dtype=bool)
    full = msg.budget_ms / msg.sigma if msg.sigma > 0 else math.nan
    imp = np.nan_to_num(np.asarray(msg.importance, dtype=np.float64))
    return Plan(update=update, first_updated=int(msg.first_updated_index),
                        objective=float(imp[update].sum()) if imp.size == update.size else 0.0,
                        predicted_total_ms=float(msg.predicted_total_ms),
                        budget_ms=float(msg.budget_ms), full_ms=float(full),
                        solve_ms=float(msg.solve_ms))


def plan_to_msg(outcome: PlanOutcome, imp: LayerImportance, plan_id: int,
                sigma: float) -> LayerPlan:
    """A planning service's outcome -> the LayerPlan answering `imp`."""
    plan, unit_ms = outcome.plan, outcome.unit_ms
    msg = LayerPlan(plan_id=plan_id, based_on_batch_id=imp.batch_id, model_name=imp.model_name,
                    unit_names=list(imp.unit_names),
                    update=[bool(u) for u in plan.update],
                    importance=[float(a) for a in imp.importance],
                    predicted_unit_ms=[float(t) for t in unit_ms],
                    first_updated_index=int(plan.first_updated), sigma=float(sigma),
                    budget_ms=float(plan.budget_ms),
                    predicted_total_ms=float(plan.predicted_total_ms),
                    solve_ms=float(plan.solve_ms))
    msg.header = imp.header
    return msg


def prediction_msgs(headers: list[Header], probs: np.ndarray, batch_id: int,
                    class_names: list[str], with_scores: bool) -> list[ClassPrediction]:
    """One ClassPrediction per image (header = the image's); label -1 and NaN confidence
    for a row that is not finite."""
    label, finite = probs.argmax(axis=1), np.isfinite(probs).all(axis=1)
    out = []
    for i, header in enumerate(headers):
        ok = bool(finite[i])
        lab = int(label[i]) if ok else -1
        pred = ClassPrediction(batch_id=batch_id, label=lab,
                               confidence=float(probs[i, lab]) if ok else math.nan,
                               class_name=class_names[lab] if 0 <= lab < len(class_names)
                               else "",
                               scores=probs[i].tolist() if with_scores else [])
        pred.header = header
        out.append(pred)
    return out


def peak_memory_mb(device: torch.device) -> float:
    """CUDA peak allocated on a GPU, else the process's peak RSS (MB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def status_msg(header: Header, batch_id: int, res: StepResult, *, method: str, mode: str,
               plan_id: int, reset: bool, frames_dropped: int,
               peak_mb: float) -> AdaptationStatus:
    """The AdaptationStatus of one batch."""
    t = res.times
    msg = AdaptationStatus(
        batch_id=batch_id, method=method, mode=mode, adapted=bool(res.adapted),
        units_updated=int(res.units_updated), plan_id=plan_id,
        forward_ms=float(t.forward_ms), plan_ms=float(t.plan_ms),
        backward_ms=float(t.backward_ms), reforward_ms=float(t.reforward_ms),
        total_ms=float(t.total_ms), predicted_total_ms=float(res.predicted_total_ms),
        budget_ms=float(res.budget_ms), loss=float(res.loss),
        mean_entropy=float(res.mean_entropy), peak_memory_mb=float(peak_mb),
        frames_dropped=frames_dropped, reset=reset, domain=res.domain)
    msg.header = header
    return msg


def importance_msg(header: Header, batch_id: int, model_name: str, unit_names: list[str],
                   res: StepResult, batch_size: int) -> LayerImportance | None:
    """The LayerImportance of one batch, None when the method assesses no units."""
    imp = np.asarray(res.importance, dtype=np.float64)
    if imp.shape != (len(unit_names),):
        return None
    msg = LayerImportance(batch_id=batch_id, model_name=model_name, unit_names=unit_names,
                          importance=imp.tolist(), forward_ms=float(res.times.forward_ms),
                          batch_size=batch_size)
    msg.header = header
    return msg
