"""Is the mismatch model identifiable across plans (issue 27 item 6)? Calibrate on a real CPU run of one plan,
predict another plan, and compare with that plan's real runs.

Two pairs of plans (`--pair`). replan: a = data/plans/replan-cpu-static.toml (cpu-fast x1: BF16 weights, FP32
kernel; cpu-slow x2: BF16 kernel; capacity-proportional routing), b = data/plans/replan-cpu-xval.toml (the same
groups at fast x2, slow x1, least outstanding tokens). tiny: a = data/plans/tiny-cpu.toml (bf16, fp8, nvfp4 x1
each), b = data/plans/tiny-cpu-xval.toml (bf16 x2, fp8 x1, least outstanding tokens). Several real runs of each
(seeds 0-3, 16 updates each, one at a time on an otherwise quiet machine), e.g. for replan's plan a:

    printf 'base = "replan-cpu-static"\nseed = 1\n' > /tmp/static-s1.toml
    mixfleet run /tmp/static-s1.toml --out /work/runs/replan/static-s1 --updates 16 --eval-every 0 --quiet

(folders PREFIX-sSEED under /work/runs/replan: static / xval for replan, tiny / tinyx for tiny).

What it reports:
- every ordered pair (one run of plan a -> one run of plan b, and b -> a): `calibrate` on the first run, `fidelity`
  of the other plan as its run ran (seed, updates, replica counts, measured workload) against that run. Per group:
  KL (k3) relative error (goal: within 25%), the share of tokens with a ratio outside [0.2, 5] predicted / measured
  (goal: within 2x), and the time per update (goal: within 5%);
- each single-run calibration against the other plan's mean over its runs (the plan's KL: what a model of the plan
  can be held to when one run of it is as far from the next as the noise floor below);
- the noise floor: the runs of one plan (same plan, other seeds) against each other, with no model at all;
- pooled: `calibrate` on all runs of one plan, predicting each run of the other and their mean;
- whether the measured KL lies in the prediction's 95% interval, from the calibration run's autocorrelation-robust
  stderr (`stale_kl_line`), and each group's KL relative to the fleet's (the groups' part of the mismatch);
- run by run, the fleet's KL against the entropy of the trained tokens and the mean reward (what moves the level).

    nice -n 10 python benchmarks/mismatch_transfer.py --pair replan|tiny [--a DIR ...] [--b DIR ...]
    python benchmarks/mismatch_transfer.py --pair replan --table     # the table of the results file

Writes benchmarks/results/mismatch_transfer_PAIR.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.calibration.fit import calibrate
from mixfleet.costmodel.calibration.mismatch_fit import stale_kl_line
from mixfleet.costmodel.calibration.record import Calibration
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.twin.calibrated import fidelity, run_metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = Path("/work/runs/replan")
# the plan pairs: plan a, plan b, the run folders' default prefixes (RUNS / f"{prefix}-s{seed}")
PAIRS = {"replan": ("replan-cpu-static", "replan-cpu-xval", "static", "xval"),
         "tiny": ("tiny-cpu", "tiny-cpu-xval", "tiny", "tinyx")}
KL_GOAL, EXT_GOAL, TIME_GOAL = 0.25, 2.0, 0.05


def fitted_mismatch(cal: Calibration) -> dict[str, Any]:
    return {g.name: {p: {"value": getattr(g, p).value, "stderr": getattr(g, p).stderr, "note": getattr(g, p).note}
                     for p in ("kl_k3", "kl_growth_per_staleness", "extreme_share", "extreme_growth_per_staleness")}
            for g in cal.groups}


def check(cal: Calibration, plan: Path, run: Path) -> dict[str, Any]:
    """fidelity of `plan` against `run` with `cal`: per-group KL / extreme share, time per update, the goals."""
    rep = fidelity(plan, run, cal)
    rows = {r.metric: r for r in rep.rows}
    groups = sorted(m.split("[", 1)[1].rstrip("]") for m in rows if m.startswith("kl_k3["))
    per: dict[str, Any] = {}
    for g in groups:
        kl, ex = rows[f"kl_k3[{g}]"], rows[f"extreme_share[{g}]"]
        if not (math.isfinite(kl.measured) and kl.measured > 0):    # a group with no replica in that run
            continue
        ratio = ex.predicted / ex.measured if ex.measured > 0 else math.nan
        per[g] = {"kl_measured": kl.measured, "kl_predicted": kl.predicted,
                  "kl_rel_error": kl.predicted / kl.measured - 1.0 if kl.measured > 0 else math.nan,
                  "extreme_measured": ex.measured, "extreme_predicted": ex.predicted, "extreme_ratio": ratio}
    t = rows["time_per_update_mean_s"]
    st = rows["staleness_mean"]
    goals = {"kl_within_25pct": all(abs(v["kl_rel_error"]) <= KL_GOAL for v in per.values()),
             "extreme_within_2x": all(1 / EXT_GOAL <= v["extreme_ratio"] <= EXT_GOAL for v in per.values()),
             "time_per_update_within_5pct": abs(t.error) <= TIME_GOAL}
    return {"groups": per, "time_per_update": {"measured_s": t.measured, "predicted_s": t.predicted,
                                               "rel_error": t.error},
            "staleness": {"measured": st.measured, "predicted": st.predicted, "error": st.error},
            "kl_overall": {"measured": rows["kl_k3"].measured, "predicted": rows["kl_k3"].predicted},
            "extreme_overall": {"measured": rows["extreme_share"].measured,
                                "predicted": rows["extreme_share"].predicted},
            "goals": goals, "notes": list(rep.notes)}


def group_means(log: RunLog) -> dict[str, dict[str, float]]:
    """Per group, the token-weighted KL and extreme share of a run log's updates."""
    out = {}
    for name, x in log.groups.groupby("group"):
        w = x["tokens_trained"].astype(float)
        ok = w > 0
        if not ok.any():       # a group with no replica in this run (tiny-cpu-xval's nvfp4)
            continue
        out[str(name)] = {"kl": float((x["kl_k3"][ok] * w[ok]).sum() / w[ok].sum()),
                          "extreme": float((x["extreme_share"][ok] * w[ok]).sum() / w[ok].sum())}
    return out


def robust_rel_stderr(log: RunLog) -> dict[str, float]:
    """Per group, the relative stderr of a run's KL at its own staleness, the updates' autocorrelation counted
    (`stale_kl_line(...).stderr_robust / value`)."""
    g = log.groups
    out = {}
    for name in sorted(g["group"].unique()):
        line = stale_kl_line(g[g["group"] == name])
        if line is not None and line.value > 0:
            out[str(name)] = line.stderr_robust / line.value
    return out


def run_figures(d: Path) -> dict[str, Any]:
    """What a run measured: per group KL and extreme share (and the robust relative stderr of its KL), its time
    per update, the trainer's pace (trained tokens per second of its step: how fast the shared machine was), the
    trained tokens' entropy and the mean reward."""
    m = run_metrics(d)
    log = RunLog.open(d)
    up = log.updates
    tok = up["tokens"].astype(float)
    return {"groups": group_means(log), "kl_fleet": m["kl_k3"], "time_per_update_s": m["time_per_update_mean_s"],
            "entropy": float((up["entropy"] * tok).sum() / tok.sum()),
            "reward_mean": float((up["reward_mean"] * up["trajectories"]).sum() / up["trajectories"].sum()),
            "kl_rel_stderr_robust": robust_rel_stderr(log), "updates": int(len(up)),
            "trainer_tokens_per_s": float(tok.sum() / up["train_step_s"].sum())}


def vs_groups_mean(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """Per group, the error of its KL relative to the mean of the groups' KL, predicted against measured: the
    part of the mismatch that is the groups' and not the trainer's drift, which all groups share."""
    mp, mm = float(np.mean(list(predicted.values()))), float(np.mean(list(measured.values())))
    return {g: (predicted[g] / mp) / (measured[g] / mm) - 1.0 for g in predicted}


def interval(predicted: dict[str, float], measured: dict[str, float], rel: dict[str, float]) -> dict[str, Any]:
    """Whether each group's measured KL lies in the prediction's 95% interval: predicted x (1 +- 2 sqrt(2) r),
    r the calibration run's robust relative stderr, counted twice (the predicted run is one draw with the same
    spread as the calibration run)."""
    z = {g: (measured[g] / p - 1.0) / (math.sqrt(2.0) * rel[g])
         for g, p in predicted.items() if g in rel and rel[g] > 0 and p > 0}
    return {"kl_z": z, "kl_in_95pct_interval": bool(z) and all(abs(x) <= 2.0 for x in z.values())}


def rel_spread(values: list[float]) -> float:
    """Coefficient of variation (sample sd / mean) of a list of positive values."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.std(ddof=1) / v.mean()) if len(v) > 1 and v.mean() > 0 else math.nan


def noise_floor(figs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Runs of one plan against each other (no model): per group KL relative difference and extreme-share ratio
    of every ordered pair, and the runs' coefficient of variation."""
    names = list(figs)
    groups = sorted(set.intersection(*(set(f["groups"]) for f in figs.values())))
    pairs = []
    for i in names:
        for j in names:
            if i == j:
                continue
            gi, gj = figs[i]["groups"], figs[j]["groups"]
            ki, kj = {g: gi[g]["kl"] for g in groups}, {g: gj[g]["kl"] for g in groups}
            pairs.append({"pair": [i, j], "kl_rel_diff": {g: kj[g] / ki[g] - 1.0 for g in groups},
                          "kl_vs_fleet_rel_error": vs_groups_mean(kj, ki),   # run j against run i
                          "extreme_ratio": {g: gj[g]["extreme"] / gi[g]["extreme"] if gi[g]["extreme"] > 0
                                            else math.nan for g in groups},
                          "time_rel_diff": figs[j]["time_per_update_s"] / figs[i]["time_per_update_s"] - 1.0,
                          **interval(ki, kj, figs[i]["kl_rel_stderr_robust"])})
    return {"pairs": pairs, "summary": summarize_pairs(pairs, "kl_rel_diff", "time_rel_diff"),
            "cv": {g: {"kl": rel_spread([f["groups"][g]["kl"] for f in figs.values()]),
                       "extreme": rel_spread([f["groups"][g]["extreme"] for f in figs.values()])} for g in groups},
            "cv_time_per_update": rel_spread([f["time_per_update_s"] for f in figs.values()])}


def summarize_pairs(pairs: list[dict[str, Any]], kl_key: str = "kl_rel_error",
                    time_key: str = "time_rel_error") -> dict[str, Any]:
    """Share of pairs within each goal (every group at once), and the median / max absolute errors."""
    kl = [max(abs(e) for e in p[kl_key].values()) for p in pairs]
    ex = [max(max(x, 1 / x) if x > 0 else math.inf for x in p["extreme_ratio"].values()) for p in pairs]
    tt = [abs(p[time_key]) for p in pairs if math.isfinite(p[time_key])]
    n = len(pairs)
    rel = [max(abs(e) for e in p["kl_vs_fleet_rel_error"].values()) for p in pairs if "kl_vs_fleet_rel_error" in p]
    cover = [p["kl_in_95pct_interval"] for p in pairs if "kl_in_95pct_interval" in p]
    return {"pairs": n, "kl_vs_fleet_worst_group_abs_error_max": max(rel) if rel else math.nan,
            "kl_in_95pct_interval": sum(cover) / len(cover) if cover else math.nan,
            "kl_within_25pct": sum(e <= KL_GOAL for e in kl) / n if n else math.nan,
            "extreme_within_2x": sum(x <= EXT_GOAL for x in ex) / n if n else math.nan,
            "time_within_5pct": sum(t <= TIME_GOAL for t in tt) / len(tt) if tt else math.nan,
            "all_three": sum(a <= KL_GOAL and b <= EXT_GOAL and abs(p[time_key]) <= TIME_GOAL
                             for a, b, p in zip(kl, ex, pairs, strict=True)) / n if n else math.nan,
            "kl_worst_group_abs_error_median": float(np.median(kl)) if kl else math.nan,
            "kl_worst_group_abs_error_max": max(kl) if kl else math.nan,
            "extreme_worst_group_factor_median": float(np.median(ex)) if ex else math.nan,
            "time_abs_error_median": float(np.median(tt)) if tt else math.nan}


def against(c: dict[str, Any], figs: dict[str, dict[str, Any]], calibrated: set[str]) -> dict[str, Any]:
    """A check's predictions against the mean of the predicted plan's runs (the groups the calibration measured)."""
    groups = {g: v for g, v in c["groups"].items() if g in calibrated}
    mean = {g: {k: float(np.mean([f["groups"][g][k] for f in figs.values()])) for k in ("kl", "extreme")}
            for g in groups}
    t = float(np.mean([f["time_per_update_s"] for f in figs.values()]))
    return {"kl_rel_error": {g: v["kl_predicted"] / mean[g]["kl"] - 1.0 for g, v in groups.items()},
            "extreme_ratio": {g: v["extreme_predicted"] / mean[g]["extreme"] if mean[g]["extreme"] > 0 else math.nan
                              for g, v in groups.items()},
            "time_rel_error": c["time_per_update"]["predicted_s"] / t - 1.0, "measured_mean": mean,
            "time_per_update_mean_s": t}


def compact(c: dict[str, Any], calibrated: set[str]) -> dict[str, Any]:
    """A check, short, over the groups the calibration measured (`calibrated`); a group it did not (no replica in
    the calibration run: priors) is reported apart, under `from_priors`. `kl_vs_fleet_rel_error`: the error of each
    group's KL relative to the mean of the groups' KL (predicted against measured): the part of the mismatch that
    is the groups' and not the trainer's drift, which all groups share."""
    gs = {g: v for g, v in c["groups"].items() if g in calibrated}
    return {"kl_rel_error": {g: v["kl_rel_error"] for g, v in gs.items()},
            "kl_vs_fleet_rel_error": vs_groups_mean({g: v["kl_predicted"] for g, v in gs.items()},
                                                    {g: v["kl_measured"] for g, v in gs.items()}),
            "extreme_ratio": {g: v["extreme_ratio"] for g, v in gs.items()},
            "from_priors": {g: v for g, v in c["groups"].items() if g not in calibrated},
            "time_rel_error": c["time_per_update"]["rel_error"], "groups": c["groups"],
            "time_per_update": c["time_per_update"], "staleness": c["staleness"]}


def fmt_summary(s: dict[str, Any]) -> str:
    return (f"{s['pairs']} pairs: KL within 25% {s['kl_within_25pct']:.0%}, outside [0.2, 5] within 2x "
            f"{s['extreme_within_2x']:.0%}, time within 5% {s['time_within_5pct']:.0%}, all three "
            f"{s['all_three']:.0%}; worst group's |KL error| median {s['kl_worst_group_abs_error_median']:.0%} "
            f"(max {s['kl_worst_group_abs_error_max']:.0%}), extreme factor median "
            f"{s['extreme_worst_group_factor_median']:.2f}x, |time error| median {s['time_abs_error_median']:.1%}"
            + (f"; group KL / fleet KL: worst error {s['kl_vs_fleet_worst_group_abs_error_max']:.0%}"
               if math.isfinite(s["kl_vs_fleet_worst_group_abs_error_max"]) else "")
            + (f"; measured KL in the prediction's 95% interval (every group): {s['kl_in_95pct_interval']:.0%}"
               if math.isfinite(s["kl_in_95pct_interval"]) else ""))


def table(res: dict[str, Any]) -> str:
    out = []
    for plan, nf in res["noise_floor"].items():
        out.append(f"noise floor, plan {plan} (runs against each other, no model): " + fmt_summary(nf["summary"])
                   + "; run-to-run cv " + ", ".join(f"{g} KL {v['kl']:.0%} extreme {v['extreme']:.0%}"
                                                     for g, v in nf["cv"].items())
                   + f", time/update {nf['cv_time_per_update']:.1%}")
    out.append("trainer pace (trained tokens/s of its step; the host's CPU is shared with the samplers): " + "; ".join(
        f"plan {k} " + ", ".join(f"{f['trainer_tokens_per_s']:.0f}" for f in fs.values()) for k, fs in
        res["runs"].items()))
    kv = res.get("kl_vs_entropy")
    if kv:
        out.append(f"run by run, log KL against entropy: r = {kv['corr_log_kl_entropy']:.2f}, against reward: r = "
                   f"{kv['corr_log_kl_reward']:.2f}; " + "; ".join(
                       f"plan {k} KL {np.mean(kv['kl_fleet'][k]):.4f} at entropy {np.mean(kv['entropy'][k]):.3f}"
                       for k in kv["kl_fleet"]))
    for direction, d in res["directions"].items():
        out.append(f"{direction}, one run -> one run: " + fmt_summary(d["summary"]))
        out.append(f"{direction}, one run -> the plan's mean: " + fmt_summary(d["summary_vs_mean"]))
        prior_groups = {g for p in d["pairs"] for g in p.get("from_priors", {})}
        for g in sorted(prior_groups):
            errs = [p["from_priors"][g]["kl_rel_error"] for p in d["pairs"] if g in p.get("from_priors", {})]
            out.append(f"{direction}: {g} has no replica in the calibration runs, so its priors predict it: KL "
                       f"error {min(errs):+.0%} .. {max(errs):+.0%} (left out of the figures above)")
        p = d["pooled_vs_mean"]
        out.append(f"{direction}, pooled -> the plan's mean: KL " + ", ".join(
            f"{g} {e:+.0%}" for g, e in p["kl_rel_error"].items()) + "; outside [0.2, 5] " + ", ".join(
            f"{g} {x:.2f}x" for g, x in p["extreme_ratio"].items()) + f"; time/update {p['time_rel_error']:+.1%}")
    out.append("\n| calibrated on | predicted | KL error per group | group KL / fleet KL error | outside [0.2, 5] "
               "ratio | time/update error |")
    out.append("|---|---|---|---|---|---|")
    for d in res["directions"].values():
        for p in d["pairs"]:
            out.append(f"| {Path(p['pair'][0]).name} | {Path(p['pair'][1]).name} | " + ", ".join(
                f"{e:+.0%}" for e in p["kl_rel_error"].values()) + " | " + ", ".join(
                f"{e:+.1%}" for e in p["kl_vs_fleet_rel_error"].values()) + " | " + ", ".join(
                f"{x:.2f}x" for x in p["extreme_ratio"].values()) + f" | {p['time_rel_error']:+.1%} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="replan",
                    help="replan: replan-cpu-static (a) and replan-cpu-xval (b), two groups of one format that differ "
                         "in kernel; tiny: tiny-cpu (a) and tiny-cpu-xval (b), three formats (bf16, fp8, nvfp4)")
    ap.add_argument("--a", type=Path, nargs="+", help="real runs of plan a, any seed (default: the pair's "
                    f"{RUNS}/PREFIX-s0 .. -s3 that exist)")
    ap.add_argument("--b", type=Path, nargs="+", help="real runs of plan b, any seed (default: as --a)")
    ap.add_argument("--results", type=Path, help="results file (default: benchmarks/results/"
                    "mismatch_transfer_PAIR.json; the 40-update runs: mismatch_transfer_replan_40.json)")
    ap.add_argument("--table", action="store_true", help="print the table of the results file and stop")
    args = ap.parse_args()
    plan_a, plan_b, pre_a, pre_b = PAIRS[args.pair]
    out = args.results or RESULTS / f"mismatch_transfer_{args.pair}.json"
    plans = {"a": ROOT / "data" / "plans" / f"{plan_a}.toml", "b": ROOT / "data" / "plans" / f"{plan_b}.toml"}
    if args.table:
        print(table(json.loads(out.read_text())))
        return
    for k, pre in (("a", pre_a), ("b", pre_b)):
        if getattr(args, k) is None:
            setattr(args, k, [d for d in (RUNS / f"{pre}-s{s}" for s in range(4)) if d.exists()])
            if not getattr(args, k):
                raise SystemExit(f"[mismatch_transfer] no runs of plan {k} under {RUNS}/{pre}-s*; see the module doc")
    runs = {"a": list(args.a), "b": list(args.b)}
    for k, ds in runs.items():
        for d in ds:
            why = RunLog.not_a_run_log(d)
            if why is not None:
                raise SystemExit(f"[mismatch_transfer] a run of plan {k} ({d}): not a run log ({why}); see the "
                                 "module doc for the commands that make them")
    figs = {k: {str(d): run_figures(d) for d in ds} for k, ds in runs.items()}
    res: dict[str, Any] = {
        "benchmark": "mismatch_transfer", "plans": {k: str(p.relative_to(ROOT)) for k, p in plans.items()},
        "runs": figs, "goals": {"kl_rel": KL_GOAL, "extreme_ratio": EXT_GOAL, "time_rel": TIME_GOAL},
        "pair": args.pair,
        "command": f"nice -n 10 python benchmarks/mismatch_transfer.py --pair {args.pair} --a "
                   + " ".join(map(str, args.a)) + " --b " + " ".join(map(str, args.b)),
        "noise_floor": {k: noise_floor(f) for k, f in figs.items()}, "directions": {}, "fits": {}}
    for src, dst in (("a", "b"), ("b", "a")):
        pairs, vs_mean = [], []
        for d in runs[src]:
            cal = calibrate([d])
            res["fits"][str(d)] = fitted_mismatch(cal)
            rel = figs[src][str(d)]["kl_rel_stderr_robust"]
            res["fits"][str(d)]["kl_at_run_staleness_rel_stderr_robust"] = rel
            last = None
            for t in runs[dst]:
                last = check(cal, plans[dst], t)
                kl = {g: v for g, v in last["groups"].items() if g in rel}
                pairs.append({"pair": [str(d), str(t)], **compact(last, set(rel)),
                              **interval({g: v["kl_predicted"] for g, v in kl.items()},
                                         {g: v["kl_measured"] for g, v in kl.items()}, rel)})
                print(f"[mismatch_transfer] {Path(d).name} -> {Path(t).name}: KL "
                      + ", ".join(f"{g} {e:+.0%}" for g, e in pairs[-1]["kl_rel_error"].items())
                      + "; extreme " + ", ".join(f"{g} {x:.2f}x" for g, x in pairs[-1]["extreme_ratio"].items())
                      + f"; time {pairs[-1]['time_rel_error']:+.1%}", flush=True)
            assert last is not None
            vs_mean.append({"pair": [str(d), f"plan {dst} mean"], **against(last, figs[dst], set(rel))})
        pooled = calibrate(runs[src])
        cal_groups = {g.name for g in pooled.groups}
        res["fits"][f"pooled {src}"] = fitted_mismatch(pooled)
        pooled_checks = [check(pooled, plans[dst], t) for t in runs[dst]]
        res["directions"][f"{src} -> {dst}"] = {
            "pairs": pairs, "summary": summarize_pairs(pairs), "vs_mean": vs_mean,
            "summary_vs_mean": summarize_pairs(vs_mean),
            "pooled": [{"pair": [f"plan {src} pooled", str(t)], **compact(c, cal_groups)}
                       for t, c in zip(runs[dst], pooled_checks, strict=True)],
            "pooled_vs_mean": against(pooled_checks[-1], figs[dst], cal_groups)}
    every = [f for fs in figs.values() for f in fs.values()]
    if len(every) >= 3:
        lk = np.log([f["kl_fleet"] for f in every])
        res["kl_vs_entropy"] = {
            "corr_log_kl_entropy": float(np.corrcoef(lk, [f["entropy"] for f in every])[0, 1]),
            "corr_log_kl_reward": float(np.corrcoef(lk, [f["reward_mean"] for f in every])[0, 1]),
            "entropy": {k: [f["entropy"] for f in fs.values()] for k, fs in figs.items()},
            "kl_fleet": {k: [f["kl_fleet"] for f in fs.values()] for k, fs in figs.items()},
            "note": "over every run of both plans: the fleet's KL (log) against the trained tokens' entropy and the "
                    "mean reward, run by run"}
    res["time_utc"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    res["load_avg_1m"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(res), indent=1))
    print(table(res))


if __name__ == "__main__":
    main()
