"""Real runs on the repository task, read back: reward, tool use and sandbox seconds per update, held-out success.

The runs are started by hand (each update is minutes of CPU here), e.g.

    mixfleet pretrain --task repo --json > benchmarks/results/repo_base.json     # the base, its held-out success
    mixfleet run data/plans/repo-cpu.toml --out runs/repo --updates 4
    mixfleet run data/plans/repo-cpu.toml --task-set data/tasksets/example --out runs/repo-taskset --updates 2

This script only reads their run logs and writes benchmarks/results/repo_runs.json:

    python benchmarks/repo_runs.py --run generated:runs/repo --run example-task-set:runs/repo-taskset

Per run: the plan, its task options, status and updates; per update the batch's mean reward, its trajectories'
seconds in their tools (sandbox start, commands, the tests on submit: the run log's `tool_s`), the mean tool calls
per episode, the share of episodes that ended for calling no tool (`no_tool_call_3x`, the seed's collapse sign) and
that called none at all; the held-out evaluations the run made (`eval` events) if any.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "repo_runs.json"
WINDOW = 10       # updates per window of the reward curve (a single update's 16 episodes are too noisy to read)


def reward_windows(tr: Any, window: int) -> list[dict[str, Any]]:
    """The training reward over consecutive windows of `window` updates: episodes, successes (a repo reward is 0 or
    1) and the 95 % Wilson interval. Episodes of one prompt group are not independent, so the interval is
    optimistic."""
    from repo_base import wilson

    out = []
    versions = sorted(int(v) for v in tr["trained_version"].unique())
    for i in range(0, len(versions), window):
        vs = versions[i:i + window]
        b = tr[tr["trained_version"].isin(vs)]
        k, n = int((b["reward"] >= 1.0).sum()), len(b)
        out.append({"versions": [vs[0], vs[-1]], "episodes": n, "solved": k, "success": k / n if n else None,
                    "success_95": list(wilson(k, n)) if n else None})
    return out


def read_repo_run(folder: Path) -> dict[str, Any]:
    """One repo run log as numbers; a clear error if the folder is no run log or its task is not `repo`."""
    from mixfleet.costmodel.jsonsafe import json_safe
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.records.trackers import eval_frame

    if (why := RunLog.not_a_run_log(folder)) is not None:
        raise SystemExit(f"{folder}: not a run log ({why}); start the run first")
    log = RunLog.open(folder)
    runner = log.header.get("runner", {})
    if runner.get("task") != "repo":
        raise SystemExit(f"{folder}: task {runner.get('task')!r}, not 'repo'")
    tr = log.trajectories
    tr = tr[tr["trained_version"] > 0]
    if "tool_s" not in tr or tr["tool_s"].isna().all():
        raise SystemExit(f"{folder}: its trajectories carry no tool_s (a log from before the run log recorded it)")
    rows = []
    for _, u in log.updates.drop_duplicates("version", keep="last").sort_values("version").iterrows():
        b = tr[tr["trained_version"] == u["version"]]
        rows.append({"version": int(u["version"]), "end_s": float(u["end_s"]), "reward_mean": float(u["reward_mean"]),
                     "trajectories": int(u["trajectories"]), "tool_s": float(u["tool_s"]),
                     "tool_s_per_episode": float(b["tool_s"].mean()) if len(b) else None,
                     "tool_calls_mean": float(b["tool_calls"].mean()) if len(b) else None,
                     "turns_mean": float(b["turns"].mean()) if len(b) else None,
                     "no_tool_call_end_share": float((b["finish_reason"] == "no_tool_call_3x").mean()) if len(b)
                     else None,
                     "no_call_at_all_share": float((b["tool_calls"] == 0).mean()) if len(b) else None})
    ev = eval_frame(log.events).sort_values("version")
    plan = log.header.get("plan", {})
    return json_safe({
        "run": str(folder), "plan": plan.get("name"), "status": log.header.get("status"),
        "task_options": (plan.get("embedded") or {}).get("task_options", {}), "updates": len(rows),
        "wall_s": log.header.get("wall_s"), "per_update": rows,
        "tool_s_per_update_mean": sum(r["tool_s"] for r in rows) / len(rows) if rows else None,
        "reward_mean_first": rows[0]["reward_mean"] if rows else None,
        "reward_mean_last": rows[-1]["reward_mean"] if rows else None,
        "reward_windows": reward_windows(tr, WINDOW),
        "evaluations": [{"version": int(r["version"]), "reward": float(r["reward"]), "problems": int(r["problems"])}
                        for _, r in ev.iterrows()]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="LABEL:DIR",
                    help="a label and a repo run's folder (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    runs = {}
    for item in args.run:
        label, sep, folder = item.partition(":")
        if not sep or not label or not folder:
            ap.error(f"--run {item!r}: allowed LABEL:DIR")
        runs[label] = read_repo_run(Path(folder))
        r = runs[label]
        wins = "; ".join(f"v{w['versions'][0]}-{w['versions'][1]} {w['solved']}/{w['episodes']} "
                         f"[{w['success_95'][0]:.3f}, {w['success_95'][1]:.3f}]" for w in r["reward_windows"])
        print(f"{label}: {r['plan']} {r['status']}, {r['updates']} updates, training reward per {WINDOW} updates: "
              f"{wins}; held out {[e['reward'] for e in r['evaluations']]}; tool s per update "
              f"{r['tool_s_per_update_mean']:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": "real runs on the repo task, read from their run logs",
                                    "command": "python benchmarks/repo_runs.py " + " ".join(
                                        f"--run {a}" for a in args.run), "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
