"""Adapt only when it pays: backward passes after a shift, then forward-only.

Per domain the gate knows whether it is *stable* and the mean prediction entropy it
settled at. Two policies (`policy`):

- "shift" (darda's): DARDA adapts once per perceived corruption. Each perceived shift owes
  `per_shift` backward passes, with the reason that armed them: "new_domain" (the detector
  created the domain), "shift" (a known domain not yet stable, or a shift the shift test
  perceived inside the active domain). The domain is stable once they ran. A switch to a
  stable domain (a revisit) owes nothing. A stable domain whose windowed mean entropy
  rises above its settled level by more than `drift_tol` (relative), `window` batches or
  more after it settled, owes `per_shift` again ("drift"). A new shift while passes are
  still owed replaces them (`skipped` counts the dropped ones): the owed work is for the
  ongoing corruption only, never a backlog.
- "stable" (adashadow's domain bank): after a switch into a new (or never stabilised)
  domain it adapts; it declares the domain stable when the mean entropy of the last
  `window` batches differs from that of the `window` before by at most `tol` (relative),
  after at least `min_batches` adapted batches, or after `max_batches` at the latest
  (counted across visits: a domain left before it settled continues its budget when it
  comes back); drift as above resumes it.

Either way a stable domain is served forward-only and revisiting it costs no backward
pass. `reason` is why the next backward pass would run ("" when none is owed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

POLICIES = ("stable", "shift")
#: why a backward pass runs (StepResult.stats["reason"] of the darda method)
NEW_DOMAIN, SHIFT, DRIFT = "new_domain", "shift", "drift"


@dataclass
class GateConfig:
    """When to adapt (see the module docstring)."""

    min_batches: int = 6
    max_batches: int = 16
    window: int = 3
    tol: float = 0.1
    drift_tol: float = 0.25
    policy: str = "stable"  # or "shift": per_shift backward passes per perceived shift
    per_shift: int = 1

    def validate(self) -> None:
        """ValueError naming a bad field."""
        if self.policy not in POLICIES:
            raise ValueError(f"gate policy {self.policy!r} not in {POLICIES}")
        if self.per_shift < 1:
            raise ValueError(f"gate per_shift must be >= 1, got {self.per_shift}")
        if not (self.window >= 1 and 1 <= self.min_batches <= self.max_batches):
            raise ValueError(f"gate needs 1 <= min_batches <= max_batches and window >= 1, "
                             f"got {self.min_batches}, {self.max_batches}, {self.window}")
        if self.tol < 0 or self.drift_tol < 0:
            raise ValueError(f"gate tolerances must be >= 0, got {self.tol}, {self.drift_tol}")


@dataclass
class DomainGate:
    """One domain's adaptation record (persisted with the bank)."""

    stable: bool = False
    level: float = math.nan  # mean entropy when it became stable
    adapted: int = 0  # backward passes spent on it in total
    run: int = 0  # backward passes since it last became unstable (across visits)
    entropies: list[float] = field(default_factory=list)  # since the last switch
    owed: int = 0  # "shift" policy: backward passes still owed to the last shift
    reason: str = ""  # ... and why
    settled: int = 0  # batches recorded since it became stable (drift waits `window`)
    resume: bool = False  # it was stable when its owed passes were armed

    def to_json(self) -> dict:
        """JSON-able record (entropy history is transient)."""
        level = None if math.isnan(self.level) else self.level  # JSON has no NaN
        return {"stable": self.stable, "level": level, "adapted": self.adapted,
                "run": self.run, "owed": self.owed, "reason": self.reason}

    @classmethod
    def from_json(cls, raw: dict) -> DomainGate:
        """Inverse of to_json (files without the owed passes: none owed)."""
        level = math.nan if raw["level"] is None else float(raw["level"])
        return cls(bool(raw["stable"]), level, int(raw["adapted"]), int(raw["run"]),
                   owed=int(raw.get("owed", 0)), reason=str(raw.get("reason", "")))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


class AdaptGate:
    """Decides per batch whether the active domain adapts (a backward pass)."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config if config is not None else GateConfig()
        self.config.validate()
        self.domains: dict[str, DomainGate] = {}
        self.active = ""
        self.skipped = 0  # "shift" policy: owed passes a later shift dropped

    @property
    def shift_policy(self) -> bool:
        """Whether passes are owed per perceived shift (else: until stable)."""
        return self.config.policy == "shift"

    def switch(self, name: str, created: bool = False) -> None:
        """The active domain changed (or was created, `created`). "shift" policy: a new or
        not yet stable domain owes per_shift passes, a stable one nothing."""
        self._drop_owed()
        self.active = name
        g = self.domains.setdefault(name, DomainGate())
        g.entropies = []
        if self.shift_policy and (created or not g.stable):
            self._arm(g, NEW_DOMAIN if created or not g.adapted else SHIFT)

    def shift(self) -> None:
        """A shift perceived inside the active domain (the shift test, not a switch):
        "shift" policy: it owes per_shift passes; "stable" policy: nothing."""
        g = self.domains.get(self.active)
        if g is None or not self.shift_policy:
            return
        self._drop_owed()
        self._arm(g, SHIFT)

    def _arm(self, g: DomainGate, reason: str) -> None:
        g.resume = g.stable or (g.resume and g.owed > 0)
        g.stable, g.owed, g.reason, g.run = False, self.config.per_shift, reason, 0

    def _drop_owed(self) -> None:
        """The active domain is left (or re-armed) with passes still owed: they are dropped
        (`skipped`); a domain that was stable before they were armed (a shift perceived in
        it just before the detector switched away) is stable again."""
        g = self.domains.get(self.active)
        if g is not None and g.owed:
            self.skipped += g.owed
            g.owed = 0
            g.stable = g.resume

    def forget(self, name: str) -> None:
        """Drop a domain's record (evicted from the bank)."""
        self.domains.pop(name, None)

    def wants_backward(self) -> bool:
        """Whether the next batch of the active domain should adapt."""
        g = self.domains.get(self.active)
        if g is None:
            return False
        return g.owed > 0 if self.shift_policy else not g.stable

    @property
    def reason(self) -> str:
        """Why the next backward pass would run ('' when none is wanted)."""
        g = self.domains.get(self.active)
        if g is None or not self.wants_backward():
            return ""
        if self.shift_policy:
            return g.reason
        return NEW_DOMAIN if math.isnan(g.level) else DRIFT  # until stable: never was, drifted

    def record(self, entropy: float, adapted: bool) -> None:
        """Mean entropy of the batch just served; updates stability."""
        g = self.domains.get(self.active)
        if g is None:
            return
        c = self.config
        g.entropies = [*g.entropies, float(entropy)][-2 * c.window:]
        if not adapted:
            g.settled += 1
            waited = g.settled >= c.window or not self.shift_policy
            if g.stable and waited and len(g.entropies) >= c.window and \
                    _mean(g.entropies[-c.window:]) > g.level * (1.0 + c.drift_tol):
                if self.shift_policy:  # drifted: owes its passes again
                    self._arm(g, DRIFT)
                else:
                    g.stable, g.run = False, 0  # drifted: adapt again
            return
        g.adapted += 1
        g.run += 1
        if self.shift_policy:
            g.owed = max(g.owed - 1, 0)
            if not g.owed:
                g.stable, g.settled = True, 0
                g.level = _mean(g.entropies[-c.window:])
            return
        full = len(g.entropies) >= 2 * c.window
        if g.run >= c.max_batches or (g.run >= c.min_batches and full and self._settled(g)):
            g.stable, g.settled = True, 0
            g.level = _mean(g.entropies[-c.window:])

    def _settled(self, g: DomainGate) -> bool:
        w = self.config.window
        new, old = _mean(g.entropies[-w:]), _mean(g.entropies[-2 * w:-w])
        return abs(new - old) <= self.config.tol * max(old, 1e-12)
