"""The Runs page: pick a run log (twin or real) under the runs folder and chart it.

Reward, KL by group, share of tokens outside [0.2, 5], grad norm, entropy, staleness and tokens/s per
update, the fleet's mix over time (replicas up per group, scale and `replan` events marked) and the re-planner's
decisions; refreshes itself while the run is going (a Streamlit fragment with run_every); overlays the
twin's prediction for the same plan when a twin run log of that plan is in the folder, with the
predicted-vs-measured table from `mixfleet.costmodel.records.runsummary.compare`; for a real run, the twin
fidelity check (`mixfleet.twin.calibrated.fidelity`, priors or a calibration file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import streamlit as st
from mixfleet.costmodel.records.runlog import FIND_MAX_DEPTH, FIND_MAX_DIRS
from mixfleet.twin.calibrated import rehearsal_not_modelled
from mixfleet.ui import app_charts as charts
from mixfleet.ui import app_launch as launch
from mixfleet.ui import run_manager as rm
from mixfleet.ui.app_common import (
    FIDELITY_OF,
    REFRESH_EVERY_S,
    RunData,
    calibration_files,
    default_updates,
    dry_run,
    fidelity_log_dir,
    find_runs,
    fmt_compact,
    fmt_num,
    fmt_pct,
    fmt_s,
    fmt_table,
    fmt_usd,
    fmt_versions,
    load_run,
    run_label,
    runs_dir,
    shipped_plan,
    show_error,
    twin_predictions_for,
    with_workload,
)

DEMO_PLAN = "seed-mixed"
DEMO_WORKLOAD = "tiny-cpu"
NOT_RECORDED = "not recorded in this run log"
# predicted-vs-measured rows shown first (summary keys -> label with unit)
KEY_METRICS = {
    "time_per_update_mean_s": "time per update, mean (s)", "time_per_update_p95_s": "time per update, p95 (s)",
    "cost_per_update_usd": "cost per update (USD)", "staleness_mean": "mean staleness (versions)",
    "trainer_idle_share": "trainer idle share", "tokens_per_s": "tokens/s", "kl_k3": "KL (k3)",
    "extreme_share": "share outside [0.2, 5]",
}


@st.cache_data(show_spinner=False, max_entries=16)
def _compare(measured: str, predicted: str, _stamp: tuple[str, str]) -> pd.DataFrame:
    from mixfleet.costmodel.records.runsummary import compare, summarize

    return compare(summarize(measured), summarize(predicted), labels=("measured", "predicted"))


def _metrics(run: RunData) -> None:
    s = run.summary
    clock = s.get("clock", "wall")
    c = st.columns(6)
    c[1].metric("time/update", fmt_s(s.get("time_per_update_mean_s")),
                help=f"mean, {clock} seconds, on the update loop (start-ups and stops left out)")
    c[0].metric("updates", fmt_num(s.get("updates")))
    c[2].metric("cost/update", fmt_usd(s.get("cost_per_update_usd")))
    c[3].metric("staleness (versions)", fmt_versions(s.get("staleness_mean")))
    c[4].metric("tokens/s", fmt_compact(s.get("tokens_per_s")))
    c[5].metric("trainer idle", fmt_pct(s.get("trainer_idle_share")))
    out = s.get("outside_loop_s")
    if isinstance(out, int | float) and out > 0:
        seg = int(s.get("segments") or 1)
        st.caption(f"{fmt_s(out)} of the run's {fmt_s(s.get('elapsed_s'))} were outside the update loop (start-up"
                   + (f"s of its {seg} segments, the stop and the restart" if seg > 1 else "") + "): time per update "
                   "and trainer idle are measured on the loop.")


def _chart(fig_ok: bool, fig_fn, what: str) -> None:  # type: ignore[no-untyped-def]
    if fig_ok:
        st.plotly_chart(fig_fn(), width="stretch")
    else:
        st.caption(f"{what}: {NOT_RECORDED}.")


def _charts(run: RunData, twin: RunData | None) -> None:
    u, g = run.updates, run.groups
    ou = twin.updates if twin is not None else None
    og = twin.groups if twin is not None else None
    has = charts.has_values
    left, right = st.columns(2)
    with left:
        _chart(has(u, "reward_mean"), lambda: charts.update_series(
            u, {"reward_mean": "mean reward", "pass_at_k": "pass@k"}, title="Reward", y="reward", overlay=ou),
            "reward")
        if run.header.get("source") == "twin" and has(u, "reward_mean"):
            st.caption("The twin does not train: its rewards are draws at the workload's success probability "
                       "(`success_prob`), not a learning curve.")
        _heldout(run)
        _chart(has(g, "kl_k3"), lambda: charts.group_series(g, "kl_k3", title="KL (k3) by group", y="KL (nats/token)",
                                                             overlay=og), "KL by group")
        _chart(has(u, "grad_norm"), lambda: charts.update_series(u, {"grad_norm": "grad norm"}, title="Grad norm",
                                                                  y="L2 norm"), "grad norm")
        _chart(has(u, "staleness_mean"), lambda: charts.update_series(
            u, {"staleness_mean": "mean", "staleness_p95": "p95", "staleness_max": "max"},
            title="Staleness of trained tokens", y="versions", overlay=ou), "staleness")
    with right:
        ex = charts.extreme_share_frame(u)
        oex = charts.extreme_share_frame(ou) if ou is not None else None
        _chart(has(ex, "extreme_share"), lambda: charts.update_series(
            ex, {"extreme_share": "outside [0.2, 5]"}, title="Share of tokens with ratio outside [0.2, 5]",
            y="% of trained tokens", overlay=oex, percent=True), "share outside [0.2, 5]")
        _chart(has(u, "entropy"), lambda: charts.update_series(u, {"entropy": "entropy"}, title="Entropy",
                                                                y="nats/token"), "entropy")
        tps = charts.tokens_per_s_frame(u, g)
        otps = charts.tokens_per_s_frame(ou, og) if ou is not None and og is not None else None
        _chart(has(tps, "tokens_per_s"), lambda: charts.update_series(
            tps, {"tokens_per_s": "generated"}, title="Tokens per second (per update window)", y="tokens/s",
            overlay=otps), "tokens/s")
        _chart(has(g, "extreme_share"), lambda: charts.group_series(
            g, "extreme_share", title="Share outside [0.2, 5] by group", y="% of tokens", percent=True, overlay=og),
            "share outside [0.2, 5] by group")
    if has(g, "routing_token_share"):      # MoE runs: the samplers' recorded experts vs the trainer's
        left, right = st.columns(2)
        with left:
            _chart(True, lambda: charts.group_series(
                g, "routing_token_share", title="Routing disagreement by group: tokens (expert set differs in "
                ">= 1 layer)", y="% of trained tokens", percent=True, overlay=og), "routing disagreement (tokens)")
        with right:
            _chart(True, lambda: charts.group_series(
                g, "routing_layer_share", title="Routing disagreement by group: mean share of layers that differ",
                y="% of layers", percent=True, overlay=og), "routing disagreement (layers)")


def _heldout(run: RunData) -> None:
    """Held-out reward and pass@k per evaluated version (issue 23: the curves RL people compare), with how they
    were sampled; the reward chart above is the training batches'."""
    if run.header.get("source") == "twin":     # the twin does not evaluate
        return
    ev = charts.heldout_frame(run.events)
    if len(ev) == 0:
        st.caption("Held-out evaluation: none in this run log (a real run evaluates every `[embedded] eval_every` "
                   "updates, `mixfleet run --eval-every N`).")
        return
    st.plotly_chart(charts.update_series(ev, {"reward": "held-out reward", "pass_at_k": "held-out pass@k"},
                                         title="Held-out evaluation", y="reward / pass@k"), width="stretch")
    st.caption("Held-out: " + charts.heldout_settings(ev) + ".")


def _prediction_table(run: RunData, twin: RunData) -> None:
    st.subheader("Predicted vs measured")
    df = _compare(run.path, twin.path, (str(run.summary.get("updates")), str(twin.summary.get("updates"))))
    first = df[df["metric"].isin(KEY_METRICS)].copy()
    first["metric"] = first["metric"].map(KEY_METRICS)
    groups = df[df["metric"].str.startswith(("group_share_of_samples[", "group_tokens_per_s[", "group_kl_k3["))]
    shown = pd.concat([first, groups], ignore_index=True)
    st.dataframe(shown.style.format({"measured": fmt_table, "predicted": fmt_table,
                                     "diff": lambda x: fmt_table(x, signed=True),
                                     "rel_diff": "{:+.1%}"}, na_rep="—"), hide_index=True, width="stretch")
    clock = (" The measured run's seconds are wall seconds; the twin's are simulated seconds."
             if run.summary.get("clock") != twin.summary.get("clock") else "")
    st.caption(f"Computed at {fmt_num(run.summary.get('updates'))} measured updates against the twin's "
               f"{fmt_num(twin.summary.get('updates'))} (redrawn as the run goes on)." + clock)


def _view(path: str, twin_path: str | None) -> None:
    try:
        run = load_run(path)
        twin = load_run(twin_path) if twin_path else None
    except Exception as e:  # a run log being written or damaged: say so, keep the page
        show_error(f"cannot read run log {path}", e)
        return
    h = run.header
    plan = (h.get("plan") or {}).get("name", "?")
    st.caption(f"source **{h.get('source')}** · status **{_status(Path(path), h)}** · plan **{plan}** · seed "
               f"{h.get('seed')} · clock {run.summary.get('clock')} · created {h.get('created_utc', '?')}"
               + (f" · overlay: twin run `{Path(twin_path).name}`" if twin_path else ""))
    _metrics(run)
    if len(run.updates) == 0:
        st.info("No update recorded yet" + (" (the run is going; this page refreshes)."
                                           if _status(Path(path), h) == "running" else "."))
        return
    _charts(run, twin)
    _mix(run)
    if twin is not None:
        _prediction_table(run, twin)


def _mix(run: RunData) -> None:
    """The fleet's mix over time (replicas up per group, the scale and `replan` events marked: the timeline the
    Dry-run page draws) and, when the autoscaler re-planned, its decisions (issue 27)."""
    from mixfleet.policies.replan import replan_decisions

    if not charts.has_values(run.groups, "replicas_up"):
        st.caption(f"Fleet mix over time: {NOT_RECORDED}.")
        return
    st.plotly_chart(charts.timeline(run.updates, run.groups, run.events, run.summary.get("clock", "wall")),
                    width="stretch", key="runs_timeline")
    rows = [{"update": d["version"], "time (s)": d["time_s"], "adopted": d.get("adopted"),
             "before": ", ".join(f"{g} {n}" for g, n in (d.get("before") or {}).items()),
             "after": ", ".join(f"{g} {n}" for g, n in (d.get("after") or {}).items()),
             "predicted gain": d.get("gain"), "reason": d.get("reason", ""), "trigger": d.get("trigger", "")}
            for d in replan_decisions(run.events)]
    if rows:
        st.subheader("Re-planning decisions")
        st.dataframe(pd.DataFrame(rows).style.format({"time (s)": "{:.0f}", "predicted gain": "{:+.1%}"},
                                                     na_rep="—"), hide_index=True, width="stretch")
        st.caption("Each is a `replan` event of the run log (its detail also holds the fitted values with their "
                   "stderr and the predicted objective, time per update and staleness: docs/twin.md).")


def _demo_button(root: Path) -> None:
    n = default_updates()
    if st.button(f"Dry-run the seed's mixed fleet on the tiny workload ({n} updates) into this folder",
                 type="primary"):
        with st.spinner("simulating..."):
            try:
                dry_run(with_workload(shipped_plan(DEMO_PLAN), DEMO_WORKLOAD), n, 0)
            except Exception as e:
                show_error("dry run failed", e)
                return
        st.rerun()


PRIORS = "(none: the cost model's priors)"
FIDELITY_KEY = "runs_fidelity_reports"      # session state: {(run path, calibration): FidelityReport.to_dict()}


def _fmt_error(e: float | None, kind: str) -> str:
    if e is None:
        return "—"
    if kind == "relative":
        return f"{100 * e:+.1f} %"
    if kind == "percentage points":
        return f"{e:+.2f} pp"
    return f"{e:+.3g}"


def _fidelity_section(path: Path, header: dict) -> None:
    """Issue 8's comparison: `twin.calibrated.fidelity` simulates the plan as this run ran it (seed, updates,
    replica counts, workload; optionally calibrated) and lays predicted next to measured."""
    st.subheader("Twin fidelity")
    if why := rehearsal_not_modelled(header):
        st.info(f"Twin fidelity does not apply: {why}.")
        return
    files = calibration_files()
    c1, c2 = st.columns([3, 1])
    def shown(f: str) -> str:
        if f == PRIORS:
            return f
        return f + (" (in-sample: fitted on this run)" if _in_sample(f, path) else " (held-out: fitted on other runs)")

    cal = c1.selectbox("Calibration", [PRIORS] + files, key="runs_cal", format_func=shown,
                       help="A file from `mixfleet calibrate` (pass `mixfleet ui --calibration FILE`, or keep "
                            "*calibration*.toml files under the runs folder). A calibration fitted on this run "
                            "checks the fit (in-sample); one fitted on other runs of the plan predicts this one "
                            "(held-out).")
    cal_path = None if cal == PRIORS else cal
    reports = st.session_state.setdefault(FIDELITY_KEY, {})
    key = (str(path), cal_path or "")
    with c2:
        st.write("")
        go = st.button("Check the twin against this run", key="runs_fidelity", type="primary")
    if go:
        from mixfleet.twin.calibrated import fidelity

        tag = "priors" if cal_path is None else Path(cal_path).stem
        keep = fidelity_log_dir(path, tag)
        with st.spinner("simulating this run's plan as it ran..."):
            try:
                from mixfleet.costmodel.records.outdir import prepare_output_dir

                prepare_output_dir(keep, "twin_runlog", where="Runs page", force=True)   # the previous check's log
                reports[key] = fidelity(None, path, cal_path, keep_twin_log=keep).to_dict()
                (keep / FIDELITY_OF).write_text(json.dumps({"run": str(path.resolve())}))   # whose overlay it is
            except Exception as e:
                show_error("fidelity check failed", e)
                return
        st.rerun()  # the kept twin log is now this run's overlay
    rep = reports.get(key)
    if rep is None:
        st.caption("Simulates the plan recorded in this run log with the run's seed, number of updates and replica "
                   "counts, and compares: time per update, staleness, trainer idle share, cost, KL, extreme-ratio "
                   "share, and per group tokens/s, share of samples, KL and extreme-ratio share.")
        return
    rows = [{"metric": r["metric"], "unit": r["unit"], "measured": r["measured"], "predicted": r["predicted"],
             "error": _fmt_error(r["error"], r["error_kind"])} for r in rep["rows"]]
    g = rep["goals"]
    c = st.columns(3)

    def verdict(ok: bool, goal: str) -> str:      # FidelityReport.goals, what `mixfleet fidelity` prints
        return f"goal {goal}: {'met' if ok else 'missed'}"

    c[0].metric("time/update error", _fmt_error(g.get("time_per_update_rel_error"), "relative"),
                delta=verdict(g["time_per_update_within_10pct"], "within 10 %"),
                delta_color="normal" if g["time_per_update_within_10pct"] else "inverse", delta_arrow="off")
    c[1].metric("share of samples, max error", _fmt_error(g.get("share_of_samples_max_error_pp"), "percentage points"),
                delta=verdict(g["share_of_samples_within_3pp"], "within 3 pp"),
                delta_color="normal" if g["share_of_samples_within_3pp"] else "inverse", delta_arrow="off")
    c[2].metric("staleness error (versions)", _fmt_error(g.get("staleness_error_updates"), "difference"),
                delta=verdict(g["staleness_within_half_update"], "within 0.5"),
                delta_color="normal" if g["staleness_within_half_update"] else "inverse", delta_arrow="off")
    if rep["calibration"] and _in_sample(rep["calibration"], path):
        st.info("In-sample: this calibration was fitted on this run, so the check measures how well the fit "
                "reproduces its own data, not how well the twin predicts. For a held-out check pick a calibration "
                "fitted on other runs of the plan (marked held-out above).")
    st.dataframe(pd.DataFrame(rows).style.format({"measured": fmt_table, "predicted": fmt_table}, na_rep="—"),
                 hide_index=True, width="stretch", key="runs_fidelity_table")
    now = _updates_now(path)
    if now is not None and now != rep["updates"]:       # checked before Continue / Resume added updates
        st.warning(f"Computed at {rep['updates']} updates; the run now has {now}: check the twin again for all of "
                   "them.")
    st.caption(f"Computed at {rep['updates']} updates, seed {rep['seed']}, calibration: "
               f"{rep['calibration'] or 'none (priors)'}. "
               + " ".join(rep.get("notes", [])))


def _export_section(path: Path) -> None:
    """`mixfleet export` from the page (issue 44): the run's metrics to TensorBoard or W&B (offline), beside the
    other runs under the run's own name (`trackers.default_dest`), replacing this run's earlier export."""
    from mixfleet.costmodel.records.trackers import default_dest, export_run_log

    st.subheader("Export to TensorBoard / W&B")
    c1, c2 = st.columns([3, 1])
    to = launch.TRACKER_NAMES[c1.radio("Tracker", list(launch.TRACKER_NAMES), horizontal=True, key="runs_export_to")]
    dest = default_dest(to, path)
    with c2:
        st.write("")
        go = st.button("Export", key="runs_export", type="primary")
    if go:
        with st.spinner("exporting..."):
            try:
                res = export_run_log(path, to, force=True, where="Runs page export")
            except Exception as e:
                show_error("export failed", e)
                return
        st.success(f"Exported {res.steps} steps ({res.values} values) to `{res.dest}`.")
    view = (f"`tensorboard --logdir {dest.parent}` shows every exported run side by side, each under its name"
            if to == "tensorboard" else f"`wandb sync {dest}/wandb/offline-run-*` uploads it")
    st.caption(f"Writes to `{dest}` (the CLI: `mixfleet export RUNLOG --to {to}`; a live run: the tracker option "
               f"of \"Run for real\", `mixfleet run --tracker {to}`). {view}.")


def _status(path: Path, header: dict) -> str:
    """The run's status: a managed run's is its process's (a killed run's log still says "running", issue 44; a
    stopped or finished one says so before the page rereads the list), any other run's its log's."""
    m = launch.managed_for(path)
    return m.state() if m is not None else str(header.get("status", "?"))


def _in_sample(cal_path: str, run: Path) -> bool:
    """Whether the calibration file was fitted on this run log (its `runs`)."""
    from mixfleet.costmodel.calibration.record import Calibration

    try:
        runs = Calibration.load(cal_path).runs
    except Exception:  # an unreadable file is said so when it is used
        return False
    here = Path(run).resolve()
    return any(Path(r).resolve() == here for r in runs)


def _updates_now(path: Path) -> int | None:
    """The run log's updates now (None when it cannot be read)."""
    try:
        n = load_run(str(path)).summary.get("updates")
    except Exception:  # a log being written: the check's own count stands
        return None
    return int(n) if isinstance(n, int | float) else None


def _label(path: Path, header: dict) -> str:
    """The run's name, source, plan and status (`_status`)."""
    return run_label(path, {**header, "status": _status(path, header)})


def _folder(top: Path) -> Path | None:
    """The folder to list: the configured runs folder or a folder inside it (never outside)."""
    sub = st.text_input("Runs folder", value=str(top),
                        help=f"Run logs (twin or real) are listed from this folder and below it (up to "
                             f"{FIND_MAX_DEPTH} folders deep, {FIND_MAX_DIRS:,} folders searched at most); it stays "
                             f"inside the runs folder {top} (`mixfleet ui --runs-dir`).")
    p = Path(sub).expanduser()
    p = (top / p) if not p.is_absolute() else p
    try:
        p.resolve().relative_to(top)
    except ValueError:
        st.error(f"Runs folder {sub!r}: allowed the runs folder {top} or a folder inside it.")
        return None
    return p.resolve()


def render() -> None:
    st.title("Runs")
    top = runs_dir()
    root = _folder(top)
    if root is None:
        return
    runs = find_runs(root)
    listed = {str(p) for p, _ in runs}
    for m in launch.pending_runs(root, listed):
        if (m.run_dir / "run.json").exists():
            # its log is there but not listed (written since the listing, or unreadable): list it with one rerun,
            # never in a loop (the pending panel reruns the page while the log exists)
            once = st.session_state.setdefault("runs_pending_reran", set())
            if m.folder not in once:
                once.add(m.folder)
                st.rerun()
            continue
        show_pending_fragment(m)
    if not runs:
        st.info(f"No run log under `{root}` yet. Start one with `mixfleet run PLAN` or `mixfleet simulate PLAN -o "
                f"{root}/NAME`, dry-run a plan on the Dry-run page, or:")
        _demo_button(root if root.is_absolute() else root.resolve())
        return
    runs = sorted(runs, key=lambda r: r[1].get("source") == "twin")    # real runs first (stable: newest first)
    by_path = {str(p): (p, h) for p, h in runs}
    launch.apply_follow(set(by_path))       # a run just started or resumed, whose log may not be listed yet
    pick = st.selectbox("Run log", list(by_path), format_func=lambda k: _label(*by_path[k]), key=launch.PICK_KEY,
                        on_change=launch.unfollow)
    path, header = by_path.get(str(pick), runs[0])
    header = {**header, "status": _status(path, header)}      # a killed run's log still says "running"
    preds = twin_predictions_for(header, root, exclude=path) if header.get("source") != "twin" else []
    if why := rehearsal_not_modelled(header):
        st.info(f"No twin overlay or predicted-vs-measured table: {why}.")
    for g, why in (header.get("lost_groups") or {}).items():      # given up under --allow-group-loss
        st.warning(f"Sampler group `{g}` never started and the run went on without it: {why}")
    c1, c2 = st.columns([3, 1])
    overlay = None
    with c1:
        if preds:
            options = ["none"] + [str(p) for p in preds]
            pick = st.selectbox("Overlay the twin's prediction", options, index=1,
                                format_func=lambda s: s if s == "none" else Path(s).name)
            overlay = None if pick == "none" else pick
        elif header.get("source") != "twin" and not rehearsal_not_modelled(header):
            st.caption("No twin prediction for this plan in the folder yet (see Twin fidelity below).")
    with c2:
        # live: the log says running, or the app's own process for it is (a resume not yet in the log)
        managed = launch.managed_for(path)
        live = header.get("status") == "running" or (managed is not None and managed.alive())
        auto = st.toggle(f"Auto-refresh every {REFRESH_EVERY_S:.0f} s", value=live)
    if managed is None and path.name == rm.RUN_SUBDIR and (why := rm.refusal(path.parent)):
        st.caption(why)              # a managed.json beside it that the app did not write (or a copy): followed only
    if managed is not None:
        st.fragment(run_every=REFRESH_EVERY_S if auto else None)(launch.managed_panel)(managed, overlay)
    st.fragment(run_every=REFRESH_EVERY_S if auto else None)(_view)(str(path), overlay)
    if header.get("source") != "twin":
        _fidelity_section(path, header)
        launch.calibrate_and_replan(path, header, top, runs)
    _export_section(path)


def show_pending_fragment(m) -> None:  # type: ignore[no-untyped-def]
    st.fragment(run_every=REFRESH_EVERY_S)(launch.show_pending)(m)


if __name__ == "__main__":
    render()
