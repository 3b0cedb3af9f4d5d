"""Shared pieces of the Streamlit app: settings from the environment, cached calls into costmodel /
policies / twin, run-log loading, number formatting with units, and error display.

The app computes nothing itself: plans are validated by `mixfleet.policies.plan`, dry runs come
from `mixfleet.twin.sim.simulate`, summaries from `mixfleet.costmodel.records.runsummary`. What lives here
is plumbing: caching, file handling and turning exceptions into messages.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
import tomli_w

RUNS_DIR_ENV = "MIXFLEET_RUNS_DIR"          # set by `mixfleet ui --runs-dir`
CALIBRATION_ENV = "MIXFLEET_CALIBRATION"  # set by `mixfleet ui --calibration`
UPDATES_ENV = "MIXFLEET_UI_UPDATES"         # default N updates of a dry run (tests use a small one)
WORKLOAD_ENV = "MIXFLEET_UI_WORKLOAD"       # default workload override of a dry run ("" = the plan's)
DEFAULT_UPDATES = 5
DEFAULT_PLAN = "seed-mixed"
REFERENCE_PLANS = ("seed-mixed", "seed-homogeneous")
REFRESH_EVERY_S = 5.0                       # Runs page: auto-refresh period while a run is going
EXTREME_RANGE = "[0.2, 5]"                  # sampler/trainer probability ratio range counted as not extreme
NONE = "—"


# ---- settings -------------------------------------------------------------------------------------
def runs_dir() -> Path:
    """Folder of run logs (twin and real): $MIXFLEET_RUNS_DIR, else ./runs."""
    return Path(os.environ.get(RUNS_DIR_ENV) or "runs").resolve()


def calibration_files() -> list[str]:
    """Calibration TOMLs to offer: $MIXFLEET_CALIBRATION first, then *calibration*.toml under the runs dir."""
    out = []
    env = os.environ.get(CALIBRATION_ENV, "")
    if env:
        out.append(str(Path(env).resolve()))
    root = runs_dir()
    if root.is_dir():
        out += sorted(str(p) for p in root.rglob("*calibration*.toml") if str(p) not in out)
    return out


def default_updates() -> int:
    """Default N updates for a dry run: $MIXFLEET_UI_UPDATES (tests) or DEFAULT_UPDATES."""
    try:
        n = int(os.environ.get(UPDATES_ENV, DEFAULT_UPDATES))
    except ValueError:
        n = DEFAULT_UPDATES
    return max(1, n)


def default_workload_override() -> str:
    """Default workload override of a dry run ("" = keep the plan's)."""
    return os.environ.get(WORKLOAD_ENV, "")


# ---- formatting -----------------------------------------------------------------------------------
def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def fmt_usd(x: Any, digits: int = 2) -> str:
    """Dollars with `digits` decimals; an amount below one unit of the last decimal in two significant digits
    ("$0.0035", not "$0.00": issue 44, a tiny CPU run's cost per update read $0.00 beside $0.00351)."""
    if not _finite(x):
        return NONE
    if x != 0 and abs(x) < 10.0 ** -digits:
        return f"{'-' if x < 0 else ''}${abs(x):.2g}"
    return f"${x:,.{digits}f}"


def fmt_s(x: Any, like: Any = None) -> str:
    """Seconds, with minutes / hours when long; in `like`'s unit when given (an interval or a difference beside
    its value: "5.7 min ± 0.4 min", not "5.7 min ± 26.41 s")."""
    if not _finite(x):
        return NONE
    ref = abs(like) if _finite(like) else abs(x)
    if ref >= 3600:
        return f"{x / 3600:,.2f} h"
    if ref >= 120:
        return f"{x / 60:,.1f} min" if abs(x) >= 6 or x == 0 else f"{x / 60:,.2f} min"
    return f"{x:,.2f} s"


def fmt_pct(x: Any, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f} %" if _finite(x) else NONE


def fmt_num(x: Any, unit: str = "", digits: int = 0) -> str:
    if not _finite(x):
        return NONE
    s = f"{x:,.{digits}f}"
    return f"{s} {unit}" if unit else s


def fmt_versions(x: Any) -> str:
    return f"{x:.2f}" if _finite(x) else NONE


def fmt_compact(x: Any, unit: str = "") -> str:
    """1234567 -> '1.23 M' (k, M, G), for metric tiles."""
    if not _finite(x):
        return NONE
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {suffix}{unit}"
    return f"{x:.3g} {unit}".strip()


def fmt_table(x: Any, signed: bool = False) -> str:
    """A number in a table as the metric cards write it: 32130 -> '32.1 k' (was '3.213e+04'), 0.01234 -> '0.01234',
    1.5e-05 -> '1.5e-05'; a dash for a missing value (issue 26)."""
    if not _finite(x):
        return NONE
    sign = "+" if signed and x > 0 else ""
    if abs(x) >= 1e4:
        return sign + fmt_compact(x)
    return sign + f"{x:,.4g}"


# ---- errors ---------------------------------------------------------------------------------------
def error_text(e: BaseException) -> str:
    """One line for the page: the message (SpecError already names the field and the allowed values); the
    exception's class only when it has no message (issue 26: errors started with Python class names)."""
    return str(e) or type(e).__name__


def show_error(prefix: str, e: BaseException) -> None:
    """The message on the page; which exception it was in an expander below it (for a bug report)."""
    st.error(f"{prefix}: {error_text(e)}")
    with st.expander("Details", expanded=False):
        st.code(f"{type(e).__module__}.{type(e).__qualname__}: {e}", language=None)


# ---- plans ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanText:
    """A validated plan as TOML text (hashable, cache-friendly) plus its name."""
    name: str
    toml: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.toml.encode()).hexdigest()[:10]


def known_plans() -> list[str]:
    from mixfleet.policies.plan import known_plans as _known

    return _known()


@st.cache_data(show_spinner=False)
def shipped_plan(name: str) -> PlanText:
    """A shipped plan (data/plans) as complete TOML (base resolved)."""
    from mixfleet.policies.plan import load_plan

    plan = load_plan(name)
    return PlanText(plan.name, tomli_w.dumps(plan.to_dict()))


def plan_from_upload(data: bytes, filename: str = "upload.toml") -> PlanText:
    """Validate an uploaded plan file; raises SpecError (or ValueError for bad bytes) with a clear message."""
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.policies.plan import load_plan

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(filename, "<file>", "binary data", "a UTF-8 TOML plan file") from None
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(filename, "<file>", "not TOML", f"valid TOML ({e})") from None
    with tempfile.TemporaryDirectory(prefix="mixfleet-ui-") as d:
        p = Path(d) / "plan.toml"
        p.write_text(text)
        plan = load_plan(p)
    return PlanText(plan.name, tomli_w.dumps(plan.to_dict()))


def plan_object(pt: PlanText) -> Any:
    from mixfleet.policies.plan import plan_from_dict

    return plan_from_dict(tomllib.loads(pt.toml))


def with_workload(pt: PlanText, workload: str) -> PlanText:
    """The plan on another workload (its batch size follows the workload's prompts per update)."""
    if not workload or plan_object(pt).workload == workload:
        return pt
    from mixfleet.costmodel.specs.workload import load_workload
    from mixfleet.policies.plan import with_overrides

    w = load_workload(workload)
    plan = with_overrides(plan_object(pt), {
        "workload": workload, "policies.batcher.prompts_per_update": w.prompts_per_update,
        "policies.batcher.samples_per_prompt": w.samples_per_prompt,
        "policies.batcher.inflight_prompts": 4 * w.prompts_per_update})
    return PlanText(plan.name, tomli_w.dumps(plan.to_dict()))


def known_workloads() -> list[str]:
    from mixfleet.costmodel.specs.workload import known_workloads as _known

    return _known()


# ---- dry runs (the twin) -------------------------------------------------------------------------
def twin_run_dir(pt: PlanText, updates: int, seed: int, calibration: str | None = None,
                 warm_start: bool = False) -> Path:
    """Where the app keeps a dry run of this exact plan text, N, seed (calibration, warm start) under the runs dir."""
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in pt.name)[:40]
    cal = ""
    if calibration:
        cal = "-cal-" + hashlib.sha256(Path(calibration).read_bytes()).hexdigest()[:8]
    return runs_dir() / "twin" / f"{safe}-{pt.digest}-n{updates}-s{seed}{cal}{'-warm' if warm_start else ''}"


def finished_dry_run(pt: PlanText, updates: int, seed: int, calibration: str | None = None,
                     warm_start: bool = False) -> Path | None:
    """The folder of a finished identical dry run under the runs dir, if there is one."""
    import json

    out = twin_run_dir(pt, updates, seed, calibration, warm_start)
    try:
        return out if json.loads((out / "run.json").read_text()).get("status") == "finished" else None
    except (OSError, ValueError):
        return None


def dry_run(pt: PlanText, updates: int, seed: int, progress: Callable[[int], None] | None = None,
            calibration: str | None = None, warm_start: bool = False) -> Path:
    """Simulate the plan with the twin (calibrated when a calibration file is given; from a warm start when
    asked) into the runs dir, or reuse a finished identical dry run there."""
    done = finished_dry_run(pt, updates, seed, calibration, warm_start)
    if done is not None:
        return done
    out = twin_run_dir(pt, updates, seed, calibration, warm_start)
    from mixfleet.costmodel.records.outdir import prepare_output_dir

    prepare_output_dir(out, "twin_runlog", where="Dry-run page", force=True)   # an unfinished dry run, never more
    out.parent.mkdir(parents=True, exist_ok=True)
    if calibration:
        from mixfleet.twin.calibrated import simulate_calibrated

        simulate_calibrated(plan_object(pt), calibration, updates=updates, seed=seed, out=out, progress=progress,
                            warm_start=warm_start)
    else:
        from mixfleet.twin.sim import simulate

        simulate(plan_object(pt), updates=updates, seed=seed, out=out, progress=progress, warm_start=warm_start)
    return out


# ---- run logs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunData:
    """One run log read into frames, with its summary (a plain dict from runsummary)."""
    path: str
    header: dict[str, Any]
    updates: pd.DataFrame
    groups: pd.DataFrame
    events: pd.DataFrame
    trajectories: pd.DataFrame
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        return run_label(self.path, self.header)


def run_name(path: str | Path) -> str:
    """A run's name: a run the app started lives in RUNS/<name>/run (its name, not "run")."""
    from mixfleet.costmodel.records.trackers import run_log_name

    return run_log_name(Path(path))


def run_label(path: str | Path, header: dict[str, Any]) -> str:
    plan = (header.get("plan") or {}).get("name", "?")
    return f"{run_name(path)} · {header.get('source', '?')} · {plan} · {header.get('status', '?')}"


FIDELITY_OF = "fidelity_of.json"   # in a fidelity check's twin log: {"run": the checked run log's path}


def fidelity_log_dir(run: Path, tag: str) -> Path:
    """Where the fidelity check of `run` keeps its twin log: named after the run's path under the runs folder,
    so two managed runs (both RUNS/<name>/run) never share one (issue 26)."""
    try:
        rel = run.resolve().relative_to(runs_dir().resolve())
        name = "_".join(rel.parts[:-1] if rel.name == "run" and len(rel.parts) > 1 else rel.parts) or run.name
    except ValueError:
        name = run_name(run)
    return runs_dir() / "twin" / f"fidelity-{name}-{tag}"


def fidelity_of(twin_log: Path) -> str | None:
    """The run log a fidelity check's twin log was made for ("" for an older fidelity log that does not say;
    None for a twin log that is not a fidelity check's)."""
    import json

    f = twin_log / FIDELITY_OF
    if f.is_file():
        try:
            return str(json.loads(f.read_text()).get("run", ""))
        except (OSError, ValueError, AttributeError):
            return ""
    return "" if twin_log.name.startswith("fidelity-") else None


def _stamp(path: Path) -> tuple[float, int]:
    """Changes whenever a part file or the header is written (cache key for a live run)."""
    newest, count = 0.0, 0
    for p in path.rglob("*"):
        if p.is_file():
            count += 1
            newest = max(newest, p.stat().st_mtime)
    return newest, count


@st.cache_data(show_spinner=False, max_entries=32)
def _load_run(path: str, stamp: tuple[float, int]) -> RunData:
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.records.runsummary import summarize

    log = RunLog.open(path)
    return RunData(path=path, header=dict(log.header), updates=log.updates, groups=log.groups, events=log.events,
                   trajectories=log.trajectories, summary=summarize(log).to_dict())


def load_run(path: str | Path) -> RunData:
    """Read a run log (cached until any of its files changes)."""
    p = Path(path).resolve()
    return _load_run(str(p), _stamp(p))


def find_runs(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Run logs under `root` with their headers, newest first."""
    import json

    from mixfleet.costmodel.records.runlog import HEADER_FILE, RunLog

    if not root.is_dir():
        return []
    out = []
    for p in RunLog.find(root):
        try:
            header = json.loads((p / HEADER_FILE).read_text())
        except (OSError, ValueError):
            continue
        out.append((p, header))
    out.sort(key=lambda x: (str(x[1].get("created_utc", "")), str(x[0])), reverse=True)
    return out


def twin_predictions_for(header: dict[str, Any], root: Path, exclude: Path | None = None) -> list[Path]:
    """Twin run logs under `root` for the same plan as `header`: the fidelity checks of the run `exclude` first
    (another run's fidelity log is never offered), then the same groups, then the same name."""
    from mixfleet.twin.calibrated import rehearsal_not_modelled

    plan = header.get("plan") or {}
    name = plan.get("name")
    if rehearsal_not_modelled(header):      # the twin of a GPU plan is not a prediction of its CPU rehearsal
        return []

    def groups_key(p: dict[str, Any]) -> list[tuple[Any, ...]]:
        return sorted((g.get("name"), g.get("accelerator"), g.get("precision"), g.get("replicas"))
                      for g in p.get("groups", []))

    own, exact, same_name = [], [], []
    for p, h in find_runs(root):
        if h.get("source") != "twin" or (exclude is not None and p.resolve() == exclude.resolve()):
            continue
        hp = h.get("plan") or {}
        if hp.get("name") != name or (hp.get("model"), hp.get("workload")) != (plan.get("model"), plan.get("workload")):
            continue                # another model or workload under the same name is not this run's prediction
        of = fidelity_of(p)
        if of is not None:          # a fidelity check's twin log: the prediction of the run it checked only
            if exclude is not None and of and Path(of).resolve() == exclude.resolve():
                own.append(p)
            continue
        (exact if groups_key(hp) == groups_key(plan) else same_name).append(p)
    return own + exact + same_name

# the pages' input widgets whose values outlive a page switch (Streamlit drops a widget's state once a run does
# not draw it: the Plan page's inputs and the Dry-run page's plan choices were reset, issue 44); buttons, uploads,
# data editors and charts cannot be set through session state and are not listed
KEPT_INPUTS = re.compile(r"^(pl_(model|workload|[psc]_.+|mt_.+|wt_.+|prices|kv|emul|tacc|tgpus|tn|refs|stale|tpu|"
                         r"budget|obj|cal|backend|layouts)|[ab]_(src|name)|dr_(two|n|seed|w|cal))$")


def keep_inputs() -> None:
    """Re-set every kept input's value (KEPT_INPUTS) at the start of each run of the app, so the widget keeps it
    while its page is not shown (Streamlit's documented way to keep widget values across pages)."""
    for k in list(st.session_state.keys()):
        if isinstance(k, str) and KEPT_INPUTS.match(k):
            st.session_state[k] = st.session_state[k]
