"""The Plan page's result, read against its inputs (issue 26 Confusing): the inputs a result was computed from,
shown with it and compared with the page's inputs now (a result under inputs that changed is marked stale), and
how the chosen mix compares with the seed's two fleets ("x% cheaper than seed-mixed") and with the runners-up
(the Pareto set's next mixes by cost).

Presentation only: the numbers are the planner's (`ui/app_planner.py` `PlannerView`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pandas as pd
import streamlit as st
from mixfleet.ui.app_common import fmt_s, fmt_usd, fmt_versions

INPUTS_KEY = "plan_result_inputs"       # session state: (inputs key, inputs) of the result shown
# the planner's inputs in words (the pool is compared as a whole)
INPUT_LABELS = {"model": "model", "workload": "workload", "price_table": "price table", "kv_dtypes": "KV dtypes",
                "max_staleness": "max mean staleness", "max_time_per_update_s": "max time per update",
                "budget_usd_per_hour": "budget per hour", "objective": "minimize",
                "trainer_accelerator": "trainer accelerator", "trainer_gpus": "trainer GPUs",
                "twin_updates": "twin check updates", "references": "the seed's two fleets",
                "emulated": "emulated precisions", "calibration": "calibration", "backend": "cost backend",
                "layouts": "replica layouts"}


def inputs_key(inputs: dict[str, Any], pool: pd.DataFrame) -> str:
    """One key for the planner's inputs and the pool (the process-wide plan cache's key too)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()
                          + pool.to_csv(index=False).encode()).hexdigest()


def _value(k: str, v: Any) -> str:
    if v is None or v == "":
        return "none"
    if isinstance(v, list | tuple):
        return ", ".join(map(str, v)) or "none"
    return str(v)


def inputs_text(inputs: dict[str, Any]) -> str:
    return " · ".join(f"{label} {_value(k, inputs.get(k))}" for k, label in INPUT_LABELS.items() if k in inputs)


def changed_inputs(was: dict[str, Any], now: dict[str, Any], pool_changed: bool) -> list[str]:
    """What differs between the inputs a result was computed from and the page's now, in words."""
    out = [f"{label} {_value(k, was.get(k))} -> {_value(k, now.get(k))}" for k, label in INPUT_LABELS.items()
           if json.dumps(was.get(k), default=str) != json.dumps(now.get(k), default=str)]
    return out + (["the accelerator pool"] if pool_changed else [])


def remember(key: str, inputs: dict[str, Any], pool: pd.DataFrame) -> None:
    """The inputs of the result just computed (kept beside it in the session)."""
    st.session_state[INPUTS_KEY] = (key, dict(inputs), pool.to_csv(index=False))


def show_inputs(now_key: str | None, now: dict[str, Any] | None, pool: pd.DataFrame | None) -> None:
    """The inputs the result shown was computed from; a warning when the page's inputs are not those any more."""
    stored = st.session_state.get(INPUTS_KEY)
    if stored is None:
        return
    key, was, was_pool = stored
    st.caption(f"Computed from: {inputs_text(was)}.")
    if now_key is not None and now is not None and now_key != key:
        diff = changed_inputs(was, now, pool is not None and pool.to_csv(index=False) != was_pool)
        st.warning("Stale: this result was computed from other inputs than the page's now ("
                   + "; ".join(diff or ["the inputs"]) + "). Press **Run planner** to plan these.")


def _staleness(p: dict[str, Any]) -> str:
    """Mean staleness as the cards write it; 'unbounded' for a trainer-bound mix (its staleness grows)."""
    v = p.get("staleness_mean")
    return "unbounded" if p.get("trainer_bound") or not isinstance(v, int | float) or v != v else fmt_versions(v)


def versus_seed(point: dict[str, Any], references: list[dict[str, Any]]) -> list[str]:
    """The chosen mix against each of the seed's fleets, the planner's analytic figures for all (the same model,
    workload, prices and trainer): 'x% cheaper than seed-mixed per update, ... time, staleness'."""
    out = []
    cost = point.get("cost_per_update_usd")
    for ref in references:
        rc = ref.get("cost_per_update_usd")
        if not (isinstance(cost, int | float) and isinstance(rc, int | float)) or rc <= 0:
            continue
        rel = 1.0 - cost / rc
        word = "cheaper" if rel >= 0 else "dearer"
        out.append(f"**{abs(rel):.0%} {word} than {ref['name']}** per update ({fmt_usd(cost)} vs {fmt_usd(rc)}; "
                   f"time per update {fmt_s(point.get('time_per_update_s'))} vs {fmt_s(ref.get('time_per_update_s'))}"
                   f", staleness {_staleness(point)} vs {_staleness(ref)})")
    return out


def show_versus_seed(point: dict[str, Any], references: list[dict[str, Any]],
                     points: pd.DataFrame | None = None, binds: str = "") -> None:
    """The chosen mix against the seed's fleets, what binds it, and the runners-up (`points`: the Pareto set)."""
    if binds:
        st.markdown(f"**What binds:** {binds}.")
    if points is not None:
        show_runners_up(points, point)
    lines = versus_seed(point, references)
    if lines:
        st.markdown("**Against the seed's fleets** (the planner's analytic figures, same model, workload, prices "
                    "and trainer): " + "; ".join(lines) + ".")


RUNNERS_UP = 3


def runners_up(points: pd.DataFrame, chosen: dict[str, Any], n: int = RUNNERS_UP) -> pd.DataFrame:
    """The Pareto set's next `n` mixes by cost per update after the chosen one, each with what it costs more and
    what it saves in time per update, in the cards' formats."""
    if len(points) == 0 or "label" not in points:
        return pd.DataFrame(columns=["mix", "cost per update", "vs chosen", "time per update", "staleness"])
    cost, time_s = chosen.get("cost_per_update_usd"), chosen.get("time_per_update_s")
    rest = points[points["label"] != chosen.get("label")].sort_values("cost_per_update_usd").head(n)
    rows = []
    for _, r in rest.iterrows():
        dc = (r["cost_per_update_usd"] / cost - 1.0) if isinstance(cost, int | float) and cost > 0 else float("nan")
        dt = (r["time_per_update_s"] / time_s - 1.0) if isinstance(time_s, int | float) and time_s > 0 else float("nan")
        rows.append({"mix": r["label"], "cost per update": fmt_usd(r["cost_per_update_usd"]),
                     "vs chosen": f"{dc:+.0%} cost, {dt:+.0%} time" if dc == dc and dt == dt else "—",
                     "time per update": fmt_s(r["time_per_update_s"]),
                     "staleness": fmt_versions(r["staleness_mean"]) if r["staleness_mean"] == r["staleness_mean"]
                     else "unbounded"})
    return pd.DataFrame(rows)


def show_runners_up(points: pd.DataFrame, chosen: dict[str, Any]) -> None:
    table = runners_up(points, chosen)
    if len(table):
        with st.expander(f"Runners-up: the Pareto set's next {len(table)} mixes by cost", expanded=False):
            st.dataframe(table, hide_index=True, width="stretch")
