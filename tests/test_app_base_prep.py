"""The app offers to prepare the base policy before a run (issue 44, the newcomer's walk: the first real run
pretrained the tiny base for about 10 minutes inside "starting", and nothing offered to prepare it beforehand).
The Run for real form says whether the base an embedded run starts from is cached; when it is not, a button
trains it in a background process. The page is driven with that process recorded, not run (it takes minutes);
the process itself is run against a cache that holds the key the page computed, so it must find it there (a
different key would start pretraining, which it prints)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.pretrain import META_FILE
from mixfleet.runner.orchestration.recipe import PRETRAIN_LINE
from mixfleet.ui import base_prep

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


@pytest.fixture()
def plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("MIXFLEET_CACHE", str(tmp_path / "cache"))
    text = tomli_w.dumps(load_plan("tiny-cpu").to_dict())
    (tmp_path / "plan.toml").write_text(text)
    monkeypatch.setenv(PLAN_ENV, str(tmp_path / "plan.toml"))
    return text


def _cache(b: base_prep.Base) -> None:
    b.path.mkdir(parents=True)
    (b.path / META_FILE).write_text(json.dumps({"key": b.key}))


def test_the_form_offers_to_prepare_an_uncached_base(plan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    monkeypatch.setattr(base_prep, "start", lambda toml: started.append(toml))
    at = AppTest.from_function(_form_page, default_timeout=120)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    b = base_prep.base_of(plan)
    assert not b.cached and b.command.startswith("mixfleet pretrain --model tiny --task ")
    assert any("is not cached yet" in i.value and b.command in i.value for i in at.info), [i.value for i in at.info]
    at.button(key="t_base_prep").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert started == [plan]
    _cache(b)
    at.run()
    assert not any("not cached" in i.value for i in at.info)
    assert any(c.value.startswith("Base policy: cached") for c in at.caption), [c.value for c in at.caption]
    with pytest.raises(KeyError):
        at.button(key="t_base_prep")


def test_the_background_process_prepares_the_key_the_page_shows(plan: str) -> None:
    b = base_prep.base_of(plan)
    _cache(b)
    out = subprocess.run([sys.executable, "-m", "mixfleet.ui.base_prep", str(Path(os.environ[PLAN_ENV]))],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"base policy ready: {b.path}", out.stdout
    assert PRETRAIN_LINE not in out.stdout
