"""Resume: what a kill left in the run folder, checked and put right before anything starts (`prepare_resume`).

A resumed run continues from its trainer checkpoint (`ResumePoint`): the plan must be the one the run log
recorded (or differ only in run settings taken with `take_new_settings`), a trainer state set aside by a killed
replace is put back, unfinished temp folders are removed, and the orchestrator's state comes from the checkpoint's
orchestrator.json (or is rebuilt from the run log). The checkpoint itself is written by the update loop
(runner/orchestration/orchestrator.py `_checkpoint`, staged in `staging_dir`).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.outdir import STAGING_SUFFIX, is_our_temp
from mixfleet.costmodel.records.runlog import RunLog, plan_changes
from mixfleet.policies.plan import Plan, plan_from_dict
from mixfleet.runner.checkpoint.hf_checkpoint import recover_replaced_dir, remove_leftovers
from mixfleet.runner.orchestration.config import ORCH_STATE_FILE, STATE_DIR


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues (`prepare_resume`)."""

    version: int                          # the trainer version it continues from (0: the base policy)
    from_state: bool                      # a trainer state to load (False: nothing was checkpointed yet)
    state: dict[str, Any]                 # the orchestrator's checkpoint (orchestrator.json), or rebuilt from the log
    plan: dict[str, Any]                  # the plan as the run log recorded it
    notes: tuple[str, ...] = ()           # what was recovered or cleaned up
    new_settings: dict[str, list[Any]] = field(default_factory=dict)   # taken: {"embedded.lr": [saved, new]}


def staging_dir(state_dir: Path) -> Path:
    """Where `_checkpoint` puts a checkpoint together before it replaces `state_dir`."""
    return state_dir.with_name(f".{state_dir.name}{STAGING_SUFFIX}")


def _state_complete(d: Path) -> bool:
    return (d / "trainer_meta.json").is_file() and (d / "trainer_state.pt").is_file()


def _staged_complete(d: Path) -> bool:
    return _state_complete(d) and (d / ORCH_STATE_FILE).is_file()


def _recover_state_dir(state_dir: Path, *, apply: bool = True) -> tuple[Path, list[str]]:
    """Put back a trainer state that a kill between `replace_dir_atomically`'s renames set aside (or a complete
    staged checkpoint the kill kept from its rename), then delete the unfinished temp folders of the trainer
    state and of the staging folder (mixfleet's own names holding only trainer-state files). Returns where the
    state is (`state_dir`, or with `apply=False` the folder it would be restored from) and what was done."""
    notes = []
    staged = staging_dir(state_dir)
    try:
        src = recover_replaced_dir(state_dir, complete=_state_complete, fallback=staged, dry_run=not apply)
    except ValueError as e:
        raise SpecError("mixfleet run --resume", "--out", str(state_dir.parent), f"one trainer state ({e})") from None
    if src is not None:
        notes.append(f"restored {state_dir.name} from {src.name}")
        if not apply:
            return src, notes
    if apply and state_dir.is_dir():
        removed = remove_leftovers(state_dir, may_remove=is_our_temp)
        removed += remove_leftovers(staged, may_remove=is_our_temp)
        if staged.is_dir() and is_our_temp(staged):
            shutil.rmtree(staged)
            removed.append(staged.name)
        if removed:
            notes.append("removed unfinished " + ", ".join(sorted(removed)))
    return state_dir, notes


def _read_json_file(path: Path, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SpecError(str(path), "<file>", f"{type(e).__name__}: {e}", f"{what}, as JSON; the file is unreadable "
                        "or not valid JSON (cut or edited?): restore it, or start over with --force") from None
    if not isinstance(raw, dict):
        raise SpecError(str(path), "<file>", type(raw).__name__, f"{what}, as a JSON object")
    return raw


_ORCH_INTS = ("version", "started_prompts", "taken_prompts", "restarts", "trained_restarted")
_ORCH_FLOATS = ("elapsed_s", "trainer_busy_s")


def _check_orch_state(st: dict[str, Any], path: Path) -> dict[str, Any]:
    for k in _ORCH_INTS:
        if k in st and (isinstance(st[k], bool) or not isinstance(st[k], int) or st[k] < 0):
            raise SpecError(str(path), k, st[k], "an integer >= 0 (the file is not the orchestrator state "
                                                 "mixfleet wrote: restore it, or start over with --force)")
    for k in _ORCH_FLOATS:
        if k in st and (isinstance(st[k], bool) or not isinstance(st[k], int | float) or not math.isfinite(st[k])
                        or st[k] < 0):
            raise SpecError(str(path), k, st[k], "seconds >= 0 (the file is not the orchestrator state mixfleet "
                                                 "wrote: restore it, or start over with --force)")
    for k in ("cost_usd_by_group", "fresh_kl"):
        if k in st and not isinstance(st[k], dict):
            raise SpecError(str(path), k, st[k], "a JSON object of groups")
    return st


def _state_from_log(log: RunLog, version: int) -> dict[str, Any]:
    """An orchestrator state rebuilt from the run log, for a checkpoint without one (nothing checkpointed yet,
    or a trainer state written before orchestrator.json went into the same folder): prompt ids continue after
    the log's highest, the run clock after its last record, costs and trainer seconds as logged up to
    `version`. What the log does not hold (restarts, the on-policy KL sums) starts again from 0."""
    tr, up, gr, ev = log.trajectories, log.updates, log.groups, log.events
    ids = pd.to_numeric(tr["prompt_id"], errors="coerce").dropna() if len(tr) else pd.Series([], dtype=float)
    trained = tr[(tr["trained_version"] > 0) & (tr["trained_version"] <= version)] if len(tr) else tr
    ends = [float(x.max()) for x in (tr["end_s"], up["end_s"], ev["time_s"]) if len(x)]
    up_v = up[up["version"] <= version]
    gr_v = gr[gr["version"] <= version]
    return {"version": version, "started_prompts": int(ids.max()) + 1 if len(ids) else 0,
            "taken_prompts": int(trained["prompt_id"].nunique()) if len(trained) else 0,
            "elapsed_s": max([0.0, *ends]), "trainer_busy_s": float(up_v["train_step_s"].sum()),
            "cost_usd_by_group": {str(g): float(c) for g, c in gr_v.groupby("group")["cost_usd"].sum().items()},
            "trained_restarted": int((trained["restarts"] > 0).sum()) if len(trained) else 0}


# the run settings a resumed run may take from a changed plan (`take_new_settings`): the plan's [embedded] table
# but the base policy's pretraining and the fleet's scale-down (they would make another run)
NOT_TAKEN = ("embedded.base_steps", "embedded.max_replicas_per_group")


def takeable(key: str) -> bool:
    """A plan field a resume may take with `take_new_settings` (a run setting, `NOT_TAKEN` aside)."""
    return key.startswith("embedded.") and not key.startswith(NOT_TAKEN)


def prepare_resume(out: Path, plan: Plan, *, where: str = "mixfleet run --resume",
                   apply: bool = True, take_new_settings: bool = False) -> ResumePoint | None:
    """Check that the run in `out` can continue with `plan`, and put right what a kill left (under the run
    folder's lock): None when there is no run log yet (a new run). Refused (SpecError, nothing changed):

    - a different plan than the log's (the resolved plans are compared, not the file names), naming each
      differing field with the saved and the given value; with `take_new_settings` differing run settings
      (embedded.*, `takeable`) are taken instead and returned in `new_settings` (the resume event logs them);
    - a trainer state that is gone while the log holds updates after update 1 (their rows came from it: they
      cannot be continued); a state set aside by a killed replace (`.trainer_state.old.<pid>`) is put back;
    - a trainer_meta.json or orchestrator.json that is unreadable, not JSON or of the wrong types (named).

    The log is rolled back to the checkpoint: a run log without a trainer state whose updates are none or
    update 1 only (killed, or out of space, before its first checkpoint completed) continues from the base
    policy in the same log, update 1's rows rolled back by the run (`truncate_after_version`), as a later
    update's rows are after the checkpoint of the update before it. `apply=False` changes nothing (a check before the
    run starts: the run's own call then recovers and records it in its resume event)."""
    out = Path(out)
    state_dir = out / STATE_DIR
    if not (out / "run.json").exists():
        if state_dir.exists() or any(out.glob(f".{STATE_DIR}.old.*")):
            raise SpecError(where, "--out", str(out), "a run folder with its run log; it has a trainer state but no "
                                                      "run.json: restore run.json, or choose another folder")
        return None
    log = RunLog.open(out)
    recorded = log.header.get("plan")
    try:
        normal = plan_from_dict(dict(recorded)).to_dict() if isinstance(recorded, dict) else recorded
    except (SpecError, TypeError, ValueError):
        normal = recorded                          # a plan of an older schema: compared as recorded
    changes = plan_changes(normal, plan.to_dict())
    refused = {k: v for k, v in changes.items() if not (take_new_settings and takeable(k))}
    if refused:
        name = recorded.get("name") if isinstance(recorded, dict) else None
        diff = [f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in refused.items()]
        more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
        take = "" if take_new_settings or not all(takeable(k) for k in refused) else \
            ", or take the new settings with --take-new-settings (take_new_settings=True; the run log records them)"
        first = next(iter(refused))
        raise SpecError(where, first, refused[first][1], f"the saved run's value (the run in {out} was started "
                        f"with plan {name!r}, as its run.json records it; this plan differs in {len(diff)} field(s): "
                        f"{'; '.join(diff[:6])}{more}). Resume with the same plan and settings{take}, or start a new "
                        "run (another --out, or --force to replace this one)")
    new_settings = {k: v for k, v in changes.items() if k not in refused}
    found, notes = _recover_state_dir(state_dir, apply=apply)
    up = log.updates
    if not _state_complete(found):
        if len(up) and int(up["version"].max()) > 1:
            n_tr = int((log.trajectories["trained_version"] > 0).sum())
            raise SpecError(where, "--out", str(out), f"a run whose trainer state is there to continue from; "
                            f"{state_dir} is {'incomplete' if state_dir.exists() else 'missing'} (and no old copy is "
                            f"beside it), but the run log holds updates {int(up['version'].min())}.."
                            f"{int(up['version'].max())} ({n_tr} trained trajectories) that came from it, so they "
                            "cannot be continued; nothing was changed. Put the trainer_state folder back, or start "
                            "over with --force (replaces this run) or another --out")
        if len(up):           # update 1 logged, its checkpoint never completed (a kill, a full disk): rolled back
            notes.append("update 1's checkpoint was never completed: its rows are rolled back")
        return ResumePoint(version=0, from_state=False, state=_state_from_log(log, 0), plan=dict(recorded or {}),
                           notes=(*notes, "no checkpoint yet: continues from the base policy"),
                           new_settings=new_settings)
    meta = _read_json_file(found / "trainer_meta.json", "the trainer's checkpoint metadata")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SpecError(str(found / "trainer_meta.json"), "version", version, "an integer >= 0")
    orch_path = found / ORCH_STATE_FILE
    if orch_path.exists():
        st = _check_orch_state(_read_json_file(orch_path, "the orchestrator's checkpoint"), orch_path)
        if st.get("version", version) != version:
            raise SpecError(str(orch_path), "version", st.get("version"), f"{version}, the version of the trainer "
                            "state beside it (these files are not one checkpoint: restore them, or start over "
                            "with --force)")
    else:
        st = _state_from_log(log, version)
        notes.append(f"no {ORCH_STATE_FILE}: prompt ids, clock and costs rebuilt from the run log")
    return ResumePoint(version=version, from_state=True, state=st, plan=dict(recorded or {}), notes=tuple(notes),
                       new_settings=new_settings)
