"""`mixfleet plan` inputs that used to give a silently wrong plan or a traceback (issue 13 item 5)."""

from __future__ import annotations

import numpy as np
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.planner.config import PlannerConfig
from mixfleet.ui.cli import app
from typer.testing import CliRunner


def test_gpu_caps_take_any_case_and_refuse_unknown_names() -> None:
    # main: {"b200": 2} never matched "B200", so the cap was dropped without a word (B200 x47 chosen)
    assert PlannerConfig(max_gpus={"b200": 2, "h100": 8}).max_gpus == {"B200": 2, "H100": 8}
    assert PlannerConfig(accelerators=("h100", "b200")).accelerators == ("H100", "B200")
    with pytest.raises(SpecError, match="'H900'.*B200, B300"):
        PlannerConfig(max_gpus={"H900": 2})


@pytest.mark.parametrize(("kw", "field"), [
    ({"default_max_gpus": 0}, "default_max_gpus"), ({"max_gpus": {"H100": 0}}, "max_gpus.H100"),
    ({"default_max_gpus": True}, "default_max_gpus"), ({"max_gpus": {"H100": 10**9}}, "max_gpus.H100"),
    ({"trainer_gpus": 0}, "trainer_gpus"), ({"kv_dtypes": ("fp4",)}, "kv_dtypes"), ({"kv_dtypes": ()}, "kv_dtypes"),
])
def test_bad_pool_settings_name_the_field_and_the_allowed_values(kw: dict, field: str) -> None:
    with pytest.raises(SpecError, match=f"'{field}'") as e:
        PlannerConfig(**kw)
    assert "allowed" in str(e.value)


def test_the_cli_says_what_is_wrong_instead_of_a_traceback() -> None:
    runner = CliRunner()
    zero = runner.invoke(app, ["plan", "--default-max-gpus", "0"])        # main: ValueError from numpy.geomspace
    assert zero.exit_code == 2 and "default_max_gpus" in zero.output and "1..65536" in zero.output
    assert zero.exception is None or isinstance(zero.exception, SystemExit)
    fp4 = runner.invoke(app, ["plan", "--kv-dtypes", "fp4"])             # main: "no ... fits the model"
    assert fp4.exit_code == 2 and "kv_dtypes" in fp4.output and "'fp8_e4m3'" in fp4.output
    assert "fits the model" not in fp4.output


def test_no_candidate_says_which_limit_binds_and_the_best_value_reached() -> None:
    from mixfleet.planner.search import binding_constraints  # main: "no candidate meets the constraints; relax one"

    m = {"cost_per_update": np.array([1.0, 2.0, 3.0]), "staleness": np.array([0.7, 0.9, 2.0]),
         "time_per_update_s": np.array([50.0, 40.0, 30.0]), "usd_per_hour": np.array([90.0, 60.0, 53.0])}
    note = binding_constraints(m, PlannerConfig(max_staleness=0.5, max_usd_per_hour=100.0))
    assert "--max-staleness 0.5 binds: the best mean staleness of any candidate is 0.7 versions" in note
    assert "--budget 100 holds alone" in note and "3 screened" in note and "64 per other accelerator" in note
    # each limit alone is met, not both: the best staleness within the budget is named
    note = binding_constraints(m, PlannerConfig(max_staleness=0.8, max_usd_per_hour=70.0))
    assert "--max-staleness 0.8 holds alone (best 0.7 versions) but not with the others: the best mean " \
           "staleness within them is 0.9 versions" in note
