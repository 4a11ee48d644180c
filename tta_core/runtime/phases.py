"""Phase timing of one step: the runtime times every method's phases the same way.

`Phases` wraps `api.PhaseClock` (which synchronises CUDA before reading the time) and
accumulates the milliseconds of named phases (forward, plan, backward, reforward, post)
into an `api.PhaseTimes`; `total_ms` is their sum. A phase entered twice adds up.
`settle` counts the time between and around the phases (the step's bookkeeping) to one of
them, so the phases sum to the step's wall time since the Phases was made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tta_core.api import PhaseClock, PhaseTimes

PHASES = ("forward", "plan", "backward", "reforward", "post")


class Phases:
    """Accumulates the wall time of named phases; `times()` gives the PhaseTimes."""

    def __init__(self, device: torch.device | str = "cpu",
                 clock: PhaseClock | None = None) -> None:
        """`clock`: an existing PhaseClock to read (one a test can drive), else a new one
        on `device`."""
        self.clock = clock if clock is not None else PhaseClock(device)
        self.ms = dict.fromkeys(PHASES, 0.0)
        self._start = self.clock.now()

    @classmethod
    def for_tensor(cls, x: torch.Tensor) -> Phases:
        """Phases timed for work on x's device."""
        return cls(x.device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (one of PHASES)."""
        if name not in self.ms:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        self.clock.mark()
        try:
            yield
        finally:
            self.ms[name] += self.clock.mark()

    def settle(self, name: str = "plan") -> float:
        """Count to phase `name` the wall time since this Phases was made that no phase
        counted yet (the work between and around them); returns the ms added."""
        if name not in self.ms:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        gap = max((self.clock.now() - self._start) * 1e3 - sum(self.ms.values()), 0.0)
        self.ms[name] += gap
        return gap

    def add(self, name: str, ms: float) -> None:
        """Count `ms` measured elsewhere (e.g. a background update) to phase `name`."""
        self.ms[name] += ms

    def times(self) -> PhaseTimes:
        """The phases' times and their sum."""
        m = self.ms
        return PhaseTimes(m["forward"], m["plan"], m["backward"], m["reforward"],
                          sum(m.values()), m["post"])
