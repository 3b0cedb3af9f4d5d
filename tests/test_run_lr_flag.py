"""`mixfleet run --lr` (`--set embedded.lr=X`): the learning rate the asynchronous fleets learn at
(docs/learning.md: 1.5e-4; the shipped plans' 3e-4 barely moves them) without editing the plan. It goes into the
run's plan, so the run log records it and a resume with another learning rate is refused by the plan check,
naming `embedded.lr` with both values; a bad value is refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import RunLogWriter
from mixfleet.policies.plan import load_plan, plan_from_dict
from mixfleet.runner.orchestration.config import run_settings
from mixfleet.runner.orchestration.recipe import apply_overrides
from mixfleet.runner.orchestration.resume import prepare_resume
from mixfleet.ui.cli import app
from mixfleet.ui.commands.run_live import flag_overrides
from typer.testing import CliRunner


def with_lr(plan, lr):  # noqa: ANN001, ANN202 - what `mixfleet run --lr` does to the plan
    return apply_overrides(plan, flag_overrides([], lr=lr))


def test_lr_goes_into_the_plan_and_the_runs_settings() -> None:
    plan = load_plan("tiny-cpu")
    assert with_lr(plan, None) is plan
    lowered = with_lr(plan, 7.5e-5)
    assert (plan.embedded.lr, lowered.embedded.lr) == (1.5e-4, 7.5e-5)
    assert run_settings(lowered).lr == 7.5e-5
    assert plan_from_dict(lowered.to_dict()) == lowered                 # as the run log records it
    assert lowered.groups == plan.groups and lowered.policies == plan.policies
    assert flag_overrides(["embedded.lr=7.5e-5"]) == flag_overrides([], lr=7.5e-5)   # --set is the same
    with pytest.raises(SpecError, match="--lr.*given once"):
        flag_overrides(["embedded.lr=7.5e-5"], lr=7.5e-5)


def test_a_resume_at_another_lr_is_refused_naming_the_field(tmp_path: Path) -> None:
    run = tmp_path / "run"
    lowered = with_lr(load_plan("tiny-cpu"), 7.5e-5)
    with RunLogWriter(run, {"source": "runner", "plan": lowered.to_dict()}):
        pass
    assert prepare_resume(run, lowered, apply=False) is not None         # the same lr continues
    with pytest.raises(SpecError, match=r"embedded\.lr: saved 7\.5e-05, now 0\.00015") as e:
        prepare_resume(run, load_plan("tiny-cpu"), apply=False)         # --resume without --lr 7.5e-5
    assert "--take-new-settings" in str(e.value)
    point = prepare_resume(run, load_plan("tiny-cpu"), apply=False, take_new_settings=True)
    assert point is not None and point.new_settings == {"embedded.lr": [7.5e-5, 1.5e-4]}


@pytest.mark.parametrize("bad", ["0", "-1e-4"])
def test_a_bad_lr_is_one_line_naming_the_field_and_writes_nothing(tmp_path: Path, bad: str) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", "data/plans/tiny-cpu.toml", "--out", str(out), "--lr", bad,
                                   "--init", str(tmp_path / "x"), "--updates", "1"])
    assert res.exit_code == 2, res.output
    assert "'lr'" in res.output and "a number > 0" in res.output
    assert not out.exists()
