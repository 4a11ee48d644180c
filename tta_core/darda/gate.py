"""Adapt only when it pays: backward passes after a shift, until the domain is stable.

Per domain the gate knows whether it is *stable* and the mean prediction entropy it
settled at. After a switch into a new (or never stabilised) domain it adapts; it
declares the domain stable when the mean entropy of the last `window` batches differs
from that of the `window` before by at most `tol` (relative), after at least `min_batches`
adapted batches, or after `max_batches` at the latest (counted across visits: a domain
left before it settled continues its budget when it comes back). A stable domain is served
forward-only; if its windowed mean entropy later rises above the settled level by more
than `drift_tol` (relative), adaptation resumes (a drift inside the domain, or a
recognised domain that no longer fits). Revisiting a stable domain costs no backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class GateConfig:
    """When to adapt (see the module docstring)."""

    min_batches: int = 6
    max_batches: int = 16
    window: int = 3
    tol: float = 0.1
    drift_tol: float = 0.25

    def validate(self) -> None:
        """ValueError naming a bad field."""
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

    def to_json(self) -> dict:
        """JSON-able record (entropy history is transient)."""
        level = None if math.isnan(self.level) else self.level  # JSON has no NaN
        return {"stable": self.stable, "level": level, "adapted": self.adapted,
                "run": self.run}

    @classmethod
    def from_json(cls, raw: dict) -> DomainGate:
        """Inverse of to_json."""
        level = math.nan if raw["level"] is None else float(raw["level"])
        return cls(bool(raw["stable"]), level, int(raw["adapted"]), int(raw["run"]))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


class AdaptGate:
    """Decides per batch whether the active domain adapts (a backward pass)."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config if config is not None else GateConfig()
        self.config.validate()
        self.domains: dict[str, DomainGate] = {}
        self.active = ""

    def switch(self, name: str) -> None:
        """The active domain changed (or was created)."""
        self.active = name
        g = self.domains.setdefault(name, DomainGate())
        g.entropies = []

    def forget(self, name: str) -> None:
        """Drop a domain's record (evicted from the bank)."""
        self.domains.pop(name, None)

    def wants_backward(self) -> bool:
        """Whether the next batch of the active domain should adapt."""
        g = self.domains.get(self.active)
        return g is not None and not g.stable

    def record(self, entropy: float, adapted: bool) -> None:
        """Mean entropy of the batch just served; updates stability."""
        g = self.domains.get(self.active)
        if g is None:
            return
        c = self.config
        g.entropies = [*g.entropies, float(entropy)][-2 * c.window:]
        if not adapted:
            if g.stable and len(g.entropies) >= c.window and \
                    _mean(g.entropies[-c.window:]) > g.level * (1.0 + c.drift_tol):
                g.stable, g.run = False, 0  # drifted: adapt again
            return
        g.adapted += 1
        g.run += 1
        full = len(g.entropies) >= 2 * c.window
        if g.run >= c.max_batches or (g.run >= c.min_batches and full and self._settled(g)):
            g.stable = True
            g.level = _mean(g.entropies[-c.window:])

    def _settled(self, g: DomainGate) -> bool:
        w = self.config.window
        new, old = _mean(g.entropies[-w:]), _mean(g.entropies[-2 * w:-w])
        return abs(new - old) <= self.config.tol * max(old, 1e-12)
