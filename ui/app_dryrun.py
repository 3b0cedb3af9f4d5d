"""The Dry-run page: simulate a plan (from the Plan page, shipped, or uploaded) for N updates with the
twin, and show its timeline, staleness, costs and per-group shares; optionally side by side with a
second plan.

The simulation is `mixfleet.twin.sim.simulate`, written as a run log under the runs folder (so the
Runs page lists it and overlays it on a real run of the same plan); an identical dry run already
there is reused. Numbers come from `mixfleet.costmodel.records.runsummary`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st
from mixfleet.ui import app_charts as charts
from mixfleet.ui.app_common import (
    DEFAULT_PLAN,
    PlanText,
    RunData,
    calibration_files,
    default_updates,
    default_workload_override,
    dry_run,
    finished_dry_run,
    fmt_compact,
    fmt_pct,
    fmt_s,
    fmt_usd,
    fmt_versions,
    known_plans,
    known_workloads,
    load_run,
    plan_from_upload,
    shipped_plan,
    show_error,
    with_workload,
)

PLAN_PAGE_KEY = "planned_plan"     # session state: the PlanText the Plan page chose
SECOND_PLAN = "seed-homogeneous"
SIDE_BY_SIDE = {"time_per_update_mean_s": "time per update (s)", "cost_per_update_usd": "cost per update (USD)",
                "staleness_mean": "mean staleness (versions)", "tokens_per_s": "tokens/s",
                "extreme_share": "share outside [0.2, 5]"}
SOURCES = ("Plan page", "Shipped plan", "Upload a plan TOML")


def _pick_plan(key: str, default_name: str, prefer_planned: bool = True) -> PlanText | None:
    """A plan chooser; returns the validated plan or None (with the error shown)."""
    planned: PlanText | None = st.session_state.get(PLAN_PAGE_KEY)
    sources = SOURCES if planned is not None else SOURCES[1:]
    default = 0 if prefer_planned or planned is None else sources.index("Shipped plan")
    src = st.radio(f"Plan {key.upper()}", sources, index=default, key=f"{key}_src", horizontal=True)
    if src == "Plan page" and planned is not None:
        st.caption(f"the Plan page's chosen mix: **{planned.name}**")
        return planned
    if src == "Shipped plan":
        names = known_plans()
        name = st.selectbox("Shipped plan", names, index=names.index(default_name) if default_name in names else 0,
                            key=f"{key}_name")
        try:
            return shipped_plan(name)
        except Exception as e:
            show_error(f"plan {name}", e)
            return None
    up = st.file_uploader("Plan TOML", key=f"{key}_upload",
                          help="A plan file as written by the Plan page or `mixfleet plan` (see docs/ui.md).")
    if up is None:
        st.info("Upload a plan TOML file to simulate it.")
        return None
    try:
        return plan_from_upload(up.getvalue(), up.name)
    except Exception as e:  # SpecError names the field and what is allowed
        show_error(f"invalid plan file {up.name}", e)
        return None


def _simulate(pt: PlanText, updates: int, seed: int, label: str, calibration: str | None) -> Path | None:
    bar = st.progress(0.0, text=f"{label}: simulating {pt.name} for {updates} updates...")

    def progress(version: int) -> None:
        bar.progress(min(version / updates, 1.0), text=f"{label}: update {version} / {updates}")

    try:
        path = dry_run(pt, updates, seed, progress=progress, calibration=calibration)
    except Exception as e:
        bar.empty()
        show_error(f"{label}: the twin could not simulate {pt.name}", e)
        return None
    bar.empty()
    return path


def extreme_token_shares(groups: pd.DataFrame) -> dict[str, float]:
    """Each group's share of all trained tokens whose ratio is outside [0.2, 5] (its logged extreme share
    weighted by its trained tokens)."""
    if len(groups) == 0:
        return {}
    w = groups["extreme_share"].fillna(0.0) * groups["tokens_trained"]
    per = w.groupby(groups["group"]).sum()
    total = float(per.sum())
    return {str(g): (float(v) / total if total > 0 else float("nan")) for g, v in per.items()}


def _metrics(run: RunData) -> None:
    s = run.summary
    elapsed = s.get("elapsed_s") or 0.0
    c = st.columns(6)
    c[0].metric("time/update", fmt_s(s.get("time_per_update_mean_s")),
                help="simulated seconds between trainer updates (mean)")
    c[1].metric("cost/update", fmt_usd(s.get("cost_per_update_usd")))
    c[2].metric("USD per hour", fmt_usd(3600 * s.get("cost_total_usd", 0.0) / elapsed if elapsed else None, 0),
                help="samplers + trainer, over the simulated time")
    c[3].metric("staleness (versions)", fmt_versions(s.get("staleness_mean")))
    c[4].metric("tokens/s", fmt_compact(s.get("tokens_per_s")))
    c[5].metric("share outside [0.2, 5]", fmt_pct(s.get("extreme_share"), 3))
    st.caption(fill_note(s))
    if (line := cost_split_note(s)) is not None:
        st.caption(line)


def cost_split_note(s: dict) -> str | None:
    """Cost per update split into sampling, training and sandboxes, for a run whose plan has sandboxes (issue 42);
    None for one without (the page as before)."""
    sandbox = s.get("cost_sandbox_per_update_usd") or 0.0
    wait = s.get("sandbox_wait_share")
    if not sandbox > 0 and not (wait is not None and wait == wait):
        return None
    return (f"Cost per update: sampling {fmt_usd(s.get('cost_sampler_per_update_usd'))}, training "
            f"{fmt_usd(s.get('cost_trainer_per_update_usd'))}, sandboxes {fmt_usd(sandbox)}; pool-wait share "
            f"{fmt_pct(wait, 1)} (episodes' waits for a sandbox / (waits + sandbox time)).")


def fill_note(s: dict) -> str:
    """Why this page reads higher than the Plan page for the same plan (issue 26: $77.01 and 24.5 min here,
    $61.64 and 19.6 min there, and neither page said why)."""
    steady = s.get("steady_time_per_update_s")
    steady_cost = s.get("steady_cost_per_update_usd")
    tail = (f" Steady state of this dry run: {fmt_s(steady)} and {fmt_usd(steady_cost)} per update."
            if steady is not None and steady == steady else "")
    return (f"Means over the whole dry run, the pipeline fill included (the first update waited "
            f"{fmt_s(s.get('first_update_s'))} for the samplers to fill the pipeline). The Plan page shows the "
            "twin's steady state, which leaves the fill and the warm-up out, so the same plan reads cheaper and "
            "faster there." + tail)


def _show_one(run: RunData, key: str) -> None:
    _metrics(run)
    st.plotly_chart(charts.timeline(run.updates, run.groups, run.events, run.summary.get("clock", "simulated")),
                    width="stretch", key=f"{key}_timeline")
    c1, c2 = st.columns(2)
    with c1:
        st.plotly_chart(charts.staleness_histogram(run.trajectories, run.updates), width="stretch",
                        key=f"{key}_staleness")
    with c2:
        st.plotly_chart(charts.cost_breakdown(run.summary), width="stretch", key=f"{key}_cost")
    st.plotly_chart(charts.share_vs_extreme(run.summary, extreme_token_shares(run.groups)), width="stretch",
                    key=f"{key}_shares")
    st.caption(f"run log: `{run.path}` (listed on the Runs page)")


def _side_by_side(a: RunData, b: RunData, la: str, lb: str) -> None:
    st.subheader("Side by side")
    st.plotly_chart(charts.compare_bars([(la, a.summary), (lb, b.summary)], SIDE_BY_SIDE), width="stretch")
    st.dataframe(side_by_side_table(a.summary, b.summary, la, lb), hide_index=True, width="stretch")


SIDE_BY_SIDE_FORMATS = {"time_per_update_mean_s": fmt_s, "cost_per_update_usd": fmt_usd,
                        "staleness_mean": fmt_versions, "tokens_per_s": fmt_compact,
                        "extreme_share": lambda x: fmt_pct(x, 3)}


def side_by_side_table(a: dict, b: dict, la: str, lb: str) -> pd.DataFrame:
    """Each metric of two dry runs in the cards' formats (not `3.213e+04`), with the difference B - A and the
    ratio B / A (issue 26: the comparison had no difference column)."""
    rows = []
    for k, label in SIDE_BY_SIDE.items():
        fmt = SIDE_BY_SIDE_FORMATS[k]
        va, vb = a.get(k), b.get(k)
        ok = all(isinstance(v, int | float) and v == v for v in (va, vb))
        diff = vb - va if ok else None
        # a difference of seconds in the unit of the larger value beside it (issue 44: "−47.70 s" next to minutes)
        size = (fmt_s(abs(diff), like=max(abs(va), abs(vb))) if fmt is fmt_s else fmt(abs(diff))) \
            if diff is not None else ""
        rows.append({"metric": label, la: fmt(va), lb: fmt(vb),
                     "difference (B - A)": ("+" if diff > 0 else "−" if diff < 0 else "") + size
                     if diff is not None else "—",
                     "B / A": f"{vb / va:.2f}x" if ok and va else "—"})
    return pd.DataFrame(rows)


def render() -> None:
    st.title("Dry-run")
    st.caption("Simulate a plan with the twin (SimPy, cost-model rates): seconds are simulated seconds.")
    with st.container(border=True):
        pa = _pick_plan("a", DEFAULT_PLAN)
        two = st.toggle("Side by side with a second plan", value=True, key="dr_two")
        pb = _pick_plan("b", SECOND_PLAN, prefer_planned=False) if two else None
    c = st.columns(3)
    n = int(c[0].number_input("simulated updates", min_value=1, max_value=1000, value=default_updates(), key="dr_n",
                              help="Trainer updates the twin simulates (seconds of simulation, not of this "
                                   "machine). The updates of a real run are set under Run for real."))
    seed = int(c[1].number_input("seed", min_value=0, value=0, key="dr_seed"))
    workloads = ["(the plan's own)"] + known_workloads()
    wdef = default_workload_override()
    w = c[2].selectbox("workload", workloads, index=workloads.index(wdef) if wdef in workloads else 0, key="dr_w",
                       help="Run the plan on another workload (its prompts per update follow the workload).")
    wl = "" if w == workloads[0] else w
    cals = calibration_files()
    cal = None
    if cals:
        pick = st.selectbox("Calibration", ["(none: the cost model's priors)"] + cals, key="dr_cal",
                            help="Simulate with the values `mixfleet calibrate` fitted from real runs.")
        cal = None if pick.startswith("(none") else pick
    if pa is None:
        return
    try:
        plans = [with_workload(pa, wl)] + ([with_workload(pb, wl)] if pb is not None else [])
    except Exception as e:
        show_error(f"workload {wl}", e)
        return
    labels = [f"A: {plans[0].name}"] + ([f"B: {plans[1].name}"] if len(plans) > 1 else [])
    if len(plans) > 1 and plans[0].digest == plans[1].digest:
        labels[1] = "B: " + plans[1].name + " (same plan)"
    paths = [finished_dry_run(p, n, seed, cal) for p in plans]
    from mixfleet.ui.app_launch import run_for_real

    run_for_real(plans[0], "dr")
    go = st.button("Simulate", type="primary", key="dr_go", disabled=all(p is not None for p in paths))
    if go:
        paths = [_simulate(p, n, seed, lab, cal) if path is None else path
                 for p, lab, path in zip(plans, labels, paths, strict=True)]
    if any(p is None for p in paths):
        if not go:
            st.info(f"Press **Simulate** to dry-run {' and '.join(p.name for p in plans)} for {n} updates.")
        return
    runs = [load_run(p) for p in paths if p is not None]
    if len(runs) == 1:
        _show_one(runs[0], "a")
        return
    tabs = st.tabs(labels)
    for tab, run, key in zip(tabs, runs, ("a", "b"), strict=True):
        with tab:
            _show_one(run, key)
    _side_by_side(runs[0], runs[1], labels[0], labels[1])


if __name__ == "__main__":
    render()
