"""The ablation report on small hand-made run logs: verdicts by the stated rule, per-update series (no-tool-call
share from the trajectories), per-group shares (hand-computed), the Markdown, and the CLI command.

Three runs are written with the real RunLogWriter: a collapsing one (reward 0.5 -> 0.2, KL 1e-3 -> 4e-3), an
unstable one (KL x4 but reward flat) and a stable one; 8 updates each, so the windows are 2 updates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import typer
from mixfleet.costmodel.records.runlog import EventRecord, GroupRecord, RunLogWriter, TrajectoryRecord, UpdateRecord
from mixfleet.studies.ablation_report import (
    RUN_FILE,
    VERDICT_RULE,
    build_report,
    find_runs,
    group_table,
    heldout_change,
    verdict,
)
from mixfleet.ui.commands import experiment
from typer.testing import CliRunner

UPDATES = 8


def _write_run(folder: Path, *, fleet: str, variant: str, seed: int, rewards: list[float], kls: list[float],
               no_tool: list[int], heldout: dict[int, float] | None = None) -> None:
    """A run log with one batch of 4 trajectories per update (no_tool[v-1] of them ending on no_tool_call_3x)
    and two groups: "a" (3 samples, 30 tokens, 10 % extreme, 20 % out of band) and "b" (1 sample, 10 tokens,
    40 % extreme, 50 % out of band)."""
    folder.mkdir(parents=True)
    (folder / RUN_FILE).write_text(json.dumps({"fleet": fleet, "variant": variant, "seed": seed}))
    with RunLogWriter(folder, {"source": "runner", "plan": {}, "seed": seed}) as w:
        for v, r in (heldout or {}).items():         # the runner's held-out evaluation events
            detail = {"eval": "pass_at_k", "k": 4, "version": v, "pass_at_k": min(1.0, 2 * r), "reward": r,
                      "problems": 32}
            w.append(EventRecord(time_s=float(v), kind="note", version=v, detail=json.dumps(detail)))
        for v in range(1, UPDATES + 1):
            w.append(UpdateRecord(version=v, start_s=v, end_s=v + 0.5, train_step_s=0.1, weight_sync_s=0.1, tokens=40,
                                  trajectories=4, staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0,
                                  cost_sampler_usd=0, cost_trainer_usd=0, kl_k3=kls[v - 1], extreme_low_share=0.1,
                                  extreme_high_share=0.06, masked_share=0.3, grad_norm=1.0 + v, entropy=1.0 - 0.05 * v,
                                  reward_mean=rewards[v - 1]))
            for g, n, tok, ext, band, k3_fresh, fresh in (("a", 3, 30, 0.1, 0.2, 1e-3, 10),
                                                          ("b", 1, 10, 0.4, 0.5, 4e-3, 5)):
                w.append(GroupRecord(version=v, group=g, replicas_up=1, utilization=1, tokens_generated=tok, samples=n,
                                     share_of_samples=n / 4, kl_k3=kls[v - 1], extreme_share=ext, masked_share=band,
                                     tokens_trained=tok, kl_k3_on_policy=k3_fresh, kl_k1_on_policy=0.0,
                                     tokens_on_policy=fresh))
            for i in range(4):
                w.append(TrajectoryRecord(run_id=w.run_id, prompt_id=v, sample_index=i, group="a" if i < 3 else "b",
                                          replica=0, version_start=v - 1, version_end=v - 1, turns=3, prompt_tokens=5,
                                          generated_tokens=10, start_s=0, end_s=1, reward=0.0,
                                          finish_reason="no_tool_call_3x" if i < no_tool[v - 1] else "done",
                                          trained_version=v))


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("study")
    _write_run(root / "mixed" / "grpo" / "seed0", fleet="mixed", variant="grpo", seed=0,
               rewards=[0.5, 0.5, 0.45, 0.4, 0.35, 0.3, 0.2, 0.2],
               kls=[1e-3, 1e-3, 1.5e-3, 2e-3, 3e-3, 3e-3, 4e-3, 4e-3],
               no_tool=[0, 0, 0, 1, 1, 2, 3, 3], heldout={0: 0.4, 4: 0.3, 8: 0.1})
    _write_run(root / "mixed" / "sc" / "seed0", fleet="mixed", variant="sc", seed=0,
               rewards=[0.5] * 8, kls=[1e-3, 1e-3, 2e-3, 2e-3, 3e-3, 3e-3, 4e-3, 4e-3], no_tool=[0] * 8)
    _write_run(root / "mixed" / "sc_mis" / "seed0", fleet="mixed", variant="sc_mis", seed=0,
               rewards=[0.5, 0.5, 0.5, 0.6, 0.6, 0.6, 0.6, 0.6], kls=[1e-3] * 8, no_tool=[0] * 8,
               heldout={0: 0.4, 8: 0.55})
    return root


def test_series_and_verdicts(study: Path) -> None:
    runs = {r.variant: r for r in find_runs(study)}
    assert list(runs) == ["grpo", "sc", "sc_mis"]                 # the seed's order, not alphabetical
    s = runs["grpo"].series
    assert list(s.index) == list(range(1, UPDATES + 1))
    assert s["no_tool_share"].tolist() == [0, 0, 0, 0.25, 0.25, 0.5, 0.75, 0.75]
    assert s["extreme_share"].tolist() == pytest.approx([0.16] * UPDATES)
    v = verdict(s)
    assert v["window"] == 2
    assert (v["reward_start"], v["reward_end"]) == pytest.approx((0.5, 0.2))
    assert v["kl_growth"] == pytest.approx(4.0)
    assert v["kl_peak_growth"] == pytest.approx(4.0)       # the largest KL over the start window's
    assert v["verdict"] == "collapsed"
    assert v["signs"] == "RKT" and verdict(runs["sc"].series)["signs"] == "K"
    assert v["no_tool_end"] == pytest.approx(0.75)
    assert v["grad_max_over_start"] == pytest.approx(9.0 / 2.5)
    vs = verdict(runs["sc"].series)
    assert (vs["reward_fell"], vs["kl_grew"], vs["verdict"]) == (False, True, "unstable")
    assert verdict(runs["sc_mis"].series)["verdict"] == "stable"
    assert runs["grpo"].evals["version"].tolist() == [0, 4, 8]
    assert heldout_change(runs["grpo"]) == pytest.approx((0.4, 0.1))
    assert heldout_change(runs["sc_mis"]) == pytest.approx((0.4, 0.55))
    assert all(math.isnan(x) for x in heldout_change(runs["sc"]))     # no evaluations: not a number


def test_kl_start_window_skips_the_staleness_ramp() -> None:
    import pandas as pd

    # staleness 0, 1, then 2: the KL start window is updates 3-4 (KL 2), not 1-2 (KL 1) -> growth 6 / 2 = 3x
    df = pd.DataFrame({"reward": 0.5, "kl_k3": [1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 6.0, 6.0], "grad_norm": 1.0,
                       "entropy": 1.0, "extreme_share": 0.0, "no_tool_share": 0.0,
                       "staleness": [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]}, index=range(1, 9))
    v = verdict(df)
    assert (v["kl_start_from_update"], v["kl_start"], v["kl_growth"]) == (3, 2.0, 3.0)


def test_verdict_thresholds_are_the_stated_ones() -> None:
    import pandas as pd

    def one(r_end: float, k_end: float) -> str:
        df = pd.DataFrame({"reward": [0.5, 0.5, 0.5, r_end], "kl_k3": [1.0, 1.0, 1.0, k_end], "grad_norm": 1.0,
                           "entropy": 1.0, "extreme_share": 0.0, "no_tool_share": 0.0}, index=[1, 2, 3, 4])
        return verdict(df)["verdict"]                               # 4 updates -> windows of 1

    assert one(0.39, 3.0) == "collapsed"
    assert one(0.41, 3.0) == "unstable"                             # a drop of 0.09 < 0.1
    assert one(0.39, 2.9) == "unstable"
    assert one(0.41, 2.9) == "stable"


def test_group_table_hand_computed(study: Path) -> None:
    t = group_table(find_runs(study))
    # per run and update: a 30 tokens (3 extreme, 6 out of band), b 10 tokens (4 extreme, 5 out of band)
    assert t.loc["a", "share_of_samples"] == pytest.approx(0.75)
    assert t.loc["a", "share_of_tokens"] == pytest.approx(0.75)
    assert t.loc["a", "share_of_extreme_tokens"] == pytest.approx(3 / 7)
    assert t.loc["b", "share_of_extreme_tokens"] == pytest.approx(4 / 7)
    assert t.loc["b", "extreme_share_in_group"] == pytest.approx(0.4)
    assert t.loc["a", "share_of_out_of_band_tokens"] == pytest.approx(6 / 11)
    assert t.loc["b", "kl_on_policy"] == pytest.approx(4e-3)               # from the runner's notes
    assert find_runs(study)[0].series["kl_on_policy"].tolist() == pytest.approx([(1e-2 + 2e-2) / 15] * UPDATES)


def test_markdown_report(study: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("Findings first.")
    res = build_report(study, tmp_path / "out", notes=notes, plots=False)
    text = (tmp_path / "out" / "README.md").read_text()
    assert text.index("Findings first.") < text.index("## Verdict rule")
    assert VERDICT_RULE in text
    assert "| GRPO | 0 | 8 | 0.500 -> 0.200 | 0.400 -> 0.100 | 1.00e-03 -> 4.00e-03 (4.0x) | 4.0x |" in text
    assert "| SC+MIS | 1 | 1 stable | R 0/1, K 0/1, T 0/1 | 0.500 (0.500..0.500) | 0.600 (0.600..0.600) | " \
           "0.400 (0.400..0.400) | 0.550 (0.550..0.550) |" in text
    assert "**collapsed**" in text and "**unstable**" in text and "**stable**" in text
    assert "| b | 25.00 % | 25.00 % |" in text
    saved = json.loads((tmp_path / "out" / "verdicts.json").read_text())
    assert [v["verdict"] for v in saved] == ["collapsed", "unstable", "stable"]
    assert [v["verdict"] for v in res["verdicts"]] == ["collapsed", "unstable", "stable"]
    assert not math.isnan(saved[0]["kl_growth"])
    import pandas as pd

    csv = pd.read_csv(tmp_path / "out" / "series.csv")
    assert len(csv) == 3 * UPDATES and list(csv.columns[:4]) == ["fleet", "variant", "seed", "version"]
    assert csv[csv["variant"] == "grpo"]["reward"].tolist() == [0.5, 0.5, 0.45, 0.4, 0.35, 0.3, 0.2, 0.2]


def test_unfinished_runs_are_left_out_unless_asked(study: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "s"
    shutil.copytree(study, root)
    header = json.loads((root / "mixed" / "sc" / "seed0" / "run.json").read_text())
    (root / "mixed" / "sc" / "seed0" / "run.json").write_text(json.dumps({**header, "status": "running"}))
    res = build_report(root, tmp_path / "a", plots=False)
    assert [v["variant"] for v in res["verdicts"]] == ["grpo", "sc_mis"]
    assert "Not finished, left out: mixed/sc/seed0 (8 updates)." in (tmp_path / "a" / "README.md").read_text()
    res = build_report(root, tmp_path / "b", plots=False, include_unfinished=True)
    assert [v["variant"] for v in res["verdicts"]] == ["grpo", "sc", "sc_mis"]
    assert build_report(root, tmp_path / "c", plots=False, seeds=(0,))["verdicts"]
    with pytest.raises(ValueError, match="no run log"):
        build_report(root, tmp_path / "d", plots=False, seeds=(5,))


def test_report_cli(study: Path, tmp_path: Path) -> None:
    app = typer.Typer()
    experiment.register(app)
    r = CliRunner().invoke(app, ["report", "ablation", str(study), "--out", str(tmp_path / "r"), "--no-plots"])
    assert r.exit_code == 0, r.output
    assert "3 runs: 1 collapsed, 1 stable, 1 unstable" in r.output
    r = CliRunner().invoke(app, ["report", "ablation", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output and "Traceback" not in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(app, ["report", "ablation", str(empty)])
    assert r.exit_code == 2 and "no run log" in r.output


def test_kl_peak_is_reported_beside_the_rule_not_in_it() -> None:
    import pandas as pd

    # a collapse whose KL spikes (x50) and comes back once the policy is deterministic: the end-window growth is
    # 1x, so the stated rule says "unstable" (reward fell, KL did not grow); the peak says what happened
    df = pd.DataFrame({"reward": [0.5, 0.5, 0.5, 0.5, 0.2, 0.0, 0.0, 0.0], "grad_norm": 1.0, "entropy": 1.0,
                       "kl_k3": [1.0, 1.0, 1.0, 50.0, 20.0, 2.0, 1.0, 1.0], "extreme_share": 0.0,
                       "no_tool_share": [0, 0, 0, 0, 0.5, 1, 1, 1]}, index=range(1, 9))
    v = verdict(df)
    assert (v["kl_growth"], v["kl_peak_growth"]) == pytest.approx((1.0, 50.0))
    assert (v["verdict"], v["signs"]) == ("unstable", "RT")
