"""Issue 42 on the Plan page: sandbox inputs as `mixfleet plan --sandboxes`, the cost per update split into sampling,
training and sandboxes, the sandbox share in the Pareto chart's hover; and (issue 43) the page's twin points are the
twin's checks: the chosen mix's is the planner's own verification job, read back from the check cache, not
simulated again."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit")


def _pool(use: str = "H100") -> object:
    from mixfleet.ui.app_plan import _pool

    pool = _pool("modal")
    pool["use"] = pool["accelerator"] == use
    pool["max_gpus"] = 4
    return pool


def _run(**kw: object) -> object:
    from mixfleet.ui import app_planner as planner

    return planner.run(model="llama-3.1-8b", workload="tiny-cpu", price_table="modal",
                       pool=_pool(), kv_dtypes=("fp8_e4m3",), trainer_accelerator="H100", trainer_gpus=1,
                       max_staleness=None, max_time_per_update_s=None, budget_usd_per_hour=None,
                       objective="cost per update", twin_updates=3, references=False, verify=1, **kw)


def test_the_page_plans_sandboxes_splits_the_cost_and_reads_the_chosen_check_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    from mixfleet.twin import checks
    from mixfleet.ui import app_charts as charts
    from mixfleet.ui.app_plan import cost_split_text

    monkeypatch.setenv("MIXFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MIXFLEET_NO_CACHE", raising=False)
    ran: list[int] = []
    real = checks.twin_check

    @functools.wraps(real)                             # the same name, so the same cache keys
    def counted(*job: object) -> dict:
        ran.append(job[2])
        return real(*job)

    monkeypatch.setattr(checks, "twin_check", counted)   # one job at a time runs in this process
    view = _run(sandboxes=True, sandbox_usd_per_hour=0.5, sandbox_start_s=5.0)
    p = view.chosen_point
    split = (p["cost_sampling_per_update_usd"], p["cost_training_per_update_usd"], p["cost_sandbox_per_update_usd"])
    assert all(x > 0 for x in split)
    assert sum(split) == pytest.approx(p["cost_per_update_usd"], rel=1e-9)     # the three parts make the whole
    text = cost_split_text(p)
    assert "sandboxes $" in text and "twin: sandboxes $" in text, text
    assert p["twin"]["cost_sandbox_per_update_usd"] > 0
    assert 0.0 < p["sandbox_share"] < 1.0
    assert all("sandboxes $" in label for label in view.points["label"]), view.points["label"].tolist()[:3]
    hovers = " ".join(str(t.hovertemplate) for t in charts.pareto(view.points, chosen=p,
                                                                   twin_points=view.twin_points).data)
    assert "sandboxes $" in hovers                     # the twin point's hover carries its sandbox cost
    # one check ran (the planner's verification of the chosen mix); the page's twin point read it back
    assert ran == [0] and len(list((tmp_path / "cache" / "twin-checks").glob("*.json"))) == 1
    assert view.twin_points[0]["time_per_update_s"] == p["twin"]["time_per_update_s"]

    plain = _run()                                     # sandboxes off (the default): no sandbox line or share
    q = plain.chosen_point
    assert q["cost_sandbox_per_update_usd"] == 0.0 and "pool wait" not in cost_split_text(q)
    assert not any("sandboxes $" in label for label in plain.points["label"])
