"""The learning study of issue 41 as data, and its verdict rules as code (fixed before any of its runs).

The study (`STUDY`): the seed's six loss variants (studies/ablation.py `VARIANTS`) on the treatment (mixed) fleet,
GRPO and SC + MIS + top-p also on a homogeneous bf16 fleet, on the dense model; on the MoE the four key arms and
SC + MIS + top-p with routing replayed. Every arm of a model starts from that model's one base (`pretrain_steps`;
each run records its base's weight digest), at the learning rate `STUDY_LR`, with the same periodic held-out
evaluation (`STUDY_EVAL`). benchmarks/learning.py runs it (`--study dense|moe [--list] [--resume]`): each arm is
a rung of its RUNGS table under its own key (prefix "s-" dense, "m-" MoE: no collision with the ladder's keys).

    treatment fleet  tiny-cpu (tiny-moe-cpu) with emulated kernel error on the fp8 / nvfp4 groups (TREATMENT_NOISE);
                     its k3 measured against one fp32 group (b-lr, learning_treatment.json); against the
                     bf16 fleet below it is measured by the study's first runs
    homogeneous      learning-homog-bf16 (-moe): tiny-cpu's bf16 group alone, three replicas

The verdict rules (`RULES`, applied by `verdicts`): written down on `RULES_FIXED`, before the study's first run,
and quoted verbatim in docs/learning.md. The collapse signs are the ones docs/learning.md's ladder findings use
(`collapse_signs`, also imported by benchmarks/check_learning_docs.py: one definition).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixfleet.studies.ablation import LABELS, variant
from scipy.special import stdtrit  # the t distribution's quantile (scipy.stats imports twice as slowly)

# The treatment (issue 41): tiny-cpu's fp8 / nvfp4 groups alone are barely further from the trainer than one fp32
# group two versions behind (the mixed / homogeneous k3 of c-grpo-lr / b-lr: 0.89-1.38x). The embedded engine's
# emulated kernel error on those two groups makes the mixed fleet's mismatch exceed the homogeneous one's, as
# the seed's did (~4.7x); its size is measured, not assumed (benchmarks/results/learning_treatment.json).
TREATMENT_NOISE = {"groups.cpu-fp8.weight_noise": 0.5, "groups.cpu-nvfp4.weight_noise": 0.9}

STUDY_LR = 1.5e-4                       # the learning setting (docs/learning.md: the rate the async fleets learn at)
STUDY_EVAL = {"every": 10, "problems": 64, "samples": 2}    # periodic held-out evaluation of every arm
KEY_VARIANTS = ("sc_mis_topp", "grpo")  # the four key arms: these two, each on the mixed and the homogeneous fleet
KEY_SEEDS, OTHER_SEEDS = (0, 1, 2, 3, 4), (0, 1, 2)
KEY_UPDATES, OTHER_UPDATES = 60, 40
FIRST_SEEDS = 3                         # the key arms' seeds 0-2 run first, then their seeds 3-4, then the rest
RUN_OVERHEAD_S = 15.0                   # per run beyond its log's wall: child + Ray start and the start gap (runs/treat
                                        # manifest: child wall - log wall 7-14 s; start gap 5 s)
RULES_FIXED = "2026-12-07"

MODELS = {"dense": ("tiny", 150), "moe": ("tiny-qwen3-moe", 300)}    # study -> (model, its base's pretrain steps)
PLANS = {("dense", "mixed"): "tiny-cpu", ("dense", "homogeneous"): "learning-homog-bf16",
         ("moe", "mixed"): "tiny-moe-cpu", ("moe", "homogeneous"): "learning-homog-bf16-moe",
         ("moe", "mixed-replay"): "tiny-moe-cpu-replay"}
# existing ladder rungs (benchmarks/results/learning.json) whose measured wall per update estimates an arm's: the same
# model and fleet size (the homogeneous bf16 x 3 has no measured rung yet: the mixed fleet's and one fp32 group's)
LIKE = {("dense", "mixed"): ("c-lr", "c-grpo-lr"),
        ("dense", "homogeneous"): ("c-lr", "c-grpo-lr", "b-lr", "b-c-lr"),
        ("moe", "mixed"): ("d-c300", "d-c300-grpo"),
        ("moe", "homogeneous"): ("d-c300", "d-c300-grpo", "d-b300", "d-b300-c"),
        ("moe", "mixed-replay"): ("d-c300-replay",)}


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One arm of the study: a loss variant on a fleet of a model, its seeds and horizon."""

    key: str                          # the rung key (benchmarks/learning.py RUNGS), e.g. "s-mix-grpo"
    study: str                        # "dense" | "moe"
    fleet: str                        # "mixed" | "homogeneous" | "mixed-replay" (the MoE's routing replayed)
    variant: str                      # studies/ablation.py VARIANTS key
    seeds: tuple[int, ...]
    updates: int
    key_arm: bool = False             # one of the four key arms (5 seeds, 60 updates on the dense model)

    @property
    def model(self) -> str:
        return MODELS[self.study][0]

    @property
    def pretrain_steps(self) -> int:
        return MODELS[self.study][1]

    @property
    def plan(self) -> str:
        return PLANS[(self.study, self.fleet)]

    @property
    def like(self) -> tuple[str, ...]:
        return LIKE[(self.study, self.fleet)]

    @property
    def label(self) -> str:
        fleet = {"mixed": "treatment (mixed) fleet", "homogeneous": "homogeneous bf16 fleet",
                 "mixed-replay": "treatment (mixed) fleet, routing replayed"}[self.fleet]
        return (f"study {self.study}: {LABELS[self.variant]}, {fleet}, lr {STUDY_LR:g}, "
                f"{self.updates} updates, {self.pretrain_steps}-step base")

    @property
    def overrides(self) -> dict[str, Any]:
        """The plan overrides: the variant's loss, and on the mixed fleets the treatment's kernel noise."""
        noise = TREATMENT_NOISE if self.fleet.startswith("mixed") else {}
        return {**variant(self.variant).overrides(), **noise}

    @property
    def settings(self) -> dict[str, Any]:
        return {"lr": STUDY_LR}


def _arm(study: str, fleet: str, v: str) -> Arm:
    key = v in KEY_VARIANTS and fleet != "mixed-replay"
    if study == "moe":      # the MoE: 3 seeds; replay is compared with the free-routing arm at its horizon
        seeds, updates = OTHER_SEEDS, KEY_UPDATES
    else:
        seeds, updates = (KEY_SEEDS, KEY_UPDATES) if key else (OTHER_SEEDS, OTHER_UPDATES)
    tag = {"mixed": "mix", "homogeneous": "hom", "mixed-replay": "mix"}[fleet]
    name = f"{'s' if study == 'dense' else 'm'}-{tag}-{v}" + ("-replay" if fleet == "mixed-replay" else "")
    return Arm(key=name, study=study, fleet=fleet, variant=v, seeds=seeds, updates=updates, key_arm=key)


STUDY: dict[str, tuple[Arm, ...]] = {
    "dense": tuple([_arm("dense", "mixed", "sc_mis_topp"), _arm("dense", "mixed", "grpo"),
                    _arm("dense", "homogeneous", "sc_mis_topp"), _arm("dense", "homogeneous", "grpo")]
                   + [_arm("dense", "mixed", v) for v in ("grpo_mis", "sc", "grpo_topp", "sc_mis")]),
    "moe": (_arm("moe", "mixed", "sc_mis_topp"), _arm("moe", "mixed", "grpo"),
            _arm("moe", "homogeneous", "sc_mis_topp"), _arm("moe", "homogeneous", "grpo"),
            _arm("moe", "mixed-replay", "sc_mis_topp")),
}
ARMS: dict[str, Arm] = {a.key: a for arms in STUDY.values() for a in arms}


def study_order(study: str) -> list[tuple[Arm, int]]:
    """The runs of a study, cheapest informative first: the key arms' seeds 0-2 (a paired contrast of every
    finding on 3 seeds), then their seeds 3-4 (the 5 pairs an equivalence at +-0.05 needs), then the other arms;
    within each part seed by seed, so that a partial study holds whole seeds (pairs) first."""
    if study not in STUDY:
        raise ValueError(f"study = {study!r}; allowed: {', '.join(STUDY)}")
    arms = STUDY[study]
    key, other = [a for a in arms if a.key_arm], [a for a in arms if not a.key_arm]
    seeds = sorted({s for a in arms for s in a.seeds})
    parts = ([(a, s) for s in seeds[:FIRST_SEEDS] for a in key], [(a, s) for s in seeds[FIRST_SEEDS:] for a in key],
             [(a, s) for s in seeds for a in other])
    return [(a, s) for part in parts for a, s in part if s in a.seeds]


def wall_per_update(ladder: Mapping[str, Any], rungs: Sequence[str]) -> float:
    """The median measured wall seconds per update of the finished runs of `rungs` in a ladder results file
    (benchmarks/results/learning.json); NaN if none."""
    per = [r["wall_s"] / r["updates"] for r in ladder.get("runs", [])
           if r["rung"] in rungs and r.get("status") == "finished" and r.get("updates") and r.get("wall_s")]
    return statistics.median(per) if per else math.nan


def estimate_s(arm: Arm, ladder: Mapping[str, Any]) -> float:
    """A run's estimated CPU wall seconds on this machine: measured wall per update of its like rungs x its updates
    + RUN_OVERHEAD_S."""
    return wall_per_update(ladder, arm.like) * arm.updates + RUN_OVERHEAD_S


# ---------------------------------------------------------------------------------------------- the verdict rules

EQUIVALENCE_MARGIN = 0.05          # the seed's "within 0.05"
CONFIDENCE = 0.95

RULES = f"""\
Fixed on {RULES_FIXED}, before the study's first run; applied by code (studies/learning_study.py `verdicts`).
Only finished runs count. A contrast of two arms is compared at the shorter arm's horizon H (its updates): each
run's series cut to its first H updates and its held-out reward at version H; at their own final version the
512 x 2 re-evaluation with shared draws (learning_study_final_eval.json) replaces the 64 x 2 periodic one when both
arms have it.
*Collapse signs* (the ladder's, docs/learning.md): k3 above 3x its mean over updates 2-6; more than half the
episodes of an update ending on three replies without a tool call; the 5-update mean training reward below half
its first 5 updates' mean. A seed *collapses* when all three signs occur within H, is *stable* when none does.
An arm *collapses* when every seed collapses, is *stable* when every seed is stable, *partly collapses* when some
seed collapses, otherwise is *unsettled*. Runs shorter than 10 updates get no verdict.
*Paired contrast* A - B: per seed present in both arms, from the same base (equal weight digests) and the same
evaluation, the difference of the held-out rewards at H; the 95 % t-interval of the mean difference (df: pairs
minus 1). *equivalent* if the whole interval lies inside +-{EQUIVALENCE_MARGIN} (even if it excludes 0: the
difference is then smaller than the margin that matters); else *different* if it excludes 0; else *inconclusive*
(also with fewer than 2 pairs). A pair from two bases is left out and named.
*Treatment*: per seed, the mixed GRPO arm's run k3 (mean of updates 2-6) over the homogeneous GRPO arm's, same
base; it holds if the ratio is >= 3 on every seed, partly if on some, not if on none.
*Learns*: the per-seed gain (held-out reward at H minus at version 0; with the re-evaluation, minus the base's)
has a 95 % t-interval above 0.
*Sooner on mixed*: per seed and sign, the update the sign first occurs on the homogeneous fleet minus on the
mixed fleet, a sign that never occurs counted at H + 1 (a pair where neither fleet shows it is left out); shown if
every difference is > 0, partly if none is < 0 and some is > 0, else not shown.
The findings: (1) SC + MIS + top-p learns on the mixed fleet, and beats GRPO there (contrast *different*, > 0);
(2) GRPO collapses on the mixed fleet (the arm *collapses*; *partly* if it partly collapses), sooner than on the
homogeneous fleet; (3) SC + MIS + top-p on the mixed fleet is *equivalent* to it on the homogeneous fleet. Each is
*reproduced* when its rule holds and *not reproduced* otherwise, with the figures that decided; *not tested yet*
while its arms have fewer than 2 finished seeds (pairs) at H."""


def t_interval(values: Sequence[float]) -> tuple[float, float, float, float]:
    """(mean, se, low, high): the 95 % t-interval over the values (seeds)."""
    m = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values))
    h = float(stdtrit(len(values) - 1, 0.5 + CONFIDENCE / 2)) * se
    return m, se, m - h, m + h


def mean5(xs: Sequence[float], i: int) -> float:
    return statistics.fmean(xs[i:i + 5])


@dataclass(frozen=True)
class Signs:
    """A run's collapse signs (RULES): update numbers are 1-based; None = never."""
    k3_peak_x: float          # the largest k3 over its level at updates 2-6
    k3_3x: int | None         # the first update with k3 above 3x that level
    ntc_50: int | None        # the first update with more than half the episodes ending without a tool call
    ntc_max_pct: float
    halved: int | None        # the last update of the first 5-update window whose mean is < half the first 5's
    train_first5: float
    train_last5: float

    @property
    def collapsed(self) -> bool:
        return self.k3_3x is not None and self.ntc_50 is not None and self.halved is not None

    @property
    def stable(self) -> bool:
        return self.k3_3x is None and self.ntc_50 is None and self.halved is None


def k3_level(run: Mapping[str, Any]) -> float:
    """A run's k3 level (RULES): the mean of updates 2-6 (update 1 is on-policy)."""
    return statistics.fmean(run["kl_k3"][1:6])


def collapse_signs(run: Mapping[str, Any]) -> Signs:
    k3, ntc, tr = run["kl_k3"], run["no_tool_call_share"], run["train_reward"]
    level = k3_level(run)
    k3_3x = next((i + 1 for i, k in enumerate(k3) if k > 3 * level), None)
    ntc_50 = next((i + 1 for i, s in enumerate(ntc) if s > 0.5), None)
    start = mean5(tr, 0)
    halved = next((i + 5 for i in range(len(tr) - 4) if mean5(tr, i) < start / 2), None)
    return Signs(max(k3) / level, k3_3x, ntc_50, 100 * max(ntc), halved, start, mean5(tr, len(tr) - 5))


def equivalence(lo: float, hi: float, margin: float = EQUIVALENCE_MARGIN) -> str:
    """The paired contrast's verdict from its interval (RULES)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if -margin <= lo and hi <= margin:
        return "equivalent"
    if lo > 0 or hi < 0:
        return "different"
    return "inconclusive"


def _growth(xs: Sequence[float]) -> float:
    """The last 5 updates' mean over updates 2-6's (k3, gradient norm)."""
    xs = [x for x in xs if math.isfinite(x)]
    if len(xs) < 10:
        return math.nan
    level = statistics.fmean(xs[1:6])
    return statistics.fmean(xs[-5:]) / level if level > 0 else math.nan


def cut(run: Mapping[str, Any], horizon: int) -> dict[str, Any] | None:
    """The run's series up to update `horizon` and its held-out reward there (`heldout_end`); None if it has no
    evaluation at version `horizon` (or none at 0)."""
    evals = {int(e["version"]): float(e["reward"]) for e in run.get("evals", [])}
    if horizon not in evals or 0 not in evals or run.get("updates", 0) < horizon:
        return None
    out = {k: (v[:horizon] if isinstance(v, list) and k not in ("evals",) else v) for k, v in run.items()}
    out.update(heldout_start=evals[0], heldout_end=evals[horizon], horizon=horizon)
    return out


def _final_reward(final: Mapping[str, Any] | None, arm: str, seed: int, version: int) -> float | None:
    e = (final or {}).get(f"{arm}/seed{seed}")
    return float(e["reward"]) if e and int(e.get("version", -1)) == version else None


def _base_reward(final: Mapping[str, Any] | None, arm: Arm) -> float | None:
    e = (final or {}).get(f"base/{arm.model}/{arm.pretrain_steps}")
    return float(e["reward"]) if e else None


def _runs_at(runs: Sequence[Mapping[str, Any]], arm: Arm, horizon: int,
             final: Mapping[str, Any] | None) -> dict[int, dict[str, Any]]:
    """Seed -> the finished run of `arm` cut at `horizon`, its held-out end (the re-evaluation where it is at its
    final version and has one) and start (the base's re-evaluation then)."""
    out = {}
    for r in runs:
        if r["rung"] != arm.key or r.get("status") != "finished":
            continue
        c = cut(r, horizon)
        if c is None:
            continue
        fin, base = _final_reward(final, arm.key, r["seed"], horizon), _base_reward(final, arm)
        if fin is not None and base is not None:
            c.update(heldout_end=fin, heldout_start=base, reevaluated=True)
        out[int(r["seed"])] = c
    return out


def arm_verdict(runs: Sequence[Mapping[str, Any]]) -> tuple[str, list[Signs]]:
    """An arm's verdict from its (cut) runs (RULES) and each seed's signs."""
    runs = [r for r in runs if len(r["kl_k3"]) >= 10]
    if not runs:
        return "no verdict (no finished run of >= 10 updates)", []
    signs = [collapse_signs(r) for r in runs]
    if all(s.collapsed for s in signs):
        return "collapses", signs
    if all(s.stable for s in signs):
        return "stable", signs
    return ("partly collapses" if any(s.collapsed for s in signs) else "unsettled"), signs


def paired(a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The paired contrast A - B over the seeds both have from one base (RULES)."""
    diffs, seeds, other_base = [], [], []
    for s in sorted(set(a) & set(b)):
        da, db = a[s].get("base_digest"), b[s].get("base_digest")
        if da is not None and db is not None and da != db:
            other_base.append(s)
            continue
        diffs.append(a[s]["heldout_end"] - b[s]["heldout_end"])
        seeds.append(s)
    if len(diffs) < 2:
        m = diffs[0] if diffs else math.nan
        return {"pairs": len(diffs), "seeds": seeds, "other_base_seeds": other_base, "mean": m, "lo": math.nan,
                "hi": math.nan, "verdict": "inconclusive"}
    m, se, lo, hi = t_interval(diffs)
    return {"pairs": len(diffs), "seeds": seeds, "other_base_seeds": other_base, "mean": m, "se": se, "lo": lo,
            "hi": hi, "diffs": diffs, "verdict": equivalence(lo, hi)}


def sooner(mixed: Mapping[int, Mapping[str, Any]], homog: Mapping[int, Mapping[str, Any]], horizon: int) -> dict:
    """Per seed and sign: the update it first occurs on the homogeneous fleet minus on the mixed (RULES)."""
    diffs: list[int] = []
    for s in sorted(set(mixed) & set(homog)):
        sm, sh = collapse_signs(mixed[s]), collapse_signs(homog[s])
        for um, uh in ((sm.k3_3x, sh.k3_3x), (sm.ntc_50, sh.ntc_50), (sm.halved, sh.halved)):
            if um is None and uh is None:
                continue
            diffs.append((horizon + 1 if uh is None else uh) - (horizon + 1 if um is None else um))
    if not diffs:
        verdict = "not shown"
    else:
        verdict = "shown" if min(diffs) > 0 else ("partly shown" if min(diffs) >= 0 < max(diffs) else "not shown")
    return {"diffs": diffs, "verdict": verdict}


def treatment(mixed: Mapping[int, Mapping[str, Any]], homog: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Per seed the mixed fleet's run k3 (mean of updates 2-6) over the homogeneous fleet's (RULES)."""
    ratios = {}
    for s in sorted(set(mixed) & set(homog)):
        da, db = mixed[s].get("base_digest"), homog[s].get("base_digest")
        if (da is None or db is None or da == db) and len(mixed[s]["kl_k3"]) >= 6 and len(homog[s]["kl_k3"]) >= 6:
            ratios[s] = k3_level(mixed[s]) / k3_level(homog[s])
    k = sum(r >= 3 for r in ratios.values())
    verdict = "not measured yet" if not ratios else \
        "holds" if k == len(ratios) else ("partly holds" if k else "does not hold")
    return {"ratio_by_seed": ratios, "at_least_3x": k, "seeds": len(ratios), "verdict": verdict}


def verdicts(runs: Sequence[Mapping[str, Any]], study: str,
             final: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The study's verdicts by RULES: per arm (at its own horizon) its reward start -> end, KL and gradient-norm
    growth, no-tool-call share and verdict; the paired contrasts; the three findings. `runs`: read_run records
    (benchmarks/learning.py); `final`: the re-evaluation's "evaluations" (key "RUNG/seedS", "base/MODEL/STEPS")."""
    arms = {a.key: a for a in STUDY[study]}
    rows = []
    for a in arms.values():
        rs = _runs_at(runs, a, a.updates, final)
        v, signs = arm_verdict(list(rs.values()))
        starts = [r["heldout_start"] for r in rs.values()]
        ends = [r["heldout_end"] for r in rs.values()]
        rows.append({"arm": a.key, "label": a.label, "fleet": a.fleet, "variant": a.variant, "horizon": a.updates,
                     "seeds": sorted(rs), "seeds_planned": list(a.seeds),
                     "heldout_start": statistics.fmean(starts) if starts else math.nan,
                     "heldout_end": statistics.fmean(ends) if ends else math.nan,
                     "heldout_end_min": min(ends, default=math.nan), "heldout_end_max": max(ends, default=math.nan),
                     "kl_growth": [_growth(r["kl_k3"]) for r in rs.values()],
                     "grad_norm_growth": [_growth(r.get("grad_norm", [])) for r in rs.values()],
                     "no_tool_call_last": [r["no_tool_call_share"][-1] for r in rs.values()],
                     "collapsed": sum(s.collapsed for s in signs), "stable": sum(s.stable for s in signs),
                     "verdict": v})
    prefix = "s" if study == "dense" else "m"
    mix_c, mix_g = f"{prefix}-mix-sc_mis_topp", f"{prefix}-mix-grpo"
    hom_c, hom_g = f"{prefix}-hom-sc_mis_topp", f"{prefix}-hom-grpo"
    pairs = [(mix_c, mix_g), (mix_c, hom_c), (mix_g, hom_g)]
    pairs += [(a.key, mix_g) for a in arms.values() if a.key not in (mix_c, mix_g, hom_c, hom_g)]
    contrasts = []
    for ka, kb in pairs:
        h = min(arms[ka].updates, arms[kb].updates)
        fin = final if arms[ka].updates == arms[kb].updates == h else None    # both at their final version, or neither
        ra, rb = _runs_at(runs, arms[ka], h, fin), _runs_at(runs, arms[kb], h, fin)
        pair = paired(ra, rb)
        used = [r for x in (ra, rb) for s, r in x.items() if s in pair["seeds"]]
        # "re-evaluated" only when every run the contrast used has its 512 x 2 re-evaluation (and the base its own)
        contrasts.append({"a": ka, "b": kb, "horizon": h,
                          "reevaluated": bool(used) and all(r.get("reevaluated") for r in used), **pair})
    con = {(c["a"], c["b"]): c for c in contrasts}
    findings = []
    h = arms[mix_c].updates
    learn = _runs_at(runs, arms[mix_c], h, final)
    gains = [r["heldout_end"] - r["heldout_start"] for r in learn.values()]
    g = t_interval(gains) if len(gains) > 1 else (math.nan,) * 4
    beats = con[(mix_c, mix_g)]
    ok1 = len(gains) > 1 and g[2] > 0 and beats["verdict"] == "different" and beats["mean"] > 0
    findings.append({"finding": "1. SC + MIS + top-p learns on the mixed fleet, and beats GRPO there",
                     "gain": g[0], "gain_lo": g[2], "gain_hi": g[3], "seeds": len(gains),
                     "versus_grpo": beats, "verdict": "not tested yet" if min(len(gains), beats["pairs"]) < 2
                     else "reproduced" if ok1 else "not reproduced"})
    grpo = next(r for r in rows if r["arm"] == mix_g)
    grpo_m = _runs_at(runs, arms[mix_g], arms[mix_g].updates, final)
    grpo_h = _runs_at(runs, arms[hom_g], arms[mix_g].updates, final)
    soon, paired_seeds = sooner(grpo_m, grpo_h, arms[mix_g].updates), len(set(grpo_m) & set(grpo_h))
    ok2 = grpo["verdict"] == "collapses" and soon["verdict"] == "shown"
    partly2 = grpo["verdict"] in ("collapses", "partly collapses") and soon["verdict"] != "not shown"
    findings.append({"finding": "2. GRPO collapses on the mixed fleet, sooner than on the homogeneous one",
                     "mixed_grpo": grpo["verdict"], "collapsed": grpo["collapsed"], "seeds": len(grpo["seeds"]),
                     "homogeneous_grpo": next(r["verdict"] for r in rows if r["arm"] == hom_g), "sooner": soon,
                     "verdict": "not tested yet" if len(grpo["seeds"]) < 2 or paired_seeds < 2
                     else "reproduced" if ok2 else ("partly reproduced" if partly2 else "not reproduced")})
    par = con[(mix_c, hom_c)]
    findings.append({"finding": "3. SC + MIS + top-p on the mixed fleet is on par (+-0.05) with the homogeneous",
                     "contrast": par, "verdict": "not tested yet" if par["pairs"] < 2
                     else "reproduced" if par["verdict"] == "equivalent" else "not reproduced"})
    treat = treatment(_runs_at(runs, arms[mix_g], arms[mix_g].updates, None),
                      _runs_at(runs, arms[hom_g], arms[hom_g].updates, None))
    return {"rules_fixed": RULES_FIXED, "treatment": treat, "arms": rows, "contrasts": contrasts,
            "findings": findings}


def _range(xs: Sequence[float], fmt: str) -> str:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "-"
    lo, hi = format(min(xs), fmt), format(max(xs), fmt)
    return lo if lo == hi else f"{lo}..{hi}"


def markdown(v: Mapping[str, Any]) -> str:
    """The study's table (each arm: reward start -> end with the seed spread, KL and gradient-norm growth,
    no-tool-call share, verdict), its paired contrasts and the three findings, from `verdicts`' output."""
    t = v["treatment"]
    lines = [f"Treatment (mixed / homogeneous GRPO run k3, updates 2-6): "
             f"{', '.join(f'seed {s} {x:.2f}x' for s, x in t['ratio_by_seed'].items()) or 'no seed pair yet'}: "
             f"{t['verdict']}.", "",
             "| arm | loss | fleet | seeds (of) | held-out start -> end (end min..max) | KL growth | grad-norm growth "
             "| no-tool-call share, last update | collapsed / stable | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in v["arms"]:
        ends = "-" if not r["seeds"] else (f"{r['heldout_start']:.3f} -> {r['heldout_end']:.3f} "
                                           f"({r['heldout_end_min']:.3f}..{r['heldout_end_max']:.3f})")
        lines.append(f"| {r['arm']} | {LABELS[r['variant']]} | {r['fleet']} | {len(r['seeds'])} "
                     f"({len(r['seeds_planned'])}) | {ends} | x{_range(r['kl_growth'], '.2f')} | "
                     f"x{_range(r['grad_norm_growth'], '.2f')} | "
                     f"{_range([100 * x for x in r['no_tool_call_last']], '.0f')} % "
                     f"| {r['collapsed']} / {r['stable']} | {r['verdict']} |")
    lines += ["", "Growth: the last 5 updates' mean over updates 2-6's, per seed (min..max over seeds); held-out: the "
              "64 x 2 periodic evaluation at versions 0 and the arm's last update; where the final policies were "
              "re-evaluated on 512 x 2, the base's and the final policy's re-evaluation.",
              "", "| contrast A - B | at update | pairs | mean | 95 % interval | verdict |",
              "|---|---|---|---|---|---|"]
    for c in v["contrasts"]:
        span = f"[{_signed(c['lo'])}, {_signed(c['hi'])}]" if _finite(c["lo"]) else "-"
        lines.append(f"| {c['a']} - {c['b']} | {c['horizon']}{' (512 x 2)' if c['reevaluated'] else ''} | "
                     f"{c['pairs']} | {_signed(c['mean'])} | {span} | {c['verdict']} |")
    lines += [""] + [f"- {f['finding']}: **{f['verdict']}** ({_decided_by(f)})" for f in v["findings"]]
    return "\n".join(lines)


def _finite(x: Any) -> bool:
    return x is not None and math.isfinite(x)


def _signed(x: Any) -> str:
    """A difference as +0.123, or '-' where the data cannot give it yet."""
    return f"{x:+.3f}" if _finite(x) else "-"


def _decided_by(f: Mapping[str, Any]) -> str:
    """The figures a finding's verdict rests on (RULES), in words."""
    def iv(c: Mapping[str, Any]) -> str:
        if not c.get("pairs"):
            return "no pair yet"
        span = f"95 % [{_signed(c['lo'])}, {_signed(c['hi'])}]" if _finite(c.get("lo")) else "no interval"
        return f"{_signed(c['mean'])}, {span}, {c['pairs']} pair{'s' if c['pairs'] != 1 else ''}"
    if "gain" in f:
        g = "no seed yet" if not f["seeds"] else (
            f"gain {f['gain']:+.3f}, 95 % [{f['gain_lo']:+.3f}, {f['gain_hi']:+.3f}], {f['seeds']} seeds"
            if f["seeds"] > 1 else "gain: 1 seed, no interval")
        return f"{g}; minus GRPO {iv(f['versus_grpo'])}"
    if "mixed_grpo" in f:
        return (f"mixed GRPO {f['mixed_grpo']} ({f['collapsed']} of {f['seeds']} seeds collapsed), homogeneous GRPO "
                f"{f['homogeneous_grpo']}; sooner on mixed: {f['sooner']['verdict']}")
    return f"mixed minus homogeneous {iv(f['contrast'])}"
