"""A studies run of a `replan` plan starts and re-plans (issue 43 item 1).

The re-planner's solver lives in planner/ (below the twin and the runner), and the runner's orchestrator attaches
it itself (`planner.solver.solver_for`). Before, only `mixfleet run` handed the runner the twin's solver, and a
study's child run (`studies.runs.run_child`) of a `replan` plan was refused at its start. Here a study of one real
CPU run (tiny model, one embedded sampler, 4 updates of 2 x 2 trajectories: the re-planner's first decision is due
after warm-up 0 + window 2 + a prompt-group's life of 2 updates) finishes and its run log holds `replan` events.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.studies.runs import StudyRun, StudySettings, run_study
from runplans import CPU_BF16, run_files, run_plan_toml

UPDATES = 4
PLAN = run_plan_toml(
    "studies-replan", [{**CPU_BF16, "replicas": 1, "min_replicas": 1, "max_replicas": 1}],
    embedded={"max_turns": 2, "max_new_tokens": 8},
    batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 2, "max_staleness": 0,
             "stale": "wait"},
    autoscaler={"name": "replan", "warmup_updates": 0, "window_updates": 2, "check_every_updates": 1,
                "every_updates": 1})


@pytest.mark.slow
def test_a_study_run_of_a_replan_plan_starts_and_logs_its_decisions(tmp_path: Path) -> None:
    init, plan_path = run_files(tmp_path, PLAN)
    run = StudyRun(name="replan", out_dir=tmp_path / "replan", plan=str(plan_path),
                   run={"updates": UPDATES})
    lines: list[str] = []
    manifest = run_study([run], manifest_path=tmp_path / "study.json", manifest_extra={}, base_policy=str(init),
                         settings=StudySettings(start_gap_s=0.0, retries=0, run_timeout_s=600.0), log=lines.append)
    entry = manifest["runs"]["replan"]
    driver_log = (tmp_path / "replan" / "driver.log")
    assert entry["status"] == "finished", (entry, "\n".join(lines),
                                           driver_log.read_text()[-4000:] if driver_log.exists() else "")
    log = RunLog.open(tmp_path / "replan")
    assert len(log.updates) == UPDATES
    replans = [json.loads(d) if isinstance(d, str) else d for d in log.events.loc[log.events["kind"] == "replan",
                                                                                  "detail"]]
    assert replans, "the re-planner logged no decision"
    assert all(r["before"] == {"cpu-bf16": 1} == r["after"] for r in replans)   # one group, held at 1 replica
    solved = [r["predicted"] for r in replans if r.get("predicted")]
    assert solved, f"no decision came from the solver: {replans}"   # the planner's model priced the fleet
    assert all(p["now"] > 0 and p["time_per_update_now_s"] > 0 for p in solved)
