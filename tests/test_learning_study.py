"""The learning study of issue 41 (studies/learning_study.py, benchmarks/learning.py --study): its table, its order,
its estimates and listing, and its verdict rules on hand-made runs where each verdict is reached and can fail.

The runs here are dicts in the shape benchmarks/learning.py `read_run` returns (the fields the verdicts read);
the listing's run logs are written with the real RunLogWriter. Nothing here trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLogWriter, UpdateRecord
from mixfleet.policies.plan import load_plan
from mixfleet.studies.ablation import VARIANT_KEYS, variant
from mixfleet.studies.learning_study import (
    ARMS,
    RULES,
    RUN_OVERHEAD_S,
    STUDY,
    TREATMENT_NOISE,
    arm_verdict,
    collapse_signs,
    equivalence,
    estimate_s,
    paired,
    study_order,
    t_interval,
    verdicts,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learning(benchmark_script):
    return benchmark_script("learning")


# ---------------------------------------------------------------------------------------------- the table

def test_the_dense_study_is_the_issues() -> None:
    arms = {(a.fleet, a.variant): a for a in STUDY["dense"]}
    assert set(arms) == {("mixed", v) for v in VARIANT_KEYS} | {("homogeneous", "grpo"),
                                                                ("homogeneous", "sc_mis_topp")}
    key = {k for k, a in arms.items() if a.key_arm}
    assert key == {(f, v) for f in ("mixed", "homogeneous") for v in ("grpo", "sc_mis_topp")}
    for k, a in arms.items():
        assert (a.seeds, a.updates) == (((0, 1, 2, 3, 4), 60) if k in key else ((0, 1, 2), 40)), a.key
        assert a.model == "tiny" and a.pretrain_steps == 150 and a.settings == {"lr": 1.5e-4}
        loss = variant(a.variant).overrides()
        assert a.overrides == ({**loss, **TREATMENT_NOISE} if a.fleet == "mixed" else loss)
    moe = {(a.fleet, a.variant): a for a in STUDY["moe"]}
    assert set(moe) == {(f, v) for f in ("mixed", "homogeneous") for v in ("grpo", "sc_mis_topp")} | {
        ("mixed-replay", "sc_mis_topp")}
    assert all(a.seeds == (0, 1, 2) and a.model == "tiny-qwen3-moe" and a.pretrain_steps == 300
               for a in moe.values())
    assert load_plan(moe[("mixed-replay", "sc_mis_topp")].plan).trainer.routing == "replay"


def test_the_homogeneous_fleet_is_tiny_cpus_bf16_group() -> None:
    mixed = load_plan("tiny-cpu")
    bf16 = next(g for g in mixed.groups if g.name == "cpu-bf16")
    for name, model in (("learning-homog-bf16", "tiny"), ("learning-homog-bf16-moe", "tiny-qwen3-moe")):
        plan = load_plan(name)
        (g,) = plan.groups
        assert (g.precision, g.kv_dtype, g.kernel, g.replicas) == (bf16.precision, bf16.kv_dtype, bf16.kernel, 3)
        assert plan.model == model and plan.embedded.max_replicas_per_group == 3
        assert plan.embedded.lr == mixed.embedded.lr and plan.policies.batcher == mixed.policies.batcher


def test_arm_keys_never_collide_with_ladder_runs(learning) -> None:
    kept = set()
    for name in ("learning.json", "learning_treatment.json", "learning_b-lr_same_base.json"):
        kept |= {r["rung"] for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["runs"]}
    assert kept and not kept & set(ARMS)
    assert all(learning.RUNGS[k].plan == a.plan and learning.RUNGS[k].overrides == a.overrides
               for k, a in ARMS.items())


def test_order_runs_the_key_arms_seeds_0_to_2_first_whole_seeds_at_a_time() -> None:
    order = [(a.key, s) for a, s in study_order("dense")]
    assert len(order) == len(set(order)) == 4 * 5 + 4 * 3
    first = order[:12]
    assert {ARMS[k].key_arm for k, _ in first} == {True} and [s for _, s in first] == [0] * 4 + [1] * 4 + [2] * 4
    assert {s for _, s in order[12:20]} == {3, 4} and all(ARMS[k].key_arm for k, _ in order[12:20])
    assert not any(ARMS[k].key_arm for k, _ in order[20:])
    moe = [(a.key, s) for a, s in study_order("moe")]
    assert moe[-3:] == [("m-mix-sc_mis_topp-replay", s) for s in (0, 1, 2)]
    with pytest.raises(ValueError, match="allowed: dense, moe"):
        study_order("large")


def test_estimate_is_the_like_rungs_measured_wall_per_update() -> None:
    arm = ARMS["s-mix-grpo"]
    ladder = {"runs": [{"rung": "c-lr", "status": "finished", "updates": 40, "wall_s": 400.0},
                       {"rung": "c-lr", "status": "finished", "updates": 40, "wall_s": 800.0},
                       {"rung": "c-grpo-lr", "status": "finished", "updates": 20, "wall_s": 1000.0},
                       {"rung": "c-grpo-lr", "status": "failed", "updates": 40, "wall_s": 1.0},
                       {"rung": "b-lr", "status": "finished", "updates": 40, "wall_s": 9999.0}]}
    assert estimate_s(arm, ladder) == pytest.approx(20.0 * 60 + RUN_OVERHEAD_S)     # median of 10, 20, 50 s/update
    assert math.isnan(estimate_s(arm, {"runs": []}))


def _log(folder: Path, updates: int, status: str) -> None:
    folder.mkdir(parents=True)
    w = RunLogWriter(folder, {"source": "runner", "plan": {}, "seed": 0})
    for v in range(1, updates + 1):
        w.append(UpdateRecord(version=v, start_s=v, end_s=v + 1, train_step_s=1, weight_sync_s=0, tokens=1,
                              trajectories=1, staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0,
                              cost_sampler_usd=0, cost_trainer_usd=0))
    w.close(status)


def test_list_prints_the_order_estimates_and_state(learning, tmp_path: Path, capsys) -> None:
    _log(tmp_path / "s-mix-sc_mis_topp" / "seed0", 60, "finished")
    _log(tmp_path / "s-mix-grpo" / "seed0", 12, "stopped")
    assert learning.main(["--study", "dense", "--list", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line[:3].strip().isdigit()]
    assert len(rows) == 32
    assert "s-mix-sc_mis_topp/seed0" in rows[0] and rows[0].endswith("finished")
    assert "s-mix-grpo/seed0" in rows[1] and rows[1].endswith("partial (12 of 60 updates)")
    assert rows[2].endswith("new") and "s-mix-grpo_mis/seed0" in rows[20] and " 40 updates" in rows[20]
    assert any(line.startswith("estimated CPU hours:") for line in out)


# ---------------------------------------------------------------------------------------------- the verdict rules

def _run(rung: str, seed: int, *, n: int = 60, start: float = 0.4, end: float = 0.6, collapse: bool = False,
         signs: tuple[bool, bool, bool] | None = None, digest: str = "base", evals: dict[int, float] | None = None,
         k3_scale: float = 1.0) -> dict:
    """A finished run: flat k3 1e-3, no-tool-call 0, training reward 0.5; `collapse` (or `signs`: which of the
    three) makes k3 rise 10x, the no-tool-call share 0.9 and the reward 0.1 over its second half."""
    k3_up, ntc_up, tr_down = signs if signs is not None else (collapse,) * 3
    half = n // 2
    k3 = [1e-3] * half + [1e-2 if k3_up else 1e-3] * (n - half)
    ntc = [0.0] * half + [0.9 if ntc_up else 0.0] * (n - half)
    tr = [0.5] * half + [0.1 if tr_down else 0.5] * (n - half)
    ev = evals if evals is not None else {0: start, 40: (start + end) / 2, n: end}
    return {"rung": rung, "seed": seed, "status": "finished", "updates": n, "kl_k3": [k3_scale * k for k in k3],
            "no_tool_call_share": ntc,
            "train_reward": tr, "grad_norm": [1.0] * half + [3.0] * (n - half), "base_digest": digest,
            "evals": [{"version": v, "reward": r} for v, r in sorted(ev.items())]}


def test_collapse_signs_are_the_ladders() -> None:
    s = collapse_signs(_run("x", 0, collapse=True))
    assert s.collapsed and not s.stable and (s.k3_3x, s.ntc_50, s.halved) == (31, 31, 34)
    s = collapse_signs(_run("x", 0))
    assert s.stable and not s.collapsed and s.k3_3x is s.ntc_50 is s.halved is None


@pytest.mark.parametrize(("signs", "want"), [
    ([(True, True, True)] * 3, "collapses"),
    ([(True, True, True)] * 2 + [(False, False, False)], "partly collapses"),
    ([(False, False, False)] * 3, "stable"),
    ([(False, False, False)] * 2 + [(True, False, True)], "unsettled"),      # two signs are not a collapse
])
def test_arm_verdict(signs, want) -> None:
    assert arm_verdict([_run("x", i, signs=sg) for i, sg in enumerate(signs)])[0] == want


def test_arm_verdict_needs_10_updates() -> None:
    assert arm_verdict([_run("x", 0, n=8, evals={0: 0.4, 8: 0.5})])[0].startswith("no verdict")


@pytest.mark.parametrize(("lo", "hi", "want"), [
    (-0.04, 0.049, "equivalent"), (0.01, 0.03, "equivalent"), (0.06, 0.1, "different"), (-0.2, -0.01, "different"),
    (-0.1, 0.02, "inconclusive"), (-0.01, 0.051, "inconclusive"), (math.nan, math.nan, "inconclusive")])
def test_equivalence(lo, hi, want) -> None:
    assert equivalence(lo, hi) == want


def test_t_interval_by_hand() -> None:
    m, se, lo, hi = t_interval([0.1, 0.2])           # t(0.975, df 1) = 12.7062
    assert (m, se) == pytest.approx((0.15, 0.05)) and (lo, hi) == pytest.approx((0.15 - 0.63531, 0.15 + 0.63531),
                                                                                abs=1e-4)


def _by_seed(diffs: list[float], digests: list[str] | None = None) -> tuple[dict, dict]:
    a = {s: {"heldout_end": 0.5 + d, "base_digest": (digests or ["x"] * len(diffs))[s]} for s, d in enumerate(diffs)}
    b = {s: {"heldout_end": 0.5, "base_digest": "x"} for s in range(len(diffs))}
    return a, b


def test_paired_contrast_reaches_each_verdict() -> None:
    assert paired(*_by_seed([0.01, -0.01, 0.0, 0.02, -0.02]))["verdict"] == "equivalent"
    assert paired(*_by_seed([0.2, 0.25, 0.22, 0.18, 0.21]))["verdict"] == "different"
    assert paired(*_by_seed([0.1, -0.1, 0.05, -0.05, 0.0]))["verdict"] == "inconclusive"
    one = paired(*_by_seed([0.01]))
    assert one["verdict"] == "inconclusive" and one["pairs"] == 1
    mixed = paired(*_by_seed([0.01, -0.01, 0.3], digests=["x", "x", "other"]))
    assert mixed["other_base_seeds"] == [2] and mixed["pairs"] == 2 and mixed["seeds"] == [0, 1]


def _study(*, grpo_collapses: bool, sc_gain: float, hom_offset: list[float], grpo_hom_collapses: bool = False,
           ) -> list[dict]:
    runs = []
    for s in range(5):
        runs.append(_run("s-mix-sc_mis_topp", s, start=0.4, end=0.4 + sc_gain + 0.01 * (s - 2)))
        runs.append(_run("s-hom-sc_mis_topp", s, start=0.4, end=0.4 + sc_gain + 0.01 * (s - 2) - hom_offset[s]))
        runs.append(_run("s-mix-grpo", s, start=0.4, end=0.2 + 0.01 * s, collapse=grpo_collapses))
        runs.append(_run("s-hom-grpo", s, start=0.4, end=0.3, signs=(grpo_hom_collapses,) * 3 if s else (
            False, False, False)))
    for v in ("grpo_mis", "sc", "grpo_topp", "sc_mis"):
        runs += [_run(f"s-mix-{v}", s, n=40, start=0.4, end=0.45, evals={0: 0.4, 40: 0.45}) for s in range(3)]
    return runs


def _finding(v: dict, n: int) -> dict:
    return v["findings"][n - 1]


def test_the_three_findings_reproduced() -> None:
    v = verdicts(_study(grpo_collapses=True, sc_gain=0.2, hom_offset=[0.01, -0.01, 0.0, 0.005, -0.005]), "dense")
    rows = {r["arm"]: r for r in v["arms"]}
    assert rows["s-mix-grpo"]["verdict"] == "collapses" and rows["s-mix-sc_mis_topp"]["verdict"] == "stable"
    assert rows["s-mix-grpo"]["kl_growth"] == [pytest.approx(10.0)] * 5
    assert rows["s-mix-grpo"]["grad_norm_growth"] == [pytest.approx(3.0)] * 5
    assert rows["s-mix-sc"]["horizon"] == 40 and rows["s-mix-sc"]["seeds"] == [0, 1, 2]
    assert [_finding(v, i)["verdict"] for i in (1, 2, 3)] == ["reproduced"] * 3
    assert v["treatment"]["verdict"] == "does not hold" and v["treatment"]["ratio_by_seed"][0] == pytest.approx(1.0)
    assert _finding(v, 2)["sooner"]["verdict"] == "shown"        # homogeneous GRPO shows no sign: counted at 61
    con = {(c["a"], c["b"]): c for c in v["contrasts"]}
    assert con[("s-mix-sc", "s-mix-grpo")]["horizon"] == 40        # the key arm cut at the shorter arm's horizon
    assert con[("s-mix-sc", "s-mix-grpo")]["mean"] == pytest.approx(0.45 - (0.4 + 0.2 + 0.01) / 2)


def test_the_three_findings_can_fail() -> None:
    v = verdicts(_study(grpo_collapses=False, sc_gain=0.0, hom_offset=[0.1, -0.1, 0.05, -0.05, 0.0]), "dense")
    assert [_finding(v, i)["verdict"] for i in (1, 2, 3)] == ["not reproduced"] * 3
    assert _finding(v, 3)["contrast"]["verdict"] == "inconclusive"
    v = verdicts(_study(grpo_collapses=True, sc_gain=0.2, hom_offset=[0.1] * 5, grpo_hom_collapses=True), "dense")
    assert _finding(v, 3)["contrast"]["verdict"] == "different" and _finding(v, 3)["verdict"] == "not reproduced"
    # GRPO collapses on both fleets at the same update, except homogeneous seed 0 (no sign): sooner on 1 of 5 only
    assert _finding(v, 2)["sooner"]["verdict"] == "partly shown" and _finding(v, 2)["verdict"] == "partly reproduced"
    v = verdicts(_study(grpo_collapses=False, sc_gain=0.2, hom_offset=[0.0] * 5, grpo_hom_collapses=True), "dense")
    assert _finding(v, 2)["sooner"]["verdict"] == "not shown" and _finding(v, 2)["verdict"] == "not reproduced"
    assert min(_finding(v, 2)["sooner"]["diffs"]) < 0


def test_reevaluation_replaces_the_end_only_at_the_final_version() -> None:
    runs = _study(grpo_collapses=True, sc_gain=0.2, hom_offset=[0.0] * 5)
    final = {"base/tiny/150": {"reward": 0.3}}
    final |= {f"s-mix-sc_mis_topp/seed{s}": {"reward": 0.7, "version": 60} for s in range(5)}
    final |= {f"s-hom-sc_mis_topp/seed{s}": {"reward": 0.9, "version": 60} for s in range(5)}
    final |= {f"s-mix-grpo/seed{s}": {"reward": 0.1, "version": 60} for s in range(5)}
    final |= {f"s-mix-sc/seed{s}": {"reward": 0.0, "version": 40} for s in range(3)}
    v = verdicts(runs, "dense", final)
    con = {(c["a"], c["b"]): c for c in v["contrasts"]}
    assert con[("s-mix-sc_mis_topp", "s-hom-sc_mis_topp")]["mean"] == pytest.approx(-0.2)
    assert con[("s-mix-sc_mis_topp", "s-hom-sc_mis_topp")]["reevaluated"]
    assert not con[("s-mix-sc", "s-mix-grpo")]["reevaluated"]            # 40 vs 60: both from the periodic eval
    assert con[("s-mix-sc", "s-mix-grpo")]["mean"] == pytest.approx(0.45 - 0.305)      # GRPO at v40, seeds 0-2
    assert _finding(v, 1)["gain"] == pytest.approx(0.7 - 0.3)            # minus the base's re-evaluation
    # without re-evaluations (none yet, or not every seed's), the contrast is the periodic one's and says so
    plain = {(c["a"], c["b"]): c for c in verdicts(runs, "dense", {})["contrasts"]}
    assert not plain[("s-mix-sc_mis_topp", "s-hom-sc_mis_topp")]["reevaluated"]
    del final["s-hom-sc_mis_topp/seed4"]
    part = {(c["a"], c["b"]): c for c in verdicts(runs, "dense", final)["contrasts"]}
    assert not part[("s-mix-sc_mis_topp", "s-hom-sc_mis_topp")]["reevaluated"]


def test_rules_are_written_in_docs() -> None:
    doc = (ROOT / "docs" / "learning.md").read_text()
    assert RULES in doc


def test_treatment_ratio_per_seed() -> None:
    runs = [_run("s-mix-grpo", s, k3_scale=4.0 if s < 2 else 2.0) for s in range(3)]
    runs += [_run("s-hom-grpo", s) for s in range(3)] + [_run("s-hom-grpo", 3)]      # seed 3: no mixed pair
    t = verdicts(runs, "dense")["treatment"]
    assert t["ratio_by_seed"] == pytest.approx({0: 4.0, 1: 4.0, 2: 2.0}) and t["verdict"] == "partly holds"
    runs = [_run("s-mix-grpo", s, k3_scale=3.0) for s in range(3)] + [_run("s-hom-grpo", s) for s in range(3)]
    assert verdicts(runs, "dense")["treatment"]["verdict"] == "holds"
    runs[0]["base_digest"] = "another"
    assert sorted(verdicts(runs, "dense")["treatment"]["ratio_by_seed"]) == [1, 2]


def test_without_runs_nothing_is_tested_yet() -> None:
    v = verdicts([], "dense")
    assert [f["verdict"] for f in v["findings"]] == ["not tested yet"] * 3
    assert v["treatment"]["verdict"] == "not measured yet"
    one = verdicts([_run(k, 0) for k in ("s-mix-sc_mis_topp", "s-mix-grpo", "s-hom-sc_mis_topp", "s-hom-grpo")],
                   "dense")
    assert [f["verdict"] for f in one["findings"]] == ["not tested yet"] * 3      # one seed pair is not a test


def test_markdown_has_a_row_per_arm_and_the_findings() -> None:
    from mixfleet.studies.learning_study import markdown

    v = verdicts(_study(grpo_collapses=True, sc_gain=0.2, hom_offset=[0.01, -0.01, 0.0, 0.005, -0.005]), "dense")
    text = markdown(v)
    rows = [line for line in text.splitlines() if line.startswith("| s-")]
    assert len(rows) == len(STUDY["dense"]) + len(v["contrasts"])
    grpo = next(line for line in rows if line.startswith("| s-mix-grpo |"))
    assert "| 5 (5) |" in grpo and "x10.00 |" in grpo and "x3.00 |" in grpo and "90 %" in grpo
    assert grpo.endswith("| 5 / 0 | collapses |")
    assert text.count("**reproduced**") == 3


def _base(root: Path, weights: bytes = b"the base") -> str:
    """A stand-in base policy folder: its digest is what the study reads of it."""
    folder = root / f"base-{weights.hex()[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


def test_resume_runs_the_next_unfinished_runs_in_order(learning, tmp_path: Path, monkeypatch, capsys) -> None:
    import mixfleet.studies.runs as study_runs

    started: list = []
    monkeypatch.setattr(study_runs, "run_study", lambda runs, **kw: started.append((runs, kw)))
    base = _base(tmp_path / "cache")
    monkeypatch.setattr(learning, "base_policy", lambda model, steps: base if (model, steps) == ("tiny", 150) else "")
    evaluated: list = []
    monkeypatch.setattr(learning, "final_eval", lambda keys, seeds, args, out, log: evaluated.append((keys, out)))
    _log(tmp_path / "s-mix-sc_mis_topp" / "seed0", 60, "finished")
    res = tmp_path / "study.json"
    assert learning.main(["--study", "dense", "--resume", "--max-runs", "2", "--out", str(tmp_path),
                          "--results", str(res), "--final-results", str(tmp_path / "final.json")]) == 0
    (runs, kw), = started
    assert [r.name for r in runs] == ["s-mix-grpo/seed0", "s-hom-sc_mis_topp/seed0"]
    assert [r.run["updates"] for r in runs] == [60, 60] and kw["base_policy"] == base
    assert runs[0].overrides["groups.cpu-fp8.weight_noise"] == 0.5 and runs[0].overrides["trainer.loss"] == "grpo"
    assert "groups.cpu-fp8.weight_noise" not in runs[1].overrides and runs[1].plan == "learning-homog-bf16"
    assert runs[0].overrides["embedded.lr"] == 1.5e-4 and runs[0].overrides["embedded.eval_problems"] == 64
    assert kw["manifest_path"] == tmp_path / "study-dense.json" and kw["settings"].resume
    doc = json.loads(res.read_text())
    assert [r["rung"] for r in doc["runs"]] == ["s-mix-sc_mis_topp"] and doc["rules"] == RULES
    assert "1 of 32 runs finished" in capsys.readouterr().out
    # the finished runs re-evaluated (512 x 2) in the same call, while their folders are here
    assert evaluated == [([a.key for a in STUDY["dense"]], tmp_path)]
    assert learning.main(["--study", "dense", "--resume", "--max-runs", "1", "--out", str(tmp_path), "--results",
                          str(res), "--final-results", str(tmp_path / "final.json"), "--no-final-eval"]) == 0
    assert len(evaluated) == 1


def test_arms_picks_the_runs_of_those_arms_in_order(learning, tmp_path: Path, monkeypatch) -> None:
    import mixfleet.studies.runs as study_runs

    started: list = []
    monkeypatch.setattr(study_runs, "run_study", lambda runs, **kw: started.append(runs))
    monkeypatch.setattr(learning, "final_eval", lambda *a: None)
    base = _base(tmp_path / "cache")
    monkeypatch.setattr(learning, "base_policy", lambda model, steps: base)
    args = ["--study", "dense", "--resume", "--out", str(tmp_path), "--results", str(tmp_path / "s.json"),
            "--final-results", str(tmp_path / "f.json")]
    assert learning.main([*args, "--arms", "s-hom-grpo,s-hom-sc_mis_topp", "--max-runs", "3"]) == 0
    assert [r.name for r in started[0]] == ["s-hom-sc_mis_topp/seed0", "s-hom-grpo/seed0", "s-hom-sc_mis_topp/seed1"]
    with pytest.raises(SystemExit, match="--arms: t-grpo not in study dense"):
        learning.main([*args, "--arms", "t-grpo"])



def test_runs_recorded_from_the_base_count_as_done_and_another_base_is_refused(learning, tmp_path: Path,
                                                                              monkeypatch, capsys) -> None:
    """The study's runs live on in the results file when their folders are gone (another machine): those recorded
    finished from this base are not run again; a base whose weights differ from the recorded runs' (pretraining is
    not bit-reproducible across CPUs) is refused naming both digests, before anything runs."""
    import mixfleet.studies.runs as study_runs

    started: list = []
    monkeypatch.setattr(study_runs, "run_study", lambda runs, **kw: started.append(runs))
    monkeypatch.setattr(learning, "final_eval", lambda *a: None)
    base = _base(tmp_path / "cache")
    digest = learning.weights_digest(base)
    recorded = []
    for rung, status in (("s-mix-sc_mis_topp", "finished"), ("s-mix-grpo", "finished"),
                         ("s-hom-sc_mis_topp", "stopped")):
        gone = tmp_path / "gone" / rung
        _log(gone, 60, status)                  # run here, read into the results, then its folder is lost
        recorded.append({**learning.read_run(gone, rung, 0), "base_digest": digest})
    res = tmp_path / "study.json"
    res.write_text(json.dumps({"runs": recorded}))
    args = ["--study", "dense", "--resume", "--max-runs", "2", "--out", str(tmp_path / "runs"), "--results",
            str(res), "--final-results", str(tmp_path / "final.json")]
    monkeypatch.setattr(learning, "base_policy", lambda model, steps: base)
    assert learning.main(args) == 0
    assert [r.name for r in started[0]] == ["s-hom-sc_mis_topp/seed0", "s-hom-grpo/seed0"]   # not the two finished
    other = _base(tmp_path / "cache", b"rebuilt elsewhere")
    monkeypatch.setattr(learning, "base_policy", lambda model, steps: other)
    with pytest.raises(SystemExit, match=rf"weights digest {learning.weights_digest(other)}\) is not the base of "
                                         rf"the 3 run\(s\) already in the results \(digest {digest}\)"):
        learning.main(args)
    assert len(started) == 1                                                      # nothing more was started
    # --list says so too, for the base found here (kept or cached; --list trains none)
    listed = {}
    for here in (base, other):
        monkeypatch.setattr(learning, "found_base", lambda model, steps, here=here: here)
        capsys.readouterr()
        assert learning.main(["--study", "dense", "--list", "--out", str(tmp_path / "runs"),
                              "--results", str(res)]) == 0
        listed[here] = [line for line in capsys.readouterr().out.splitlines() if line[:3].strip().isdigit()]
    assert listed[base][0].endswith("finished (in the results)") and listed[base][2].endswith("new")
    assert listed[other][0].endswith("new")                                       # runs of another base: not done


def test_the_table_says_what_decided_each_finding() -> None:
    """The study's markdown names the figures behind each finding's verdict (RULES: "with the figures that
    decided"), and an interval the data cannot give yet reads as missing, not as nan."""
    from mixfleet.studies.learning_study import markdown

    runs = _study(grpo_collapses=True, sc_gain=0.2, hom_offset=[0.0] * 5)
    text = markdown(verdicts(runs, "dense"))
    f1 = next(ln for ln in text.splitlines() if ln.startswith("- 1."))
    g = _finding(verdicts(runs, "dense"), 1)
    assert f"gain {g['gain']:+.3f}, 95 % [{g['gain_lo']:+.3f}, {g['gain_hi']:+.3f}], 5 seeds" in f1
    assert "minus GRPO" in f1 and "pairs)" in f1
    one = markdown(verdicts([r for r in runs if r["seed"] == 0], "dense"))
    assert "nan" not in one and "no interval, 1 pair" in one


def test_a_general_re_evaluation_never_writes_into_the_eval_splits_file(learning) -> None:
    """`--final-split general --final-results X.json` wrote the general split's evaluations into X.json, the eval
    split's file the study's verdicts read (a session lost its general figures that way and nearly its eval ones):
    the general split goes to X_general.json beside it, given or default."""
    f = learning.final_results_path
    assert f("benchmarks/results/r2_final.json", True, "eval") == "benchmarks/results/r2_final.json"
    assert f("benchmarks/results/r2_final.json", True, "general") == "benchmarks/results/r2_final_general.json"
    assert f(None, True, "general") == str(learning.STUDY_FINAL_RESULTS.with_name(
        f"{learning.STUDY_FINAL_RESULTS.stem}_general.json"))
    assert f(None, False, "eval") == str(learning.FINAL_RESULTS)
