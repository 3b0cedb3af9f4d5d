"""The tool side of a real run, recorded and fitted (issue 42 item 3): the agent loop's per-reply tool seconds and
appended tokens, the task's sandbox measurements (starts, pool waits, command seconds) in the run log's
trajectories; `fit_workload` / `mixfleet calibrate --workload-out` on a synthetic run log whose command times,
sandbox starts, turns and tool outputs were drawn from known distributions recovers them within its intervals,
and the workload it writes loads as one `simulate` and `plan` take.
"""

from __future__ import annotations

import asyncio
import math
import types
from pathlib import Path

import numpy as np
import pytest
from mixfleet.costmodel.calibration.tool_fit import fit_lognormal, fit_workload
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import RunLog, RunLogWriter, TrajectoryRecord
from mixfleet.costmodel.specs.workload import load_workload, workload_from_dict
from mixfleet.runner.rollout.agent import run_episode
from mixfleet.runner.rollout.tasks import StepResult, Task, ToolCall
from test_agent import Reply, Scripted

# ---- the run log's per-episode lists ---------------------------------------------------------------------------


def _traj(i: int, **kw) -> TrajectoryRecord:
    base = dict(run_id="r", prompt_id=str(i), sample_index=0, group="g", replica=0, version_start=0, version_end=0,
                turns=2, prompt_tokens=50, generated_tokens=20, start_s=0.0, end_s=3.0, reward=1.0,
                finish_reason="done", tool_calls=2, tool_s=1.0)
    base.update(kw)
    return TrajectoryRecord(**base)


def test_trajectory_lists_round_trip_and_older_rows_read_none(tmp_path: Path) -> None:
    with RunLogWriter(tmp_path / "log", {"source": "runner"}) as w:
        w.append(_traj(0, turn_tool_s=[0.25, math.nan], turn_output_tokens=[12, 0], command_s=[0.2, 0.4],
                       sandbox_start_s=[0.05, 0.06], pool_wait_s=[0.0, 1.5]))
        w.append(_traj(1))                                  # a trajectory without them (the twin, older tasks)
    tr = RunLog.open(tmp_path / "log").trajectories
    a, b = tr.iloc[0], tr.iloc[1]
    assert a["turn_tool_s"][0] == 0.25 and math.isnan(a["turn_tool_s"][1])
    assert a["turn_output_tokens"] == [12, 0] and a["command_s"] == [0.2, 0.4]
    assert a["sandbox_start_s"] == [0.05, 0.06] and a["pool_wait_s"] == [0.0, 1.5]
    assert all(b[k] is None for k in TrajectoryRecord.LISTS)


@pytest.mark.parametrize(("kw", "field", "allowed"), [
    (dict(turn_tool_s=[0.1]), "turn_tool_s", "2 (turns)"),                 # one entry per reply
    (dict(command_s=[0.1, -1.0]), "command_s", "numbers >= 0"),
    (dict(pool_wait_s=[math.nan]), "pool_wait_s", "numbers >= 0"),         # NaN only for a reply without a call
    (dict(sandbox_start_s="fast"), "sandbox_start_s", "a list of numbers"),
])
def test_bad_lists_are_refused_naming_the_field(kw: dict, field: str, allowed: str) -> None:
    with pytest.raises(SpecError, match=field) as e:
        _traj(0, **kw)
    assert allowed in str(e.value)


# ---- the agent loop and the recorder --------------------------------------------------------------------------


class _Shell(Task):
    """`run CMD` takes 0.05 s and answers 'ok!' (3 bytes); `submit` ends the episode; metrics() like the repo task's."""
    name = "shell"
    tools = ("run", "submit")
    max_turns = 6

    def __init__(self) -> None:
        self.submitted = False

    @property
    def done(self) -> bool:
        return self.submitted

    def reset(self, seed: int) -> str:
        return "go"

    def step(self, call: ToolCall) -> StepResult:
        raise NotImplementedError

    async def astep(self, call: ToolCall) -> StepResult:
        if call.name == "submit":
            self.submitted = True
            return StepResult(output="bye", done=True)
        await asyncio.sleep(0.05)
        return StepResult(output="ok!")

    def reward(self) -> float:
        return 1.0

    def metrics(self) -> dict:
        return {"sandbox_start_s": [0.01, 0.02], "pool_wait_s": [0.0, 0.3], "command_s": [0.05, 0.04, 0.2],
                "commands": 3}


def test_episode_and_recorder_carry_each_calls_seconds_tokens_and_the_sandbox_measurements(tmp_path: Path) -> None:
    from mixfleet.runner.orchestration.recorder import RunRecorder
    from mixfleet.runner.orchestration.rollouts import Session

    gen = Scripted([Reply("<|call|>run ls<|endcall|>"), Reply("thinking<|eos|>"), Reply("<|call|>submit<|endcall|>")])
    ep = asyncio.run(run_episode(_Shell(), 0, gen, session_id="s1", clock=iter(range(100)).__next__))
    assert ep.finish_reason == "done" and ep.num_turns == 3
    assert 0.04 <= ep.turn_tool_s[0] < 1.0 and math.isnan(ep.turn_tool_s[1]) and 0 <= ep.turn_tool_s[2] < 0.04
    assert ep.turn_output_tokens[0] > len("ok!") and ep.turn_output_tokens[1] > 0 and ep.turn_output_tokens[2] > 0
    assert ep.env_metrics["command_s"] == [0.05, 0.04, 0.2]

    ctx = types.SimpleNamespace(out=tmp_path / "log", writer=None)
    rec = RunRecorder(ctx, ("g",), 1.0)
    rec.open({"source": "runner"})
    rec.write_trajectory(Session(sid=0, prompt_id=7, sample_index=0, session_id="s1", group="g", replica=0), ep, 1)
    ctx.writer.close()
    row = RunLog.open(tmp_path / "log").trajectories.iloc[0]
    assert row["turns"] == 3 and len(row["turn_tool_s"]) == 3 and row["turn_tool_s"][0] == ep.turn_tool_s[0]
    assert row["turn_output_tokens"] == ep.turn_output_tokens
    assert row["command_s"] == [0.05, 0.04, 0.2] and row["sandbox_start_s"] == [0.01, 0.02]
    assert row["pool_wait_s"] == [0.0, 0.3]


# ---- the fit ---------------------------------------------------------------------------------------------------

MU, SIGMA = math.log(0.8), 0.7          # the command seconds' lognormal
START_MU, START_SIGMA = math.log(0.05), 0.3
OUT_MU, OUT_SIGMA = math.log(40.0), 0.5


def _synthetic_log(path: Path, episodes: int, seed: int, noop_share: float = 0.0) -> dict:
    """A run log of `episodes` repo-like episodes drawn from known distributions; returns the truths."""
    rng = np.random.default_rng(seed)
    plan = {"name": "synth", "workload": "tiny-cpu", "policies": {"batcher": {"prompts_per_update": 4,
                                                                              "samples_per_prompt": 4}},
            "embedded": {"task": "repo", "task_options": {"max_turns": 10}}}
    turns_all = []
    with RunLogWriter(path, {"source": "runner", "plan": plan}) as w:
        for i in range(episodes):
            turns = int(rng.integers(2, 9))
            calls = np.exp(rng.normal(MU, SIGMA, turns))          # every reply calls a command
            calls[rng.random(turns) < noop_share] = 2e-5          # ... but these (a call that runs none)
            out = np.rint(np.exp(rng.normal(OUT_MU, OUT_SIGMA, turns))).astype(int)
            starts = np.exp(rng.normal(START_MU, START_SIGMA, 2))
            waits = [0.0, float(rng.exponential(0.5))]
            first = 100
            w.append(_traj(i, turns=turns, tool_calls=turns, turn_tool_s=calls.tolist(),
                           turn_output_tokens=out.tolist(), command_s=calls.tolist(),
                           sandbox_start_s=starts.tolist(), pool_wait_s=waits,
                           prompt_tokens=int(first + out.sum() + turns - 1), generated_tokens=30 * turns,
                           start_s=float(i), end_s=float(i) + float(calls.sum() + starts.sum() + sum(waits)) + 1.0,
                           reward=float(i % 3 == 0)))
            turns_all.append(turns)
    return {"turns_mean": float(np.mean(turns_all))}


def test_lognormal_fit_recovers_known_parameters_within_its_interval() -> None:
    """Over 40 synthetic runs (150 episodes of 1..7 commands each) the 95 % intervals of mu and sigma cover the
    truth about 95 % of the time (measured 0.95 / 0.97 over 100 seeds); a wrong truth is outside."""
    covered = {"mu": 0, "sigma": 0}
    for seed in range(40):
        rng = np.random.default_rng(seed)
        groups = [np.exp(rng.normal(MU, SIGMA, int(k))) for k in rng.integers(1, 8, 150)]
        f = fit_lognormal(groups, rng=np.random.default_rng(0), unit="s")
        covered["mu"] += f.mu.covers(MU)
        covered["sigma"] += f.sigma.covers(SIGMA)
        assert f.mu.hi - f.mu.lo < 0.3 and f.sigma.hi - f.sigma.lo < 0.2       # informative, not vacuous
        assert not f.mu.covers(MU + 0.3) and not f.sigma.covers(SIGMA * 1.5)
        assert f.median.value == pytest.approx(math.exp(f.mu.value))
    assert covered["mu"] >= 34 and covered["sigma"] >= 34, covered
    with pytest.raises(SpecError, match="values > 0"):
        fit_lognormal([[1.0, 0.0], [1.0, 2.0]], rng=np.random.default_rng(0), where="x")


def test_fit_workload_recovers_the_synthetic_runs_distributions(tmp_path: Path) -> None:
    truth = _synthetic_log(tmp_path / "run", 200, seed=1)
    fit = fit_workload([tmp_path / "run"], seed=0)
    lat, start, cmd = fit.fits["tool_latency_s"], fit.fits["sandbox_start_s"], fit.fits["command_s"]
    assert lat.mu.covers(MU) and lat.sigma.covers(SIGMA), lat.to_dict()
    assert cmd.mu.covers(MU) and cmd.sigma.covers(SIGMA), cmd.to_dict()
    assert start.mu.covers(START_MU) and start.sigma.covers(START_SIGMA), start.to_dict()
    out = fit.fits["tool_output_tokens"]
    assert abs(out.mu.value - OUT_MU) < 0.1 and abs(out.sigma.value - OUT_SIGMA) < 0.1   # rounded to integers
    assert fit.figures["turns_mean"].covers(truth["turns_mean"])
    assert fit.figures["success_prob"].covers(1 / 3) and fit.figures["no_tool_call_prob"].value == 0.0
    assert fit.fits["prompt_tokens"].median.value == pytest.approx(100, abs=1)   # first prompt recovered exactly
    assert fit.figures["pool_wait_share"].value > 0 and fit.pool["sandboxes"] == 400
    spec = fit.spec()
    assert spec.prompts_per_update == 4 and spec.samples_per_prompt == 4 and spec.max_context == 1024
    assert spec.tool_latency_s.kind == "lognormal" and spec.sandbox_start_s is not None
    assert spec.turns.mean == pytest.approx(truth["turns_mean"], rel=1e-6)


def test_calibrate_writes_a_workload_that_simulate_and_plan_load(tmp_path: Path) -> None:
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    _synthetic_log(tmp_path / "run", 40, seed=2)
    out = tmp_path / "measured.toml"
    wide = CliRunner(env={"COLUMNS": "200"})            # the table's field names unwrapped
    res = wide.invoke(app, ["calibrate", str(tmp_path / "run"), "--workload-out", str(out)])
    assert res.exit_code == 0, res.output
    assert "tool_latency_s" in res.output and "sandbox_start_s" in res.output and "command_s" in res.output
    spec = load_workload(out)                          # the loader `simulate --workload` and plans use
    assert spec.name == "synth-measured" and spec.sandbox_start_s is not None
    assert spec.tool_latency_s.kind == "lognormal"
    assert "# " in out.read_text().splitlines()[0]    # the intervals ride along as comments
    # a plan naming the written file as its workload loads and resolves it
    from mixfleet.policies.plan import load_plan

    plan_path = tmp_path / "p.toml"
    plan_path.write_text(f'base = "tiny-cpu"\nname = "p"\nworkload = "{out}"\n')
    plan = load_plan(plan_path)
    assert load_workload(plan.workload).name == "synth-measured"
    sim = CliRunner().invoke(app, ["simulate", str(plan_path), "--updates", "2", "--out", str(tmp_path / "sim")])
    assert sim.exit_code == 0, sim.output
    assert len(RunLog.open(tmp_path / "sim").updates) == 2
    # too little: a log without the per-reply lists is refused naming what is missing
    with RunLogWriter(tmp_path / "old", {"source": "runner"}) as w:
        w.append(_traj(0))
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path / "old"), "--workload-out", str(tmp_path / "x.toml")])
    assert res.exit_code != 0 and "turn_tool_s" in res.output and not (tmp_path / "x.toml").exists()


def test_values_that_are_not_one_lognormal_are_written_as_measured(tmp_path: Path) -> None:
    """Half the calls run no command (20 us), half a command (lognormal, median 0.8 s): the lognormal of all of
    them is far off their mean, so the workload takes the measured seconds (their mean kept), and says so."""
    _synthetic_log(tmp_path / "run", 100, seed=4, noop_share=0.5)
    fit = fit_workload([tmp_path / "run"], seed=0)
    lat = fit.fits["tool_latency_s"]
    assert not lat.fits_the_mean() and abs(lat.clipped_mean() / lat.mean.value - 1) > 0.2
    spec = fit.spec()
    assert spec.tool_latency_s.kind == "empirical"
    assert spec.tool_latency_s.mean == pytest.approx(lat.mean.value, rel=0.02)
    assert spec.tool_output_tokens.kind == "lognormal"              # the others stay lognormal
    assert any(n.startswith("tool_latency_s: the lognormal") for n in fit.notes)


# ---- the workload field ----------------------------------------------------------------------------------------


def test_sandbox_start_is_optional_and_checked() -> None:
    raw = load_workload("tiny-cpu").to_dict()
    assert "sandbox_start_s" not in raw and load_workload("tiny-cpu").sandbox_start_s is None
    ok = workload_from_dict({**raw, "sandbox_start_s": {"kind": "lognormal", "median": 0.05, "sigma": 0.3}})
    assert ok.sandbox_start_s is not None and workload_from_dict(ok.to_dict()) == ok
    for bad, allowed in (({"kind": "const", "value": -1.0}, "at least 0"),
                         ({"kind": "const", "value": 1e9}, "MAX_TOOL_LATENCY_S"),
                         ("fast", "kind = const | uniform | lognormal | empirical")):
        with pytest.raises(SpecError, match="sandbox_start_s") as e:
            workload_from_dict({**raw, "sandbox_start_s": bad})
        assert allowed in str(e.value)
