"""`mixfleet evaluate` (runner/orchestration/evaluate_run.py): a run's last policy evaluated again, held out.

The learning ladder compares rungs whose ends differ by ~0.05 while a run's own 64 x 2 evaluation has a standard
error of ~0.04 (docs/learning.md); re-evaluating each run's final policy on more problems is how the comparison gets
its power. What must hold: the policy evaluated is the run's own last one, with the run's own settings (with the
run's problem count, k and seed the result IS the run's last evaluation), the base checkpoint the same way, and bad
input is refused with its field before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.runner.orchestration.evaluate_run import evaluate_policy, paired_difference
from mixfleet.ui.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def test_what_is_not_a_run_or_a_checkpoint_is_refused_with_its_field(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"'path' = .*a run folder .*no run\.json.* or a Hugging Face layout"):
        evaluate_policy(tmp_path, problems=4, k=2)
    from mixfleet.costmodel.records.runlog import FORMAT_NAME, HEADER_FILE

    (tmp_path / HEADER_FILE).write_text(json.dumps({"format": FORMAT_NAME}))     # a run log without a checkpoint
    with pytest.raises(SpecError, match=r"'run' = .*a runner run folder with a checkpoint \(trainer_state/"):
        evaluate_policy(tmp_path, problems=4, k=2)
    with pytest.raises(SpecError, match=r"'problems x k' = '0 x 2'.*problems x k <= 4096"):
        evaluate_policy(tmp_path, problems=0, k=2)
    with pytest.raises(SpecError, match=r"'problems x k' = '4096 x 2'"):
        evaluate_policy(tmp_path, problems=4096, k=2)
    with pytest.raises(SpecError, match=r"'settings' = 'temprature' is invalid; allowed: task, task_options, temper"):
        evaluate_policy(tmp_path, problems=4, k=2, temprature=1.0)
    r = runner.invoke(app, ["evaluate", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "error: evaluate: field 'path'" in r.output


def test_a_paired_difference_needs_the_same_draws() -> None:
    a = {"settings": {"problems": 2, "k": 2, "seed": 0}, "problem_rewards": [1.0, 0.5]}
    b = {"settings": {"problems": 2, "k": 2, "seed": 0}, "problem_rewards": [0.5, 0.5]}
    assert paired_difference(a, b) == pytest.approx({"difference": 0.25, "se": 0.25})
    with pytest.raises(ValueError, match=r"differ in their settings \{\"seed\": \[0, 1\]\}"):
        paired_difference(a, {**b, "settings": {**b["settings"], "seed": 1}})


@pytest.mark.slow
def test_a_runs_last_policy_evaluated_again_is_its_last_evaluation(tmp_path: Path) -> None:
    """A real run (tiny model, Ray, the trainer, embedded samplers): 2 updates, evaluated at the start and at update 2
    on 4 problems x 2. `mixfleet evaluate` of the run folder with the same problems, k and seed gives exactly the
    run's update-2 evaluation (the policy of its last checkpoint, exported as the samplers load it, the run's own
    sampling settings); of the base checkpoint with the run's settings, exactly its start evaluation. More
    problems: the first ones are the same problems with the same draws."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.records.trackers import eval_frame
    from runplans import CPU_BF16, run_files, run_plan_toml

    plan_toml = run_plan_toml(
        "test-evaluate", [CPU_BF16], embedded={"max_turns": 2, "max_new_tokens": 8, "eval_every": 2, "pass_k": 2,
                                               "extra": {"eval_problems": 4}},
        batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 4})
    init, plan = run_files(tmp_path, plan_toml)
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", str(plan), "--out", str(out), "--init", str(init), "--updates", "2", "--quiet"])
    assert r.exit_code == 0, r.output[-3000:]
    log = RunLog.open(out)
    ev = eval_frame(log.events).set_index("version")
    assert list(ev.index) == [0, 2]
    seed = int(log.header["seed"])

    again = evaluate_policy(out, problems=4, k=2, seed=seed)
    assert again.kind == "run" and again.version == 2
    assert (again.reward, again.pass_at_k) == (ev.loc[2, "reward"], ev.loc[2, "pass_at_k"])
    assert again.settings["max_turns"] == 2 and again.settings["max_new_tokens"] == 8     # the run's, not defaults
    base = evaluate_policy(init, problems=4, k=2, seed=seed, max_turns=2, max_new_tokens=8)
    assert base.kind == "checkpoint" and (base.reward, base.pass_at_k) == (ev.loc[0, "reward"], ev.loc[0, "pass_at_k"])

    r = runner.invoke(app, ["evaluate", str(out), "--problems", "6", "--k", "2", "--seed", str(seed), "--json",
                            "--out", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output[-2000:]
    more = json.loads((tmp_path / "e.json").read_text())
    assert more["settings"]["problems"] == 6 and len(more["problem_rewards"]) == 6
    assert more["problem_rewards"][:4] == pytest.approx(list(again.problem_rewards))


def test_a_task_sets_evaluation_says_each_tasks_outcome(tmp_path: Path) -> None:
    """Issue 40: the per-task outcome of a task set. Problem i of the eval split is task (seed mod n) of the set,
    named by its folder; `by_task` adds each task's problems up; `mixfleet evaluate --task-set` prints them."""
    from mixfleet.runner.orchestration.evaluate_run import PolicyEvaluation
    from mixfleet.runner.rollout.tasks import split_seeds
    from sampler_helpers import make_checkpoint

    root = Path(__file__).resolve().parents[1] / "data" / "tasksets" / "example"
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    ck = make_checkpoint(tmp_path / "ck", seed=1, weight_version="v0")
    res = evaluate_policy(ck, problems=6, k=1, task="repo", task_options={"task_set": str(root)}, max_turns=2,
                          max_new_tokens=8)
    assert res.problem_names == tuple(names[s % len(names)] for s in split_seeds("eval", 6))
    rows = {r["task"]: r for r in res.by_task()}
    assert sum(r["problems"] for r in rows.values()) == 6 and set(rows) == set(res.problem_names)
    assert res.to_dict()["by_task"] == res.by_task()
    # solved and mean reward per task, on known rewards
    ev = PolicyEvaluation(source="x", kind="checkpoint", version=None, settings={}, reward=0.5, reward_se=0.0,
                          pass_at_k=0.5, problem_rewards=(1.0, 0.0, 0.5, 0.0), wall_s=0.0,
                          problem_names=("a", "b", "a", "b"), problem_solved=(True, False, True, False))
    assert ev.by_task() == [{"task": "a", "problems": 2, "reward": 0.75, "solved": 2},
                            {"task": "b", "problems": 2, "reward": 0.0, "solved": 0}]
    r = runner.invoke(app, ["evaluate", str(ck), "--task-set", str(root), "--problems", "6", "--k", "1",
                            "--max-turns", "2", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    at = lines.index(f"per task ({root}):")
    assert [ln.split()[0] for ln in lines[at + 1:at + 1 + len(rows)]] == list(rows)
    bad = runner.invoke(app, ["evaluate", str(ck), "--task-set", str(tmp_path / "none"), "--problems", "2"])
    assert bad.exit_code == 2 and "task_set" in bad.output and "Traceback" not in bad.output


def test_a_cut_trainer_state_is_one_line_through_the_command(tmp_path: Path) -> None:
    """Issue 44 (third probe): `mixfleet evaluate` of a run whose trainer_state.pt is cut printed a 95-line
    `[rank0]:` traceback around the project's own message. Through the entry point, as a user runs it: exit 2,
    one line naming the file, no traceback."""
    import subprocess
    import sys

    from mixfleet.costmodel.records.runlog import RunLogWriter
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.orchestration.config import STATE_DIR
    from mixfleet.runner.trainer.megatron_model import BuildOptions
    from mixfleet.runner.trainer.trainer import Trainer, TrainerConfig

    run = tmp_path / "run"
    RunLogWriter(run, {"source": "runner", "runner": {"task": "guess"}}).close()
    Trainer(load_model_spec("tiny"), TrainerConfig(build=BuildOptions(device="cpu", seed=1))).save_state(
        run / STATE_DIR)
    state = run / STATE_DIR / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    r = subprocess.run([sys.executable, "-m", "mixfleet.ui.cli", "evaluate", str(run), "--problems", "1", "--k", "1"],
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "[rank" not in out, out[-3000:]
    said = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(said) == 1 and f"{state}: cut or corrupt" in said[0], out[-3000:]


def test_the_general_split_is_chosen_on_the_command_line(tmp_path: Path) -> None:
    """Issue 41: `mixfleet evaluate --split general` evaluates on the problems training never shows; the result
    and the printed line say which split; another value is refused naming the allowed ones."""
    from sampler_helpers import make_checkpoint

    ck = make_checkpoint(tmp_path / "ck", seed=1, weight_version="v0")
    args = ["evaluate", str(ck), "--problems", "2", "--k", "1", "--max-turns", "1", "--max-new-tokens", "4"]
    r = runner.invoke(app, [*args, "--split", "general", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["settings"]["split"] == "general"
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "(eval split)" in r.output, r.output
    bad = runner.invoke(app, [*args, "--split", "train"])
    assert bad.exit_code == 2 and "split = 'train'; allowed: eval, general" in bad.output, bad.output
