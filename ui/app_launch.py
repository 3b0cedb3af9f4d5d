"""The app's real-run pieces: "Run for real" (from the Plan and Dry-run pages), and on the Runs page a managed
run's progress, events, log tail and its Stop / Kill / Resume buttons, then "Calibrate and re-plan".

The process side is `mixfleet.ui.run_manager` (no Streamlit); the fit is `mixfleet.costmodel.calibration`.
Nothing here runs a plan inside Streamlit's script thread: a run is a `mixfleet run` process of its own.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
from mixfleet.ui import run_manager as rm
from mixfleet.ui.app_common import PlanText, fmt_s, fmt_table, runs_dir, show_error
from mixfleet.ui.run_progress import progress

TRACKER_NAMES = {"TensorBoard": "tensorboard", "W&B (offline)": "wandb"}   # label -> `mixfleet run --tracker`
UPDATES_ENV = "MIXFLEET_UI_RUN_UPDATES"      # default target updates of a real run from the app (tests: 2)
INIT_ENV = "MIXFLEET_UI_RUN_INIT"            # default base-policy checkpoint ("" = the cached pretrain)
DEFAULT_RUN_UPDATES = 10
PICK_KEY = "runs_pick"                       # the Runs page's run-log selectbox (its value: the run log path)
WANT_KEY = "runs_want"                       # the run log the Runs page opens on once it is listed
PLAN_CAL_KEY = "plan_calibration_request"    # read (and cleared) by the Plan page before its calibration box
RUNS_PAGE = "app_runs.py"
PLAN_PAGE = "app_plan.py"
EMBEDDED, CLUSTER, ATTACH = ("embedded rehearsal on this machine", "Ray cluster (real SGLang servers)",
                             "attach running SGLang servers")


def _default_updates() -> int:
    try:
        return max(1, int(os.environ.get(UPDATES_ENV, DEFAULT_RUN_UPDATES)))
    except ValueError:
        return DEFAULT_RUN_UPDATES


def _default_name(pt: PlanText) -> str:
    base = "".join(c if c.isalnum() or c in "._-" else "-" for c in pt.name)[:40].strip("-.") or "run"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


@st.cache_data(show_spinner=False, ttl=60, max_entries=32)
def rehearsal_text(plan_toml: str) -> tuple[list[str], str]:
    """What an embedded rehearsal of this plan runs here (`mixfleet run --embedded` applies the same transform,
    runner/orchestration/rehearsal.py), or why it cannot run here: (lines, "") or ([], reason)."""
    from mixfleet.runner.orchestration.rehearsal import rehearsal_of
    from mixfleet.ui.app_common import error_text, plan_object

    try:
        return rehearsal_of(plan_object(PlanText("", plan_toml))).lines(), ""
    except ValueError as e:               # SpecError: the field, the value, why
        return [], error_text(e)


def rehearsal_task(pt: PlanText) -> str:
    """The task a run of this plan trains on: the plan's embedded.task, else the runner's default
    (runner/orchestration/config.py `task_of`)."""
    from mixfleet.runner.orchestration.config import DEFAULT_TASK, task_of
    from mixfleet.ui.app_common import plan_object

    try:
        return task_of(plan_object(pt))
    except ValueError:
        return DEFAULT_TASK


def _rehearsal_note(pt: PlanText) -> str:
    """The rehearsal said on the page before Start (issue 26: the page started a 35B plan on CPU, then called the
    failure "starting"); the reason it cannot run here when it cannot."""
    lines, why = rehearsal_text(pt.toml)
    if why:
        st.warning(f"An embedded rehearsal of this plan cannot run on this machine: {why}")
        return why
    head, *groups = lines
    st.markdown(f"**Embedded rehearsal here**: {head}; task **{rehearsal_task(pt)}**")
    if groups:
        st.code("\n".join(g.strip() for g in groups), language=None)
    return ""


def _base_note(pt: PlanText, key: str) -> None:
    """Whether the base policy an embedded run of this plan starts from is cached, and a button that prepares it
    beforehand when it is not (issue 44: the first run pretrained it for minutes inside "starting")."""
    from mixfleet.ui import base_prep

    try:
        b = base_prep.base_of(pt.toml)
    except Exception:  # the rehearsal's refusal is said above
        return
    if b.cached:
        st.caption(f"Base policy: cached (`{b.command}`); an embedded run starts from it without pretraining.")
        return
    proc = base_prep.PROCS.get(b.key)
    if base_prep.preparing(b.key):
        st.info(f"Preparing the base policy (`{b.command}`) in the background: "
                f"{base_prep.last_line(b.key) or 'starting'}. A run started before it is cached trains its own.")
        st.button("Refresh", key=f"{key}_base_refresh")
        return
    if proc is not None and proc.returncode:
        st.error(f"Preparing the base policy failed (exit {proc.returncode}): {base_prep.last_line(b.key)}; "
                 f"log `{base_prep.log_path(b.key)}`")
    st.info(f"The base policy of an embedded run (`{b.command}`) is not cached yet: the first run trains it before "
            "its first update (minutes on a 2-core CPU, about 10 under load). Prepare it now, beforehand.")
    if st.button("Prepare the base policy now", key=f"{key}_base_prep"):
        try:
            base_prep.start(pt.toml)
        except Exception as e:
            show_error("cannot prepare the base policy", e)
            return
        st.rerun()


def run_for_real(pt: PlanText, key: str) -> None:
    """A form that starts `mixfleet run` on this plan as a managed background process, then opens the Runs page."""
    root = runs_dir()
    with st.expander("Run for real", expanded=False):
        st.caption(f"Starts `mixfleet run` on this plan in the background, in a run folder under `{root}` with the "
                   "plan written beside it; the Runs page follows it, stops it and resumes it. By default the plan's "
                   "own fleet is rehearsed on this machine: every group as embedded samplers in its precision, KV "
                   "dtype and kernel, with the plan's policies, on the tiny stand-in of its model family.")
        refusal = _rehearsal_note(pt)
        if not refusal:
            _base_note(pt, key)
        with st.form(f"{key}_run_form"):
            c1, c2 = st.columns([3, 1])
            # keyed by the plan, so the name follows the chosen plan (a fixed key kept the first plan's name)
            name = c1.text_input("Run name (a folder under the runs folder)", value=_default_name(pt),
                                 key=f"{key}_run_name_{pt.digest}")
            updates = c2.number_input("Updates to run", min_value=1, max_value=rm.MAX_UPDATES,
                                      value=_default_updates(), step=1, key=f"{key}_run_updates",
                                      help="Trainer updates of the real run (each takes real minutes on a CPU; the "
                                           "page's simulated updates are a separate setting)")
            where = st.radio("Samplers", [EMBEDDED, CLUSTER, ATTACH], horizontal=True, key=f"{key}_run_where")
            address = st.text_input("Ray address (for a cluster)", value="", key=f"{key}_run_address",
                                    placeholder="ray://head:10001 or host:6379")
            attach = st.text_input("Attach (GROUP=URL, comma-separated)", value="", key=f"{key}_run_attach")
            init = st.text_input("Base policy checkpoint (empty: the cached `mixfleet pretrain`, trained if missing)",
                                 value=os.environ.get(INIT_ENV, ""), key=f"{key}_run_init")
            live = st.multiselect("Stream the metrics live to (`mixfleet run --tracker`)", list(TRACKER_NAMES),
                                  key=f"{key}_run_trackers",
                                  help="TensorBoard: RUNS/tensorboard/<run name>; W&B offline: RUNS/wandb (sync it "
                                       "later). The Runs page exports any run afterwards as well.")
            go = st.form_submit_button("Start the run", type="primary")
        refused_key = f"{key}_run_refused"
        refused = where == EMBEDDED and bool(refusal)   # refused here, with the reason, not a process that dies
        if go:
            st.session_state[refused_key] = pt.digest if refused else None
        if refused and st.session_state.get(refused_key) == pt.digest:
            # kept until the plan or the choice changes: a refusal that vanished on the page's next rerun (any
            # widget, a second upload event) read as if Start had done nothing
            st.error(f"cannot start the run: this plan cannot be rehearsed on this machine: {refusal}")
            return
        if not go:
            return
        try:
            if where == CLUSTER and not address.strip():
                raise rm.RunManagerError("a Ray cluster run needs its address")
            att = [a.strip() for a in attach.split(",") if a.strip()] if where == ATTACH else []
            if where == ATTACH and not att:
                raise rm.RunManagerError("attach needs GROUP=URL for at least one group")
            if init.strip() and not Path(init.strip()).expanduser().is_dir():
                raise rm.RunManagerError(f"base policy checkpoint {init!r}: no such folder")
            m = rm.start(root, name.strip(), pt.toml, int(updates),
                         init=str(Path(init.strip()).expanduser().resolve()) if init.strip() else None,
                         address=address.strip() if where == CLUSTER else None, attach=att,
                         embedded=where == EMBEDDED, trackers=[TRACKER_NAMES[t] for t in live])
        except Exception as e:  # bad name, busy folder, invalid plan: say so on the page, start nothing
            show_error("cannot start the run", e)
            return
        follow(m.run_dir)
        st.success(f"Started `{m.name}` (pid {m.pid}).")
        st.switch_page(RUNS_PAGE)


# ---- the Runs page --------------------------------------------------------------------------------
def follow(run_dir: Path) -> None:
    """Open the Runs page on this run log: now when it is listed, else as soon as it is (a run just started or
    resumed; `apply_follow`). Without this the page fell back to the newest log, a twin dry run (issue 26)."""
    st.session_state[WANT_KEY] = str(run_dir)


def apply_follow(listed: set[str]) -> None:
    """Before the Runs page's selectbox: select the followed run once its log is listed; a pick that is not
    listed (yet) is followed rather than dropped."""
    want = st.session_state.get(WANT_KEY)
    if want in listed:
        st.session_state[PICK_KEY] = want
        del st.session_state[WANT_KEY]
    elif st.session_state.get(PICK_KEY) not in listed:
        pick = st.session_state.pop(PICK_KEY, None)
        if pick:
            st.session_state[WANT_KEY] = pick


def unfollow() -> None:
    """The user picked a run log: stop following another."""
    st.session_state.pop(WANT_KEY, None)


def managed_for(run_path: Path) -> rm.ManagedRun | None:
    """The managed run whose run log is `run_path` (RUNS/<name>/run), if the app started it."""
    if run_path.name != rm.RUN_SUBDIR:
        return None
    return rm.load(run_path.parent)


def pending_runs(root: Path, listed: set[str]) -> list[rm.ManagedRun]:
    """Managed runs whose run log does not exist yet (still starting: Ray, samplers, the base policy)."""
    return [m for m in rm.find(root) if str(m.run_dir) not in listed]


def _rerun_on_change(m: rm.ManagedRun, state: str) -> None:
    """Rerun the whole page (not just this fragment) when a managed run's state changes, so the run-log list,
    the run's status line and the calibration section follow it."""
    seen = st.session_state.setdefault("managed_states", {})
    before = seen.get(m.name)
    seen[m.name] = state
    if before is not None and before != state:
        st.rerun(scope="app")


def show_pending(m: rm.ManagedRun) -> None:
    if (m.run_dir / "run.json").exists():
        st.rerun(scope="app")            # its run log is there now: list it
    state = m.state()
    if state in ("running", "stopping"):
        step = pretrain_step(m.log_tail())
        st.info(f"Run `{m.name}` is **{state}**: starting (Ray, samplers, the base policy); its run log appears "
                "when the first sampler is up."
                + (f" Now {step} (once per model and task: later runs reuse the cached base; `mixfleet pretrain` "
                   "prepares it beforehand)." if step else ""))
    else:                     # it ended before writing a log: say so, not "starting" (issue 26)
        st.error(f"Run `{m.name}` **{state}** before its run log appeared: it did not start. The driver log below "
                 "says why.")
    _controls(m, None)
    _log_tail(m)


def pretrain_step(log_tail: str) -> str | None:
    """The last "pretraining the base policy: ..." progress line of a starting run's driver log (e.g.
    "pretraining the base policy: demonstrations 400/2000"), or None when it is not pretraining or has finished
    (its last line is the last step)."""
    from mixfleet.runner.orchestration.recipe import PRETRAIN_LINE

    lines = [ln.strip() for ln in log_tail.splitlines() if ln.startswith(PRETRAIN_LINE)]
    if not lines:
        return None
    m = re.match(r"steps (\d+)/(\d+)", lines[-1][len(PRETRAIN_LINE):])
    return None if m and m[1] == m[2] else lines[-1]


def _predicted_s_per_update(twin_path: str | None) -> float | None:
    if not twin_path:
        return None
    from mixfleet.ui.app_common import load_run

    try:
        s = load_run(twin_path).summary
    except Exception:
        return None
    for k in ("steady_time_per_update_s", "time_per_update_mean_s"):
        v = s.get(k)
        if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            return float(v)
    return None


def managed_panel(m: rm.ManagedRun, twin_path: str | None) -> None:
    """Progress (updates done / target, elapsed, ETA), events, log tail and the controls of a managed run."""
    state = m.state()
    _rerun_on_change(m, state)
    run = _run_log(m)                   # one cached read for progress and events (the page's own cache)
    p = progress(m, _predicted_s_per_update(twin_path), updates=run.updates if run is not None else None)
    st.markdown(f"**Managed run `{m.name}`**: {state} · pid {m.pid} · started {m.started_utc}"
                + (f" · resumed {m.resumes}x" if m.resumes else ""))
    frac = min(1.0, p["done"] / p["target"]) if p["target"] else 0.0
    eta = (f", ETA {fmt_s(p['eta_s'])} ({p['eta_basis']})" if p["eta_s"] is not None and state == "running" else "")
    st.progress(frac, text=f"{p['done']} / {p['target']} updates · elapsed {fmt_s(p['elapsed_s'])}{eta}")
    _controls(m, p)
    _events(run)
    _log_tail(m)


def _controls(m: rm.ManagedRun, p: dict[str, Any] | None) -> None:
    state = m.state()
    err = st.session_state.get(ACT_ERROR_KEY, {}).get(m.name)
    if err is not None:
        show_error("managed run", err)
    c = st.columns(4)
    key = f"mr_{m.name}"
    if state == "running":
        if c[0].button("Stop (after this update)", key=f"{key}_stop",
                       help="SIGTERM: the run finishes the update under way, checkpoints and closes its log "
                            "as 'stopped'. Resume continues it."):
            _act(lambda: rm.stop(m), m.name)
    elif state == "stopping":
        c[0].caption("stopping after the current update...")
    if state in ("running", "stopping"):
        _kill_control(m, c[3], key)
        return
    st.session_state.get(KILL_ARMED_KEY, {}).pop(m.name, None)     # a confirmation never outlives the run
    if state in ("stopped", "killed", "exited", "failed", "finished"):
        label = "Continue" if state == "finished" else "Resume"
        more = c[1].number_input(f"{label} to updates (target)", min_value=1, max_value=rm.MAX_UPDATES,
                                 value=max(m.updates, (p or {}).get("done", 0) + (1 if state == "finished" else 0)),
                                 key=f"{key}_more", help="the run's target number of updates, counted from its "
                                                         "start: more than it has done continues it that far")
        if c[0].button(label, key=f"{key}_resume", type="primary",
                       help="`mixfleet run ... --resume`: from the last trainer checkpoint, each update once"):
            _act(lambda: follow(rm.resume(m, int(more)).run_dir), m.name)


KILL_ARMED_KEY = "managed_run_kill_armed"     # session state: {run name: Kill now pressed, not yet confirmed}


def _kill_control(m: rm.ManagedRun, col: Any, key: str) -> None:
    """Kill now, in the last column (away from Stop), and only after a confirmation: it acted at once, one button
    from Stop (issue 44), and loses the update under way."""
    armed = st.session_state.setdefault(KILL_ARMED_KEY, {})
    if not armed.get(m.name):
        if col.button("Kill now", key=f"{key}_kill", help="SIGKILL to the run and its Ray; asks first. The update "
                                                          "under way is lost; resumable from the last checkpoint."):
            armed[m.name] = True
            st.rerun()
        return
    col.warning(f"Kill `{m.name}` now? SIGKILL: the update under way is lost; Resume continues from the last "
                "checkpoint. **Stop** ends it after this update instead.")
    yes, no = col.columns(2)
    if yes.button("Kill", key=f"{key}_kill_confirm", type="primary"):
        armed.pop(m.name, None)
        _act(lambda: rm.kill(m), m.name)
    if no.button("Cancel", key=f"{key}_kill_cancel"):
        armed.pop(m.name, None)
        st.rerun()


ACT_ERROR_KEY = "managed_run_errors"          # session state: {run name: the last control's error}


def _act(fn: Any, name: str = "") -> None:
    """Run a control; its error stays on the page until the next control of that run (the panel refreshes
    every few seconds, which wiped an error shown once: issue 26)."""
    errors = st.session_state.setdefault(ACT_ERROR_KEY, {})
    errors.pop(name, None)
    try:
        fn()
    except Exception as e:
        errors[name] = e
        show_error("managed run", e)
        return
    st.rerun()


def _run_log(m: rm.ManagedRun) -> Any:
    """The managed run's log as the Runs page reads it (cached until a file changes), or None before it exists."""
    from mixfleet.ui.app_common import load_run

    try:
        return load_run(m.run_dir)
    except Exception:  # not written yet, or being written
        return None


def _events(run: Any) -> None:
    ev = run.events if run is not None else None
    if ev is not None and len(ev):
        keep = ev[ev["kind"].isin(["cold_start", "ready", "crash", "restart", "weight_push_failed", "resume",
                                   "scale_up", "scale_down", "preempt"])]
        cols = [c for c in ("time_s", "kind", "group", "replica", "detail") if c in keep.columns]
        with st.expander(f"Events ({len(keep)})", expanded=False):
            st.dataframe(pd.DataFrame(keep[cols]).tail(200), hide_index=True, width="stretch")


def _log_tail(m: rm.ManagedRun) -> None:
    with st.expander("Driver log (tail)", expanded=m.state() in ("exited", "failed")):
        st.code(m.log_tail()[-6000:] or "(empty)", language=None)


# ---- calibrate and re-plan -------------------------------------------------------------------------
CAL_RESULT_KEY = "runs_calibration_result"   # session state: {run path: (calibration file, rows)}


def _calibration_path(root: Path, run_path: Path) -> Path:
    m = managed_for(run_path)
    if m is not None:
        return Path(m.folder) / "calibration.toml"
    return root / "calibrations" / f"{run_path.name}-calibration.toml"


def _num(x: Any) -> float:
    """A number for the table (None, i.e. not estimated, becomes NaN and shows as a dash)."""
    return float(x) if isinstance(x, int | float) else math.nan


def _source(v: Any) -> str:
    """Where a value comes from: fitted; kept at the prior (equal to it); or derived from fitted values (not
    fitted itself, but moved from its prior, e.g. prefill overhead = prior x decode scale). The table used to tick
    "kept at prior" on such a moved value (issue 26)."""
    if v.fitted:
        return "fitted"
    prior = _num(v.prior)
    value = _num(v.value)
    if math.isfinite(prior) and math.isfinite(value) and not math.isclose(value, prior, rel_tol=1e-9, abs_tol=1e-12):
        return "derived (moved from the prior)"
    return "kept at prior"


def _fitted_rows(cal: Any) -> list[dict[str, Any]]:
    """One row per fitted value: where, parameter, fitted, 1-sigma, prior, unit, fitted or kept, note."""
    import dataclasses

    from mixfleet.costmodel.calibration.record import Fitted

    rows = []

    def add(where: str, obj: Any) -> None:
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, Fitted):
                # a fit at its lower bound of 0 lands at round-off (1.178e-19 s, "± 0.029"): shown as 0
                fitted = 0.0 if abs(v.value) < 1e-12 else v.value
                prior = _num(v.prior)
                ratio = fitted / prior if math.isfinite(prior) and prior > 0 else math.nan
                rows.append({"where": where, "parameter": f.name, "fitted": fitted, "± (1σ)": _num(v.stderr),
                             "prior": prior, "fitted / prior": ratio, "unit": v.unit, "source": _source(v),
                             "note": v.note or ""})

    add("shared", cal)
    for g in cal.groups:
        add(g.name, g)
    return rows


FAR_FROM_PRIOR = 3.0     # a fitted value this many times its prior (or below 1/this) is flagged on the page


def far_from_prior(rows: list[dict[str, Any]]) -> list[str]:
    """"trainer_step_scale (shared): 11x its prior" for each fitted row at >= FAR_FROM_PRIOR x or <= 1 /
    FAR_FROM_PRIOR x its prior (issue 44: a trainer 11x slower than its prior went unremarked)."""
    out = []
    for r in rows:
        x = r.get("fitted / prior", math.nan)
        if r.get("source") == "fitted" and math.isfinite(x) and x > 0 and max(x, 1 / x) >= FAR_FROM_PRIOR:
            out.append(f"`{r['parameter']}` ({r['where']}): {x:.3g}x its prior")
    return out


def calibrate_and_replan(run_path: Path, header: dict[str, Any], root: Path,
                         others: list[tuple[Path, dict[str, Any]]]) -> None:
    """Fit a calibration from this run's log (and others picked), show it beside the priors, then open the
    Plan page with it selected."""
    st.subheader("Calibrate and re-plan")
    if header.get("status") in ("running", "stopping"):     # the Runs page's status: a killed run's is "killed"
        st.caption("Available once the run has finished, stopped or been killed (from its completed updates).")
        return
    same = [str(p) for p, h in others if p != run_path and h.get("source") == "runner"]
    extra = st.multiselect("Also fit on", same, key="runs_cal_extra", format_func=lambda s: Path(s).parent.name
                           if Path(s).name == rm.RUN_SUBDIR else Path(s).name)
    results = st.session_state.setdefault(CAL_RESULT_KEY, {})
    if st.button("Fit a calibration from this run", key="runs_cal_fit", type="primary"):
        from mixfleet.costmodel.calibration.fit import calibrate

        out = _calibration_path(root, run_path)
        with st.spinner("fitting..."):
            try:
                cal = calibrate([run_path, *[Path(s) for s in extra]])
                out.parent.mkdir(parents=True, exist_ok=True)
                cal.save(out)
            except Exception as e:
                show_error("calibration failed", e)
                return
        results[str(run_path)] = (str(out), _fitted_rows(cal))
    res = results.get(str(run_path))
    if res is None:
        st.caption("Fits the cost model's free parameters to this run log by bounded least squares (per group the "
                   "roofline time scale, weight-sync time, mismatch; shared turn latency and trainer time), each "
                   "with its 1σ uncertainty, and writes a calibration file the Plan page can use.")
        return
    path, rows = res
    st.dataframe(pd.DataFrame(rows).style.format({"fitted": fmt_table, "± (1σ)": "{:.2g}", "prior": fmt_table,
                                                  "fitted / prior": "{:.3g}x"}, na_rep="—"),
                 hide_index=True, width="stretch", key="runs_cal_table")
    if far := far_from_prior(rows):
        st.warning("Far from the cost model's prior: " + "; ".join(far) + ". The run's machine differs from the "
                   "prior's (a loaded CPU, another GPU), or the model is missing something; plans priced with this "
                   "calibration inherit it.")
    st.caption(f"written to `{path}`")
    if st.button("Plan with this calibration", key="runs_replan", type="primary"):
        st.session_state[PLAN_CAL_KEY] = path
        st.switch_page(PLAN_PAGE)
