"""The Plan page: pick a model and a workload (or edit their numbers), edit the accelerator pool
(price per GPU-hour, max GPUs, allowed precisions; price tables one click apart), set constraints,
run the mix planner, and see the chosen mix, the Pareto chart (with the seed's two fleets as
reference points) and the plan TOML to download.

The planner is `mixfleet.planner` (engineer C); this page only gathers its inputs and shows
its result (see `app_planner.py`, the adapter). Edited model / workload numbers are validated by
costmodel and written as spec files under the runs folder, which the plan then names.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
import tomllib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
import tomli_w
from mixfleet.costmodel.plan.planspec import MAX_SANDBOX_START_S, MAX_SANDBOXES
from mixfleet.costmodel.specs.formats import formats
from mixfleet.planner.config import DEFAULT_SANDBOX_START_S, PlannerConfig
from mixfleet.planner.defaults import DEFAULTS
from mixfleet.ui import app_charts as charts
from mixfleet.ui import app_planner as planner
from mixfleet.ui.app_common import (
    calibration_files,
    default_workload_override,
    fmt_s,
    fmt_usd,
    fmt_versions,
    runs_dir,
    show_error,
)

CALIBRATION_REQUEST_KEY = "plan_calibration_request"   # set by the Runs page: plan with this calibration file
PLAN_PAGE_KEY = "planned_plan"      # session state: the chosen plan as PlanText (read by the Dry-run page)
RESULT_KEY = "plan_result"          # session state: the last PlannerView
TIMING_KEY = "plan_timing"          # session state: seconds from Run planner to the plan shown / the page complete
DEFAULT_MODEL = DEFAULTS.model           # every input's default is the planner's one set (`mixfleet plan`'s)
DEFAULT_WORKLOAD = DEFAULTS.workload
PRECISIONS = formats().gpu_precisions   # data/precisions.toml: native on some GPU


# ---- cached reads (costmodel) ---------------------------------------------------------------------------
@st.cache_data(show_spinner=False)
def _known() -> tuple[list[str], list[str], tuple[str, ...]]:
    from mixfleet.costmodel.specs.catalog import load_catalog
    from mixfleet.costmodel.specs.model import known_models
    from mixfleet.costmodel.specs.workload import known_workloads

    return known_models(), known_workloads(), load_catalog().price_tables()


@st.cache_data(show_spinner=False)
def _spec_toml(kind: str, name: str) -> str:
    """A shipped model / workload as TOML text (its numbers, for editing)."""
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.costmodel.specs.workload import load_workload

    d = load_model_spec(name).to_dict() if kind == "model" else load_workload(name).to_dict()
    return tomli_w.dumps(d)


@st.cache_data(show_spinner=False)
def _pool(price_table: str, setup: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> pd.DataFrame:
    """The default pool: every GPU of the catalog at this price table, its native precisions allowed; with a
    calibration's `setup` ((accelerator, precisions), ...): those accelerators with those precisions only."""
    from mixfleet.costmodel.specs.catalog import load_catalog

    cat = load_catalog(price_table)
    rows = []
    for name, allowed in setup or tuple((n, ()) for n in cat.gpus()):
        acc = cat.accelerator(name)
        native = list(allowed) or [p for p in PRECISIONS if cat.support(name, p) == "native"]
        rows.append({"use": True, "accelerator": name, "usd_per_gpu_hour": acc.price_usd_per_gpu_hour,
                     "max_gpus": planner.DEFAULT_MAX_GPUS, "precisions": native,
                     "price_note": "estimate" if acc.price_estimate else price_table})
    return pd.DataFrame(rows)


def _validated_spec(kind: str, text: str) -> str:
    """Validate edited spec TOML with costmodel and write it under the runs folder; returns its path."""
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.costmodel.specs.model import model_spec_from_dict
    from mixfleet.costmodel.specs.workload import workload_from_dict

    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"edited {kind}", "<text>", "not TOML", f"valid TOML ({e})") from None
    spec = model_spec_from_dict(raw, f"edited {kind}") if kind == "model" else workload_from_dict(raw, f"edited {kind}")
    folder = runs_dir() / "ui-specs"
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    path = folder / f"{kind}-{spec.name}-{digest}.toml"
    if not path.exists():
        path.write_text(text)
    return str(path)


PLAN_CACHE_ENTRIES = 8
_plan_cache: OrderedDict[str, planner.PlannerView] = OrderedDict()
_plan_cache_lock = threading.Lock()


def _plan_cached(inputs: dict[str, Any], pool: pd.DataFrame, progress: Any) -> planner.PlannerView:
    """The planner + twin checks for these exact inputs: a repeat, from any session of this app, is instant.

    A plain process-wide LRU rather than `st.cache_data`: the planner drives the page's progress bar, and
    Streamlit cannot replay a cached call that drew elements (it raised CacheReplayClosureError on the second
    press of Run planner with the same inputs, in any tab). Each caller gets its own deep copy, as from
    `st.cache_data`."""
    from mixfleet.ui.app_plan_result import inputs_key

    key = inputs_key(inputs, pool)
    with _plan_cache_lock:
        hit = _plan_cache.get(key)
        if hit is not None:
            _plan_cache.move_to_end(key)
            return copy.deepcopy(hit)
    view = planner.run(pool=pool, progress=progress, **inputs)
    _cache_put(key, view)
    return view


def _cache_put(key: str, view: planner.PlannerView) -> None:
    with _plan_cache_lock:
        _plan_cache[key] = copy.deepcopy(view)
        _plan_cache.move_to_end(key)
        while len(_plan_cache) > PLAN_CACHE_ENTRIES:
            _plan_cache.popitem(last=False)


# ---- inputs ------------------------------------------------------------------------------------------------
def _model_and_workload() -> tuple[str, str] | None:
    models, workloads, _ = _known()
    c1, c2 = st.columns(2)
    with c1:
        model = st.selectbox("Model", models, index=models.index(DEFAULT_MODEL) if DEFAULT_MODEL in models else 0,
                             key="pl_model")
        with st.expander("Edit the model's numbers"):
            mtext = st.text_area("model spec (TOML)", _spec_toml("model", model), height=260, key=f"pl_mt_{model}")
    with c2:
        wdef = default_workload_override() or DEFAULT_WORKLOAD
        if (setup := st.session_state.get(SETUP_KEY)) and setup["workload"] not in workloads:
            workloads = [setup["workload"], *workloads]        # the calibration's measured workload (a file)
        wl = st.selectbox("Workload", workloads, index=workloads.index(wdef) if wdef in workloads else 0,
                          key="pl_workload", format_func=lambda w: f"{Path(w).stem} (measured, from the "
                          "calibration)" if w.endswith(".toml") else w)
        base = tomllib.loads(_spec_toml("workload", wl))
        k1, k2, k3 = st.columns(3)
        ppu = int(k1.number_input("prompts / update", 1, 100_000, int(base["prompts_per_update"]), key=f"pl_p_{wl}"))
        spp = int(k2.number_input("samples / prompt", 1, 1024, int(base["samples_per_prompt"]), key=f"pl_s_{wl}"))
        ctx = int(k3.number_input("max context (tokens)", 128, 10_000_000, int(base["max_context"]), step=1024,
                                  key=f"pl_c_{wl}"))
        with st.expander("Edit the workload's distributions"):
            wtext = st.text_area("workload spec (TOML)", _spec_toml("workload", wl), height=260, key=f"pl_wt_{wl}")
    try:
        model_ref = model if mtext == _spec_toml("model", model) else _validated_spec("model", mtext)
        w = tomllib.loads(wtext) if wtext != _spec_toml("workload", wl) else dict(base)
        edited = (ppu, spp, ctx) != (base["prompts_per_update"], base["samples_per_prompt"], base["max_context"])
        if edited or wtext != _spec_toml("workload", wl):
            w.update(prompts_per_update=ppu, samples_per_prompt=spp, max_context=ctx)
            wl_ref = _validated_spec("workload", tomli_w.dumps(w))
        else:
            wl_ref = wl
    except Exception as e:
        show_error("invalid model / workload numbers", e)
        return None
    return model_ref, wl_ref


def _pool_editor() -> tuple[str, pd.DataFrame | None, tuple[str, ...], bool]:
    """The pool table (None when its prices / precisions are invalid: the error is shown), KV dtypes, emulation."""
    _, _, tables = _known()
    c1, c2 = st.columns([1, 3])
    with c1:
        dflt = DEFAULTS.price_table if DEFAULTS.price_table in tables else tables[0]
        table = st.segmented_control("Price table", list(tables), default=dflt, key="pl_prices") or dflt
    with c2:
        st.caption("Prices are USD per GPU-hour from `data/accelerators.toml`; switch the table for another cloud, "
                   "or edit a price (it then overrides the table for the samplers, the trainer and the written plan). "
                   "Untick **use** to leave an accelerator out; edit **max GPUs** to cap it; narrow **allowed "
                   "precisions** to restrict the weight formats the planner may use there (default: the native ones).")
    setup = st.session_state.get(SETUP_KEY)
    if setup:
        c1, c2 = st.columns([3, 1])
        c1.info(f"The pool, trainer, model and workload of calibration `{Path(setup['calibration']).name}`: "
                f"{', '.join(a for a, _ in setup['pool'])} with the precisions its groups ran, its measured workload "
                "`" + Path(setup["workload"]).stem + "`. A plan here can change with the calibration on this machine.")
        if c2.button("Back to the GPU pool", key="pl_setup_off"):
            del st.session_state[SETUP_KEY]
            st.rerun()
    pool_setup = tuple((a, tuple(ps)) for a, ps in setup["pool"]) if setup else ()
    pool = st.data_editor(
        _pool(table, pool_setup), key=f"pl_pool_{table}" + ("_setup" if setup else ""), hide_index=True,
        width="stretch", num_rows="fixed",
        column_config={
            "use": st.column_config.CheckboxColumn("use"),
            "accelerator": st.column_config.TextColumn("accelerator", disabled=True),
            "usd_per_gpu_hour": st.column_config.NumberColumn("USD / GPU-hour", format="$%.2f", min_value=0.01,
                                                              step=0.01, required=True),
            "max_gpus": st.column_config.NumberColumn("max GPUs", min_value=0, step=1, format="%d"),
            "precisions": st.column_config.MultiselectColumn("allowed precisions", options=list(PRECISIONS)),
            "price_note": st.column_config.TextColumn("price source", disabled=True),
        })
    c1, c2 = st.columns([3, 2])
    kv = c1.multiselect("KV-cache dtypes to consider", list(planner.KV_DTYPES), default=list(DEFAULTS.kv_dtypes),
                        key="pl_kv")
    emulated = c2.toggle("allow emulated precisions", value=DEFAULTS.emulated, key="pl_emul",
                         help="Let **allowed precisions** name formats an accelerator only emulates (runs slower), "
                              "e.g. nvfp4 on H100.")
    try:
        planner.check_pool(pool, table, emulated)
    except Exception as e:
        show_error("invalid accelerator pool", e)
        return table, None, tuple(kv), emulated
    return table, pool, tuple(kv), emulated


def _trainer() -> dict[str, Any]:
    from mixfleet.costmodel.specs.catalog import load_catalog

    accs = load_catalog().gpus()
    setup = st.session_state.get(SETUP_KEY)
    if setup and setup["trainer"] not in accs:
        accs = [setup["trainer"], *accs]
    c = st.columns(4)
    t = DEFAULTS.trainer_accelerator
    acc = c[0].selectbox("trainer accelerator", accs, index=accs.index(t) if t in accs else 0, key="pl_tacc")
    gpus = int(c[1].number_input("trainer GPUs", 1, 4096, DEFAULTS.trainer_gpus, key="pl_tgpus"))
    n = int(c[2].number_input("twin check: updates per run (0 = automatic)", 0, 100, planner.DEFAULT_TWIN_UPDATES,
                              key="pl_tn",
                              help="The planner verifies its best candidates in the twin for this many updates from "
                                   "a warm start (0: 10 + prompts in flight / prompts per update, as `mixfleet "
                                   "plan`), and the chosen mix and the seed's two fleets are dry-run as long, at once "
                                   "on this machine's cores; their steady state is shown (each check kept in the "
                                   "twin's check cache: the same question again is read back)."))
    refs = c[3].toggle("show the seed's two fleets", value=True, key="pl_refs")
    return {"trainer_accelerator": acc, "trainer_gpus": gpus, "twin_updates": n, "references": refs}


def _constraints() -> dict[str, Any]:
    c = st.columns(4)
    stale = c[0].number_input(planner.LABEL_STALENESS, 0.0, 100.0, planner.DEFAULT_MAX_STALENESS,
                              step=0.5, key="pl_stale")
    tpu = c[1].number_input(planner.LABEL_TIME, 0.0, 1e6, planner.DEFAULT_MAX_TIME_S, step=10.0,
                            key="pl_tpu")
    budget = c[2].number_input(planner.LABEL_BUDGET, 0.0, 1e7, planner.DEFAULT_BUDGET_USD_H, step=50.0,
                               key="pl_budget")
    objective = c[3].selectbox("minimize", list(planner.OBJECTIVES), key="pl_obj",
                               index=list(planner.OBJECTIVES.values()).index(DEFAULTS.objective))
    return {"max_staleness": stale or None, "max_time_per_update_s": tpu or None, "budget_usd_per_hour": budget or None,
            "objective": objective}


MODEL_REQUEST_KEY = "plan_model_request"   # "Plan its model" (the calibration's): applied before the Model box
SETUP_REQUEST_KEY = "plan_setup_request"   # "Plan its setup" (a CPU calibration's): applied before the inputs
SETUP_KEY = "plan_setup"                   # session state: the setup in force (pool, trainer, workload file)


def calibration_setup(path: str, cal: Any = None) -> dict[str, Any] | None:
    """What "Plan its setup" puts on the page for a calibration fitted on accelerators that are not GPUs of the
    catalog (a run on this machine's CPUs, issue 44: such a calibration could never change a plan in the app):
    its model, its measured workload (written under the runs folder), its accelerators with the precisions and KV
    dtypes its groups ran, its trainer. None for a calibration of GPUs (their pool is the default one). `cal`:
    the file's Calibration if the caller has loaded it already."""
    from mixfleet.costmodel.calibration.record import Calibration
    from mixfleet.costmodel.specs.catalog import load_catalog

    cal = cal if cal is not None else Calibration.load(path)
    gpus = set(load_catalog().gpus())
    accs = sorted({g.accelerator for g in cal.groups})
    if not accs or set(accs) <= gpus or not cal.model or cal.workload is None:
        return None
    pool = [(a, sorted({g.precision for g in cal.groups if g.accelerator == a})) for a in accs]
    workload = _validated_spec("workload", tomli_w.dumps(cal.workload))
    return {"calibration": path, "model": cal.model, "workload": workload, "pool": pool,
            "kv": sorted({g.kv_dtype for g in cal.groups}), "trainer": cal.trainer_accelerator,
            "trainer_gpus": int(cal.trainer_gpus)}
PLANNED_CAL_KEY = "plan_planned_calibration"   # session state: (calibration file, coverage line) of the last plan


def calibration_coverage(path: str, model: str, pool: pd.DataFrame | None, kv: tuple[str, ...],
                         trainer_accelerator: str) -> tuple[bool, str, str]:
    """What a calibration covers and what it changes in this plan's pool (issue 26: a calibration fitted on CPU
    groups of the tiny model matches no group of a GPU pool, and planning with it silently used the priors).
    Returns (changes anything, what it covers, what it changes here). A candidate group takes a calibrated group's
    values when it has its (accelerator, precision, KV dtype) (`planspec.group_calibration`: planner candidates
    have no kernel of their own); the trainer's fit applies on the accelerator it was made on."""
    from mixfleet.costmodel.calibration.record import Calibration
    from mixfleet.costmodel.specs.model import load_model_spec

    cal = Calibration.load(path)
    groups = ", ".join(f"`{g.name}` ({g.accelerator} {g.precision}, KV {g.kv_dtype})" for g in cal.groups) or "none"
    covers = (f"Calibration `{Path(path).name}`: fitted on model **{cal.model or '?'}**; sampler groups {groups}; "
              f"trainer {cal.trainer_accelerator} x {cal.trainer_gpus}.")
    offered: set[tuple[str, str, str]] = set()
    if pool is not None:
        for _, r in pool.iterrows():
            if bool(r["use"]) and int(r["max_gpus"] or 0) > 0:
                for prec in planner.precision_list(r["precisions"]):
                    offered |= {(str(r["accelerator"]), prec, k) for k in kv}
    hit = [g for g in cal.groups if (g.accelerator, g.precision, g.kv_dtype) in offered]
    try:
        here = load_model_spec(model).name
    except Exception:  # an edited spec being typed: compared by its reference
        here = model
    parts = []
    if hit:
        parts.append("its fitted values replace the priors for " + ", ".join(
            f"{g.accelerator} {g.precision} (KV {g.kv_dtype})" for g in hit))
    else:
        accs = sorted({g.accelerator for g in cal.groups})
        parts.append(f"no candidate of this pool is one of its groups (its accelerators: {', '.join(accs) or 'none'}; "
                     "a group is matched by accelerator, precision and KV dtype)")
    trainer = trainer_accelerator == cal.trainer_accelerator
    parts.append(f"the trainer's fit {'applies' if trainer else 'does not apply'} (trainer here "
                 f"{trainer_accelerator}, calibrated on {cal.trainer_accelerator})")
    if cal.model and cal.model != here:
        parts.append(f"the model here is {here}, not the calibrated {cal.model}: matched factors would be "
                     "applied as is")
    changes = bool(hit) or trainer
    what = ("In this pool " + "; ".join(parts) + "." if changes else
            "In this pool it changes nothing: " + "; ".join(parts) + ". The planner prices every group with the "
            "cost model's priors.")
    return changes, covers, what


def _calibration_notice(path: str, model: str, pool: pd.DataFrame | None, kv: tuple[str, ...],
                        trainer_accelerator: str) -> str:
    try:
        changes, covers, what = calibration_coverage(path, model, pool, kv, trainer_accelerator)
    except Exception as e:
        show_error(f"cannot read calibration {path}", e)
        return ""
    (st.info if changes else st.warning)(f"{covers} {what}")
    from mixfleet.costmodel.calibration.record import Calibration

    cal = Calibration.load(path)
    cal_model = cal.model
    models = _known()[0]
    if (setup := calibration_setup(path, cal)) is not None:
        if (st.session_state.get(SETUP_KEY) or {}).get("calibration") != path and st.button(
                f"Plan its setup ({cal_model} on {', '.join(a for a, _ in setup['pool'])}, its measured workload)",
                key="pl_cal_setup", help="The calibration was fitted on accelerators outside the GPU pool (a run on "
                                         "this machine): plan its model and measured workload on its accelerators, "
                                         "precisions and trainer, where its fitted values apply."):
            st.session_state[SETUP_REQUEST_KEY] = setup
            st.rerun()
        return what
    if cal_model and cal_model in models and st.session_state.get("pl_model") != cal_model:
        if st.button(f"Plan its model ({cal_model})", key="pl_cal_model",
                     help="Selects the model the calibration was fitted on. Its accelerators are offered in the "
                          "pool only when they are GPUs of the catalog."):
            st.session_state[MODEL_REQUEST_KEY] = cal_model
            st.rerun()
    return what


# ---- results -----------------------------------------------------------------------------------------------
WIDE_HELP = ("too few steady updates to pin the figure down; raise **twin check: updates per dry run** and run "
             "the planner again")


def interval_text(value: Any, ci: Any, fmt: Any) -> tuple[str, bool]:
    """"value ± ci" for a metric card, and whether the 95% interval is wider than half the value (then marked
    with a warning sign: issue 26, an interval as wide as the figure read as a precise number)."""
    import math

    text = f"{fmt(value)} ± {fmt_s(ci, like=value) if fmt is fmt_s else fmt(ci)}"    # one unit on both sides
    try:
        flagged = math.isfinite(float(ci)) and abs(float(ci)) > 0.5 * abs(float(value))
    except (TypeError, ValueError):
        flagged = False
    return (f"⚠ {text}" if flagged else text), flagged


def _show(view: planner.PlannerView) -> Any:
    """The chosen mix, its tables, the Pareto chart and the plan's buttons; returns the chart's slot."""
    planned = st.session_state.get(PLANNED_CAL_KEY)
    st.subheader("Chosen mix" + (" (calibrated)" if planned else ""))
    if planned:
        st.caption(f"Planned with calibration `{planned[0]}`. {planned[1]}")
    p = view.chosen_point
    tw = p.get("twin") or {}
    if tw:
        st.markdown("**The twin's steady state** (± 95% interval; the analytic screen's figure under each)")
        c = st.columns(3)              # three wide cards: the ± part is never cut off (four cut it)
        wide = []
        for col, label, fmt, key, ci, analytic in (
                (c[0], "time per update", fmt_s, "time_per_update_s", "time_per_update_ci_s", "time_per_update_s"),
                (c[1], "cost per update", fmt_usd, "cost_per_update_usd", "cost_per_update_ci_usd",
                 "cost_per_update_usd"),
                (c[2], "mean staleness (versions)", fmt_versions, "staleness", "staleness_ci", "staleness_mean")):
            value, flagged = interval_text(tw[key], tw[ci], fmt)
            if flagged:
                wide.append(label)
            col.metric(label, value, delta=f"analytic {fmt(p.get(analytic))}", delta_color="off",
                       help=WIDE_HELP if flagged else "the twin's steady-state mean and its 95% interval")
        st.caption(f"Pipeline fill {fmt_s(tw['fill_s'])}, warm-up {tw['warmup_updates']} updates; {tw['updates']} "
                   f"updates from a warm start, {tw['steady_updates']} steady. These are the steady state: the fill "
                   "and the warm-up are left out. The Dry-run page averages over the whole dry run, the fill "
                   "included, so the same plan reads dearer and slower there.")
        if wide:
            st.warning(f"The interval of {', '.join(wide)} is wider than half its value: {WIDE_HELP}")
        st.markdown("**The analytic screen**")
    c = st.columns(5)
    c[0].metric("time per update", fmt_s(p.get("time_per_update_s")), help="the planner's steady-state estimate")
    c[1].metric("cost per update", fmt_usd(p.get("cost_per_update_usd")))
    c[2].metric("cost per effective update", fmt_usd(p.get("cost_per_effective_update_usd")),
                help="cost per update / share of tokens the correction keeps")
    c[3].metric("fleet + trainer", fmt_usd(p.get("usd_per_hour"), 0) + "/h")
    c[4].metric("mean staleness (versions)",
                "unbounded" if p.get("trainer_bound") else fmt_versions(p.get("staleness_mean")))
    st.caption(cost_split_text(p))
    st.table(view.mix_table)
    st.caption("**prior share outside [0.2, 5]**: the cost model's prior of the share of a group's tokens whose "
               "ratio of trainer to sampler probability falls outside [0.2, 5] (from its precision and KV cache). "
               "The correction masks those tokens, so the planner counts them as lost work: *cost per effective "
               "update* divides by the share it keeps. A calibration from a real run replaces the prior.")
    from mixfleet.ui.app_plan_result import show_versus_seed

    show_versus_seed(p, view.references, view.points, view.binds)
    if view.notes:
        st.caption(view.notes)
    chart = st.empty()   # drawn again when the seed fleets' twin points come (finish_twin_points)
    _chart(chart, view)
    st.caption("Filled circles: the planner's Pareto set; star: the chosen mix; diamonds: the seed's mixed and "
               "homogeneous sampler fleets on the same model, workload, prices and trainer (all the planner's "
               "analytic steady state). Open circles: the twin's steady state of the chosen mix and of the seed's "
               "fleets (warm-started dry runs, the pipeline fill and the warm-up left out).")
    d1, d2 = st.columns([1, 3])
    d1.download_button("Download the plan TOML", view.plan.toml, file_name=f"{view.plan.name}.toml",
                       mime="application/toml", type="primary", key="pl_download")
    d2.caption("The Dry-run page simulates this plan (choose **Plan page** there); "
               f"`mixfleet simulate {view.plan.name}.toml` does the same from a shell.")
    from mixfleet.ui.app_launch import run_for_real

    run_for_real(view.plan, "pl")
    return chart


def _bar_progress(bar: Any) -> Any:
    """A planner progress callback (fraction, text) that moves this progress bar (the fraction clamped to [0, 1])."""
    def progress(frac: float, text: str) -> None:
        bar.progress(min(max(frac, 0.0), 1.0), text=text)

    return progress


def _chart(slot: Any, view: planner.PlannerView) -> None:
    slot.plotly_chart(charts.pareto(view.points, chosen=view.chosen_point, references=view.references,
                                    twin_points=view.twin_points), width="stretch")


def cost_split_text(p: dict[str, Any]) -> str:
    """The chosen mix's cost per update split into sampling, training and sandboxes (the analytic screen; the
    twin's sandbox figure beside it when checked), as `mixfleet plan` prints it."""
    text = (f"Cost per update (analytic): sampling {fmt_usd(p.get('cost_sampling_per_update_usd'))} + training "
            f"{fmt_usd(p.get('cost_training_per_update_usd'))} + sandboxes "
            f"{fmt_usd(p.get('cost_sandbox_per_update_usd') or 0.0)}")
    if (p.get("cost_sandbox_per_update_usd") or 0.0) > 0:
        wait = p.get("sandbox_wait_share") or 0.0
        text += (f"; {p.get('sandboxes_live', 0.0):,.0f} sandboxes live on average, pool wait share "
                 f"{100 * wait:.1f} %" + (" (the cap binds)" if wait > 1e-9 else ""))
        tw = p.get("twin") or {}
        if tw.get("cost_sandbox_per_update_usd") is not None:
            text += (f"; twin: sandboxes {fmt_usd(tw['cost_sandbox_per_update_usd'])} per update, pool wait share "
                     f"{100 * (tw.get('sandbox_wait_share') or 0.0):.1f} %")
    return text + "."


def _sandboxes() -> dict[str, Any]:
    """The sandbox pool (issue 42): off by default, as `mixfleet plan`; on, each episode holds a sandbox for its
    whole length, billed per sandbox-hour, and a cap makes episodes wait (the plan says when it binds)."""
    c = st.columns(4)
    on = c[0].toggle("plan sandboxes (agentic work)", value=PlannerConfig.sandboxes, key="pl_sbx",
                     help="As `mixfleet plan --sandboxes`: a sandbox per live episode, its start latency, its price "
                          "per sandbox-hour; the cost per update is split into sampling, training and sandboxes.")
    cap = int(c[1].number_input("sandbox cap (0 = none)", 0, MAX_SANDBOXES, 0, step=256, key="pl_sbx_cap",
                                disabled=not on, help="The most sandboxes live at once (a provider's concurrency "
                                                      "limit, say): `--sandbox-cap`."))
    start = c[2].number_input("sandbox start (s)", 0.0, float(MAX_SANDBOX_START_S), DEFAULT_SANDBOX_START_S, step=1.0,
                              key="pl_sbx_start", disabled=not on, help="`--sandbox-start-s`.")
    price = c[3].number_input("USD per sandbox-hour (0 = the catalog's)", 0.0, 100.0, 0.0, step=0.01,
                              format="%.4f", key="pl_sbx_price", disabled=not on,
                              help="`--sandbox-price`; 0: the catalog's [sandbox] price (its source and date in "
                                   "data/accelerators.toml).")
    if not on:
        return {}
    return {"sandboxes": True, "sandbox_cap": cap or None, "sandbox_start_s": float(start),
            "sandbox_usd_per_hour": float(price) or None}


def render() -> None:
    st.title("Plan")
    st.caption("Find the cheapest sampler mix that meets your constraints. Every field has a default; "
               "press **Run planner**.")
    st.caption("The defaults are the planner's one set, the same as `mixfleet plan` with no options (so the two "
               f"choose the same mix): {DEFAULTS.describe()}.")
    if not planner.available():
        st.warning(f"The mix planner is not available yet: {planner.unavailable_reason()}")
    if (want := st.session_state.pop(MODEL_REQUEST_KEY, None)) is not None:
        st.session_state["pl_model"] = want
    if (setup := st.session_state.pop(SETUP_REQUEST_KEY, None)) is not None:    # before the widgets it sets
        st.session_state[SETUP_KEY] = setup
        st.session_state.update(pl_model=setup["model"], pl_workload=setup["workload"], pl_emul=True,
                                pl_kv=setup["kv"], pl_tacc=setup["trainer"], pl_tgpus=setup["trainer_gpus"],
                                pl_cal=setup["calibration"])
    with st.container(border=True):
        st.markdown("**Model and workload**")
        mw = _model_and_workload()
    with st.container(border=True):
        st.markdown("**Accelerator pool**")
        price_table, pool, kv, emulated = _pool_editor()
    with st.container(border=True):
        st.markdown("**Constraints**")
        cons = _constraints()
        st.markdown("**Sandboxes**")
        sandboxes = _sandboxes()
        st.markdown("**Trainer and twin check**")
        trainer = _trainer()
        cals = calibration_files()
        asked = st.session_state.pop(CALIBRATION_REQUEST_KEY, None)   # "Plan with this calibration" (Runs page)
        if asked in cals:
            st.session_state["pl_cal"] = asked
        calibration = st.selectbox(
            "calibration", ["none (cost-model priors)", *cals], index=0, key="pl_cal",
            help="A calibration file (mixfleet calibrate): its fitted values replace the priors for the "
                 "groups and trainer it covers.") if cals else None
        if calibration and calibration.startswith("none"):
            calibration = None
        if asked in cals and calibration == asked:
            st.success(f"Planning with the calibration fitted on the Runs page: `{asked}`. Press **Run planner**.")
        cal_what = (_calibration_notice(calibration, mw[0] if mw else "", pool, kv, trainer["trainer_accelerator"])
                    if calibration else "")
        c1, c2 = st.columns(2)
        backend = c1.selectbox("cost backend", ["roofline", "auto"], index=["roofline", "auto"].index(DEFAULTS.backend),
                               key="pl_backend",
                               help="**auto**: replica step times from NVIDIA aiconfigurator-core's measured tables "
                                    "where they cover the group (the chosen-mix table says which priced it), else "
                                    "the roofline.")
        layouts = c2.selectbox("replica layouts", ["smallest", "cheapest"],
                               index=["smallest", "cheapest"].index(DEFAULTS.layouts), key="pl_layouts",
                               help="**cheapest**: each group's layout (TP 1-8, attention DP + expert parallel for "
                                    "MoE) with the lowest cost per token; **smallest**: the smallest TP that fits.")
    if mw is None or pool is None:
        return
    from mixfleet.ui import app_plan_result as result

    inputs = {"model": mw[0], "workload": mw[1], "price_table": price_table, "kv_dtypes": kv, **cons,
              **trainer, "emulated": emulated, "calibration": calibration, "backend": backend, "layouts": layouts,
              **sandboxes}
    cols = pool[["use", "accelerator", "max_gpus", "usd_per_gpu_hour", "precisions"]]
    cols = cols.assign(precisions=[",".join(planner.precision_list(v)) for v in cols["precisions"]])
    go = st.button("Run planner", type="primary", key="pl_go", disabled=not planner.available())
    clicked = time.perf_counter()
    key = result.inputs_key(inputs, cols)
    if go:
        bar = st.progress(0.0, text="planning...")
        try:
            view = _plan_cached(inputs, cols, _bar_progress(bar))
        except Exception as e:
            bar.empty()
            show_error("the planner could not plan", e)
            return
        bar.empty()
        st.session_state[RESULT_KEY] = view
        st.session_state[PLANNED_CAL_KEY] = (calibration, cal_what) if calibration else None
        st.session_state[PLAN_PAGE_KEY] = view.plan
        result.remember(key, inputs, cols)
    view = st.session_state.get(RESULT_KEY)
    if view is None:
        return
    result.show_inputs(key, inputs, cols)   # marked stale when they changed
    chart = _show(view)
    if go:   # the plan is on the page (Streamlit sends each element as it is drawn): how long that took
        st.session_state[TIMING_KEY] = {"plan_shown_s": time.perf_counter() - clicked}
    if view.pending_twin:   # the seed fleets' twin dry runs, after the plan is shown; their circles join the chart
        bar = st.progress(0.0, text="twin: the seed's fleets...")
        view = planner.finish_twin_points(view, _bar_progress(bar))
        bar.empty()
        st.session_state[RESULT_KEY] = view
        if go:
            _cache_put(key, view)
            st.session_state[TIMING_KEY]["complete_s"] = time.perf_counter() - clicked
        _chart(chart, view)


if __name__ == "__main__":
    render()
