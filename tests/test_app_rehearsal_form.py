"""The "Run for real" form and the rehearsal (issue 26 Broken 4): the form says what an embedded rehearsal of the
plan runs here (the plan's own groups, replicas scaled, the tiny stand-in), and a plan that cannot run on this
machine is refused in the form with the reason; before, it started a `mixfleet run` that died at once while the
page said "starting"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomli_w

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

PLAN_ENV = "MIXFLEET_TEST_FORM_PLAN"


def _form_page() -> None:
    import os
    import tomllib
    from pathlib import Path

    from mixfleet.ui.app_common import PlanText
    from mixfleet.ui.app_launch import run_for_real

    text = Path(os.environ["MIXFLEET_TEST_FORM_PLAN"]).read_text()
    run_for_real(PlanText(tomllib.loads(text)["name"], text), "t")


def _plan_file(tmp_path: Path, plan: dict) -> Path:
    p = tmp_path / "plan.toml"
    p.write_text(tomli_w.dumps(plan))
    return p


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    return runs


def _start(tmp_path: Path, plan: dict) -> AppTest:
    os.environ[PLAN_ENV] = str(_plan_file(tmp_path, plan))
    at = AppTest.from_function(_form_page, default_timeout=120)
    at.run()
    assert not at.exception
    return at


def test_a_plan_too_big_for_this_machine_is_refused_in_the_form(env: Path, tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan

    plan = load_plan("seed-mixed").to_dict()
    for g in plan["groups"]:
        g["replicas"] = 300                               # 8 groups x 256 local samplers: far beyond any memory
    plan["embedded"] = {"max_replicas_per_group": 256}
    at = _start(tmp_path, plan)
    assert any("cannot run on this machine" in w.value and "2048 embedded samplers" in w.value for w in at.warning)
    at.button[0].click().run()                              # "Start the run", embedded rehearsal (the default)
    errors = [e.value for e in at.error]
    assert any(v.startswith("cannot start the run: this plan cannot be rehearsed on this machine: ") and
               "2048 embedded samplers" in v and "at most" in v for v in errors), errors
    assert not any("Started" in s.value for s in at.success)
    # the refusal stays on the page through the next rerun of the same plan (any widget, a second upload event);
    # before, it vanished with that rerun and the browser test read it as Start having done nothing
    at.run()
    assert any(e.value.startswith("cannot start the run: this plan cannot be rehearsed") for e in at.error)
    assert not env.exists() or not any(env.iterdir())     # no run folder, no process


def test_the_form_says_what_the_rehearsal_of_seed_mixed_runs(env: Path, tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan

    at = _start(tmp_path, load_plan("seed-mixed").to_dict())
    assert not at.warning
    text = " ".join(m.value for m in at.markdown) + " ".join(c.value for c in at.code)
    assert "Embedded rehearsal here" in text and "its tiny stand-in tiny-qwen3-moe" in text
    assert "embedded samplers (at most" in text
    assert "H100-FP8: fp8 weights, KV fp8_e4m3: 10 planned H100 replicas" in text


def test_the_run_name_follows_the_chosen_plan(env: Path, tmp_path: Path) -> None:
    """The form's default run name is the plan's; choosing another plan changes it (it kept the first one's)."""
    from mixfleet.policies.plan import load_plan

    at = _start(tmp_path, load_plan("seed-mixed").to_dict())
    assert at.text_input[0].value.startswith("seed-mixed-")
    _plan_file(tmp_path, load_plan("tiny-cpu").to_dict())          # the page's plan is now another one
    at.run()
    assert at.text_input[0].value.startswith("tiny-cpu-")
