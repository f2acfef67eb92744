"""Why a plan cannot work: the planner's typed verdict detail, shared by plan.py and arch.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """Why a plan cannot work, where, and what to change."""

    field: str
    reason: str
    fixes: tuple[str, ...] = ()

    def message(self) -> str:
        fix = f": {'; or '.join(self.fixes)}" if self.fixes else ""
        return f"{self.field}: {self.reason}{fix}"


@dataclass(frozen=True)
class Fix:
    """One candidate change to a spec: the knob it turns (`field`, dotted spec path), the value, the
    text shown to the user and the partial spec that applies it. Candidates are de-duplicated by knob:
    only the first value of a knob that makes the plan fit is offered."""

    field: str
    value: Any
    text: str
    change: dict[str, Any] = dataclasses.field(default_factory=dict)
