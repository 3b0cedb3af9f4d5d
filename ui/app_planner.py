"""Adapter between the Plan page and the mix planner (`mixfleet.twin.planner`, engineer C's).

`run(...)` passes the page's inputs (model, workload, price table, the edited accelerator pool,
constraints) to the planner and turns its result into a `PlannerView`: the chosen plan as TOML,
the chosen mix as a display table, the candidates / Pareto points, and the seed's two fleets as
reference points. No planning happens here; until the planner module exists, `available()` is
False and the page says so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from mixfleet.ui.app_common import PlanText

PLANNER_MODULE = "mixfleet.twin.planner"
DEFAULT_MAX_GPUS = 64
DEFAULT_MAX_STALENESS = 0.0         # versions; 0 = no limit
DEFAULT_MAX_TIME_S = 0.0            # seconds per update; 0 = no limit
DEFAULT_BUDGET_USD_H = 0.0          # USD per hour; 0 = no limit
OBJECTIVES = ("cheapest per update", "fastest per update")


@dataclass(frozen=True)
class PlannerView:
    plan: PlanText
    mix_table: pd.DataFrame                      # one row per group, values formatted with units
    chosen_point: dict[str, Any]                 # time_per_update_s, cost_per_update_usd, staleness_mean, ...
    points: pd.DataFrame                         # candidates: time_per_update_s, cost_per_update_usd, ...
    references: list[dict[str, Any]] = field(default_factory=list)
    notes: str = ""


def available() -> bool:
    try:
        return importlib.util.find_spec(PLANNER_MODULE) is not None
    except ModuleNotFoundError:
        return False


def unavailable_reason() -> str:
    return f"`{PLANNER_MODULE}` has not landed in this checkout (the twin's planner issue)."


def run(*, model: str, workload: str, price_table: str, pool: pd.DataFrame, max_staleness: float | None,
        max_time_per_update_s: float | None, budget_usd_per_hour: float | None, objective: str,
        progress: Callable[[int, int], None] | None = None) -> PlannerView:
    """Plan a mix with the planner; raises the planner's SpecError on bad inputs."""
    if not available():
        raise RuntimeError(unavailable_reason())
    raise RuntimeError("the planner's interface is not wired into the UI yet")
