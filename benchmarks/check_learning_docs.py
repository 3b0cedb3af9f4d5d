"""Check docs/learning.md and the README's learning rows against the results files they quote.

    python benchmarks/check_learning_docs.py            # exit 1 and one line per disagreement
    python benchmarks/check_learning_docs.py --write    # regenerate the generated blocks, then check

Two kinds of check:
- **Generated blocks**: text between `<!-- generated: NAME -->` and `<!-- end -->` is made here from the results
  files (the ladder table, the collapse signs per seed, the 512 x 2 re-evaluation, the seed's three findings with
  their verdicts and intervals). The check re-makes each block and fails when the page's copy differs.
- **Inline figures**: CLAIMS lists (file, regex, fact names). Every figure a regex captures must equal its fact,
  rounded as written (0.573 checks to 3 decimals, 12 % to the percent, an update number exactly). A regex that
  no longer matches fails too, so rewording a sentence means re-pointing its claim here.

Facts come from benchmarks/results/learning.json (the ladder), learning_b-lr_same_base.json (b-lr re-run from
c-grpo-lr's base), learning_final_eval.json (final policies on 512 x 2 episodes), tour_learning.json (the README
tour's runs). The verdict rules and the
collapse signs are defined once (FINDINGS_RULES below; collapse_signs and t_interval in studies/learning_study.py,
which the study's verdicts use too), and applied by code.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.studies.ablation import LABELS
from mixfleet.studies.learning_study import (  # the collapse signs and the interval: one definition, the study's
    EQUIVALENCE_MARGIN,
    RULES,
    RUN_OVERHEAD_S,
    STUDY,
    collapse_signs,
    estimate_s,
    k3_level,
    markdown,
    mean5,
    t_interval,
    treatment,
    verdicts,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LADDER = "learning.json"
SAME_BASE = "learning_b-lr_same_base.json"
FINAL = "learning_final_eval.json"
TOUR = "tour_learning.json"                 # the README tour's runs (benchmarks/tour_learning.py)
TREAT = "learning_treatment.json"           # the treatment fleet t-grpo / t-c beside b-lr (benchmarks/learning.py)
STUDY_RESULTS = "learning_study.json"       # the dense study's runs (benchmarks/learning.py --study dense)
STUDY_FINAL = "learning_study_final_eval.json"   # its 512 x 2 re-evaluations (--final-eval)
STUDY_R2 = "learning_study_r2.json"          # the dense study's round 2 (from base b964d7b8, data/bases/)
STUDY_R2_FINAL = "learning_study_r2_final_eval.json"
TREAT_BF16 = "learning_treatment_bf16.json"  # the study's homogeneous bf16 GRPO arm, first 6 updates (the pilot)
ABLATIONS = ("moe", "moe-base300")          # docs/ablation/<dir>/verdicts.json, the MoE ablation reports quoted
DOC = "docs/learning.md"
README = "README.md"

FINDINGS_RULES = """\
Verdict rules (applied by code, benchmarks/check_learning_docs.py): an interval is the 95 % t-interval over seeds
(df = seeds - 1) of the per-seed values named. *learns*: shown if the gain's interval lies above 0. *collapses*:
a seed collapses when all three of the seed's signs occur (k3 above 3x its level of updates 2-6; more than half
the episodes ending on three replies without a tool call; the 5-update mean training reward below half its
first 5); shown on every seed, partly on some, not on none. *sooner on mixed*: per seed and sign, the update on
the homogeneous fleet minus the update on the mixed fleet; shown if every difference is > 0, partly if none is
< 0 and some is > 0. *within 0.05*: shown only if the difference's interval lies inside +-0.05; refuted if it lies
wholly outside (beyond +0.05 or below -0.05); otherwise not shown, and not refuted either."""


# ---------------------------------------------------------------------------------------------- the data

def load(results: Path = RESULTS) -> dict[str, Any]:
    out = {}
    optional = {"study", "study_final", "study_r2", "study_r2_final"}    # absent until the study runs (None then)
    for key, name in (("ladder", LADDER), ("same", SAME_BASE), ("final", FINAL), ("tour", TOUR), ("treat", TREAT),
                      ("treat_bf16", TREAT_BF16), ("study", STUDY_RESULTS), ("study_final", STUDY_FINAL),
                      ("study_r2", STUDY_R2), ("study_r2_final", STUDY_R2_FINAL)):
        path = results / name
        try:
            out[key] = None if key in optional and not path.exists() else json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"{path}: cannot read the results file the docs quote ({e})") from e
    for name in ABLATIONS:
        path = results.parents[1] / "docs" / "ablation" / name / "verdicts.json"
        try:
            out[f"ablation/{name}"] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"{path}: cannot read the ablation report's verdicts the docs quote ({e})") from e
    return out


def runs_of(doc: dict[str, Any], rung: str) -> list[dict[str, Any]]:
    return sorted((r for r in doc["runs"] if r["rung"] == rung and r["status"] == "finished"),
                  key=lambda r: r["seed"])


def facts(data: dict[str, Any]) -> dict[str, float]:
    """Every figure a claim may quote, by name: `RUNG.start|end|min|max|gain` (means over seeds of the held-out
    reward), `RUNG.sS.vV` (seed S at version V), `RUNG.sS.ntc_last` (%), `RUNG.sS.k3_3x` etc.; `b-lr@same.*` from
    the same-base file; `final.*` from the re-evaluation; `f.*` the findings' figures."""
    f: dict[str, float] = {}
    for prefix, doc in (("", data["ladder"]), ("@same", data["same"])):
        for rung in sorted({r["rung"] for r in doc["runs"]}):
            rs = runs_of(doc, rung)
            name = rung + prefix
            start = [r["evals"][0]["reward"] for r in rs]
            end = [r["evals"][-1]["reward"] for r in rs]
            f[f"{name}.start"], f[f"{name}.end"] = statistics.fmean(start), statistics.fmean(end)
            f[f"{name}.min"], f[f"{name}.max"] = min(end), max(end)
            f[f"{name}.gain"] = f[f"{name}.end"] - f[f"{name}.start"]
            f[f"{name}.seeds"] = len(rs)
            for r in rs:
                s = f"{name}.s{r['seed']}"
                for e in r["evals"]:
                    f[f"{s}.v{e['version']}"] = e["reward"]
                f[f"{s}.ntc_last"] = 100 * r["no_tool_call_share"][-1]
                k3, tr = r["kl_k3"], r["train_reward"]
                f[f"{s}.k3_growth"] = mean5(k3, len(k3) - 5) / mean5(k3, 0)
                if f"{s}.v10" in f:
                    f[f"{s}.gain10"] = f[f"{s}.v10"] - f[f"{s}.v0"]
                f[f"{s}.k3_max"], f[f"{s}.k3_max20"], f[f"{s}.k3_min20"] = max(k3), max(k3[:20]), min(k3[1:20])
                f[f"{s}.ntc_max"] = 100 * max(r["no_tool_call_share"])
                for i, (k, t) in enumerate(zip(k3, tr, strict=True)):
                    f[f"{s}.k3.u{i + 1}"], f[f"{s}.tr.u{i + 1}"] = k, t
                f[f"{s}.k3_first5"], f[f"{s}.k3_last5"] = mean5(k3, 0), mean5(k3, len(k3) - 5)
                for g, gk in r.get("kl_k3_by_group", {}).items():
                    f[f"{s}.grp.{g}.u1"] = gk[0]
                    f[f"{s}.grp.{g}.first5"], f[f"{s}.grp.{g}.last5"] = mean5(gk, 0), mean5(gk, len(gk) - 5)
                zero = next((i for i in range(len(tr)) if not any(tr[i:])), None)
                if zero is not None:
                    f[f"{s}.tr_zero_from"] = zero + 1
                if len(r["train_reward"]) >= 10 and len(r["kl_k3"]) >= 6:
                    sg = collapse_signs(r)
                    for k, v in vars(sg).items():
                        f[f"{s}.{k}"] = math.nan if v is None else float(v)
            f[f"{name}.ntc_last_max"] = max(100 * r["no_tool_call_share"][-1] for r in rs)
            f[f"{name}.ntc_max_all"] = max(100 * max(r["no_tool_call_share"]) for r in rs)
            for stat in ("grp.{}.u1", "grp.{}.first5", "grp.{}.last5"):   # over seeds and groups, per group
                groups = sorted({g for r in rs for g in r.get("kl_k3_by_group", {})})
                for g in [*groups, "*"]:
                    vals = [f[f"{name}.s{r['seed']}.{stat.format(h)}"] for r in rs for h in groups
                            if g in ("*", h) and f"{name}.s{r['seed']}.{stat.format(h)}" in f]
                    if vals:
                        f[f"{name}.{stat.format(g)}_min"], f[f"{name}.{stat.format(g)}_max"] = min(vals), max(vals)
            if all("staleness_mean" in r for r in rs):
                f[f"{name}.staleness"] = statistics.fmean(x for r in rs for x in r["staleness_mean"])
            long = [r for r in rs if len(r["train_reward"]) >= 10]
            if long:
                f[f"{name}.tr_first5"] = statistics.fmean(mean5(r["train_reward"], 0) for r in long)
                f[f"{name}.tr_last5"] = statistics.fmean(mean5(r["train_reward"], len(r["train_reward"]) - 5)
                                                          for r in long)
                first5 = [mean5(r["train_reward"], 0) for r in long]
                last5 = [mean5(r["train_reward"], len(r["train_reward"]) - 5) for r in long]
                f[f"{name}.tr_first5_min"], f[f"{name}.tr_first5_max"] = min(first5), max(first5)
                f[f"{name}.tr_last5_min"], f[f"{name}.tr_last5_max"] = min(last5), max(last5)
            for v in sorted({e["version"] for r in rs for e in r["evals"]}):
                vals = [e["reward"] for r in rs for e in r["evals"] if e["version"] == v]
                if len(vals) == len(rs):
                    f[f"{name}.v{v}"] = statistics.fmean(vals)
    f.update({k: v for k, v in data["ladder"]["summary"].items() if not isinstance(v, dict)})  # end differences
    for tag, rungs in (("topp", ("b-c", "b-c-drain", "c")), ("top1", ("a", "a-lr", "b"))):   # the top-p note
        first5 = [mean5(r["train_reward"], 0) for g in rungs for r in runs_of(data["ladder"], g)]
        f[f"x.{tag}_first5_min"], f[f"x.{tag}_first5_max"] = min(first5), max(first5)
    fin = data["final"]
    for name, s in fin["summary"].items():
        key = "base" if name.startswith("base/") else name
        f[f"final.{key}.mean"] = s["mean"]
        if s.get("se") is not None:
            f[f"final.{key}.se"] = s["se"]
        f[f"final.{key}.gain"] = s["gain_over_base"]
    trained = [e for e in fin["evaluations"].values() if e["rung"] != "base"]
    for e in trained:
        f[f"final.{e['rung']}.s{e['seed']}"] = e["reward"]
    f["f.final.smallest_gain"] = min(e["reward"] for e in trained if e["rung"] != "d-b300") - f["final.base.mean"]
    for p in fin["versus"]:
        k = f"final.{p['a']}-{p['b']}"
        f[f"{k}.diff"], f[f"{k}.se"] = p["difference"], p["se"]
        for s, d in p["per_seed_paired"].items():
            f[f"{k}.s{s}"], f[f"{k}.s{s}.se"] = d["difference"], d["se"]
    for name in ABLATIONS:          # `abl.DIR.FLEET.VARIANT.heldout_end` (mean), `..._min`, `.kl_peak_max`, `.rkt`
        rows = data[f"ablation/{name}"]
        for fleet, var in sorted({(r["fleet"], r["variant"]) for r in rows}):
            mine = [r for r in rows if (r["fleet"], r["variant"]) == (fleet, var)]
            k = f"abl.{name}.{fleet}.{var}"
            for col, short in (("heldout_start", "heldout_start"), ("heldout_end", "heldout_end"),
                               ("kl_peak_growth", "kl_peak")):
                vals = [r[col] for r in mine]
                f[k + "." + short] = statistics.fmean(vals)
                f[k + "." + short + "_min"], f[k + "." + short + "_max"] = min(vals), max(vals)
            f[k + ".n"] = len(mine)
            f[k + ".rkt"] = sum(r["signs"] == "RKT" for r in mine)
            f[k + ".stable"] = sum(r["verdict"] == "stable" for r in mine)
            f[k + ".collapsed"] = sum(r["verdict"] == "collapsed" for r in mine)
        f[f"abl.stable_{name.replace('moe-', '')}"] = sum(r["verdict"] == "stable" for r in rows)
    f["abl.unstable_moe_grpo"] = sum(r["verdict"] == "unstable" for r in data["ablation/moe"]
                                     if r["variant"] == "grpo" and r["fleet"] == "mixed-moe")
    for label, line in data["tour"]["lines"].items():        # `tour.LABEL.sS.start|end`, `tour.LABEL.gain|min|max`
        for r in line["runs"]:
            f[f"tour.{label}.s{r['seed']}.start"] = r["reward_start"]
            f[f"tour.{label}.s{r['seed']}.end"] = r["reward_end"]
        f[f"tour.{label}.gain"] = line["mean_gain"]
        f[f"tour.{label}.min"] = line["min_gain"]
        f[f"tour.{label}.max"] = line["max_gain"]
    f.update(findings(data)[1])
    return f


# ---------------------------------------------------------------------------------------------- the findings

def _verdict_within(lo: float, hi: float) -> str:
    if -EQUIVALENCE_MARGIN <= lo and hi <= EQUIVALENCE_MARGIN:
        return "shown"
    if lo > EQUIVALENCE_MARGIN or hi < -EQUIVALENCE_MARGIN:
        return "refuted"
    return "not shown (not refuted either)"


def _verdict_count(k: int, n: int) -> str:
    return "shown" if k == n else ("partly shown" if k else "not shown")


def _ci(m: float, lo: float, hi: float) -> str:
    return f"{m:+.3f}, 95 % interval [{lo:+.3f}, {hi:+.3f}]"


def findings(data: dict[str, Any]) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    """The seed's three findings as rows (finding, evidence, figures, verdict) and their figures as facts."""
    lad, same, fin = data["ladder"], data["same"], data["final"]
    rows: list[tuple[str, str, str, str]] = []
    fx: dict[str, float] = {}

    def gain_row(rung: str, what: str, doc: dict[str, Any] = lad) -> None:
        g = [r["evals"][-1]["reward"] - r["evals"][0]["reward"] for r in runs_of(doc, rung)]
        m, _, lo, hi = t_interval(g)
        fx.update({f"f.{rung}.gain": m, f"f.{rung}.gain_lo": lo, f"f.{rung}.gain_hi": hi})
        rows.append(("1. SC + MIS + top-p learns on a mixed fleet", what,
                     f"gain {_ci(m, lo, hi)} ({len(g)} seeds)", "shown" if lo > 0 else "not shown"))

    gain_row("c-lr", "c-lr: dense, mixed fleet, async, lr 1.5e-4, 40 updates")
    gain_row("d-c300", "d-c300: MoE, mixed fleet, async, 300-step base, lr 1.5e-4, 30 updates")
    c_start = [r["evals"][0]["reward"] for r in runs_of(lad, "c-lr")]
    g_start = [r["evals"][0]["reward"] for r in runs_of(lad, "c-grpo-lr")]
    same_base = c_start == g_start
    rows.append(("1. ... where GRPO on the same mixed fleet does not", "c-lr vs c-grpo-lr",
                 f"held-out start {statistics.fmean(c_start):.3f} vs {statistics.fmean(g_start):.3f}: "
                 + ("one base" if same_base else "two bases (two machines' `mixfleet pretrain`), no same-base pair"),
                 "partly shown" if not same_base else "see the rungs"))

    for mixed_rung, mixed_doc, homog_rung, homog_doc, label in (
            ("c-grpo-lr", lad, "b-lr", same, "dense, lr 1.5e-4, 40 updates, one base"),):
        mixed, homog = runs_of(mixed_doc, mixed_rung), runs_of(homog_doc, homog_rung)
        sm = [collapse_signs(r) for r in mixed]
        sh = [collapse_signs(r) for r in homog]
        km, kh = sum(s.collapsed for s in sm), sum(s.collapsed for s in sh)
        fx.update({"f.c-grpo-lr.collapsed": km, "f.b-lr@same.collapsed": kh, "f.c-grpo-lr.n": len(sm)})
        rows.append(("2. GRPO collapses on a mixed fleet", f"{mixed_rung} ({label})",
                     f"all three signs on {km} of {len(sm)} seeds (one fp32 group, {homog_rung}: {kh} of {len(sh)})",
                     _verdict_count(km, len(sm))))
        diffs: list[int] = []
        per_seed = []
        for a, b, r in zip(sm, sh, mixed, strict=True):
            d = [hb - ha for ha, hb in ((a.k3_3x, b.k3_3x), (a.ntc_50, b.ntc_50), (a.halved, b.halved))
                 if ha is not None and hb is not None]
            diffs += d
            per_seed.append(f"seed {r['seed']}: {', '.join(f'{x:+d}' for x in d)}")
        end_m = [r["evals"][-1]["reward"] for r in mixed]
        end_h = [r["evals"][-1]["reward"] for r in homog]
        higher = sum(m > h for m, h in zip(end_m, end_h, strict=True))
        fx.update({"f.sooner.min": min(diffs), "f.sooner.max": max(diffs), "f.sooner.mixed_higher_end": higher})
        verdict = "shown" if min(diffs) > 0 else ("partly shown" if min(diffs) >= 0 < max(diffs) else "not shown")
        rows.append(("2. ... sooner than on a homogeneous fleet", f"{mixed_rung} vs {homog_rung}, same base",
                     f"updates sooner on mixed (k3 3x, no tool call > 50 %, reward halved): {'; '.join(per_seed)}; "
                     f"at the last update the mixed fleet's held-out reward is higher on {higher} of {len(end_m)} "
                     "seeds", verdict))
    dm = [collapse_signs(r).collapsed for r in runs_of(lad, "d-c300-grpo")]
    fx["f.d-c300-grpo.collapsed"] = sum(dm)
    fx["f.d-b300.collapsed"] = sum(collapse_signs(r).collapsed for r in runs_of(lad, "d-b300"))
    rows.append(("2. GRPO collapses on a mixed fleet", "d-c300-grpo (MoE, mixed, 40 updates; another base than "
                 "d-b300's)", f"all three signs on {sum(dm)} of {len(dm)} seeds (one fp32 group, d-b300, other base, "
                 f"30 updates: {int(fx['f.d-b300.collapsed'])} of 3)", _verdict_count(sum(dm), len(dm))))

    def within_row(key: str, what: str, diffs: list[float],
                   finding: str = "3. a mixed fleet does as well as a homogeneous one (within 0.05)") -> None:
        m, se, lo, hi = t_interval(diffs)
        fx.update({f"f.{key}.diff": m, f"f.{key}.se": se, f"f.{key}.lo": lo, f"f.{key}.hi": hi})
        fx.update({f"f.{key}.d{i}": d for i, d in enumerate(diffs)})
        per_seed = ", ".join(f"{d:+.3f}" for d in diffs)
        rows.append((finding, what, f"{_ci(m, lo, hi)}, per seed {per_seed}", _verdict_within(lo, hi)))

    c = {r["seed"]: r["evals"][-1]["reward"] for r in runs_of(lad, "c-lr")}
    b = {r["seed"]: r["evals"][-1]["reward"] for r in runs_of(lad, "b-c-lr")}
    within_row("dense", "c-lr minus b-c-lr at update 40 (64 x 2 evaluation, same base)",
               [c[s] - b[s] for s in sorted(c)])
    vs = {(p["a"], p["b"]): p for p in fin["versus"]}
    moe = vs[("d-c300", "d-b300-c")]["per_seed_paired"]
    within_row("moe", "d-c300 minus d-b300-c, final policies on 512 x 2 (paired draws)",
               [moe[s]["difference"] for s in sorted(moe)])
    rep = vs[("d-c300-replay", "d-c300")]["per_seed_paired"]
    within_row("replay", "d-c300-replay minus d-c300, 512 x 2", [rep[s]["difference"] for s in sorted(rep)],
               finding="(beside 3) routing replayed does as well as free on the mixed MoE fleet (within 0.05)")

    kr = [k3_level(a) / k3_level(h) for a, h in zip(runs_of(lad, "c-grpo-lr"), runs_of(same, "b-lr"), strict=True)]
    fx.update({"f.kl_ratio.min": min(kr), "f.kl_ratio.max": max(kr)})
    rows.append(("the treatment: the mixed fleet's mismatch exceeds the homogeneous one's", "c-grpo-lr vs b-lr, "
                 "same base: run k3, mean of updates 2-6", f"mixed / homogeneous {min(kr):.2f}-{max(kr):.2f}x per seed",
                 "not shown (needs >= 3x)" if min(kr) < 3 else "shown"))
    tre = data["treat"]
    pairs = [(t, h) for t in runs_of(tre, "t-grpo") for h in runs_of(tre, "b-lr") if t["seed"] == h["seed"]]
    same_base = bool(pairs) and all(t.get("base_digest") and t["base_digest"] == h.get("base_digest")
                                    for t, h in pairs)
    kt = [k3_level(t) / k3_level(h) for t, h in pairs]
    if kt:
        m, _, lo, hi = t_interval(kt) if len(kt) > 1 else (kt[0], math.nan, math.nan, math.nan)
        fx.update({"f.treat.min": min(kt), "f.treat.max": max(kt), "f.treat.mean": m, "f.treat.lo": lo,
                   "f.treat.hi": hi, "f.treat.n": len(kt)})
        digest = pairs[0][0]["base_digest"] if same_base else None
        rows.append(("the treatment: the mixed fleet's mismatch exceeds the homogeneous one's",
                     "t-grpo (tiny-cpu, kernel noise fp8 0.5 / nvfp4 0.9) vs b-lr, "
                     + (f"same base (weights sha256 {digest[:12]}): " if same_base else "two bases: ")
                     + "run k3, mean of updates 2-6",
                     f"mixed / homogeneous {min(kt):.2f}-{max(kt):.2f}x per seed, mean {m:.2f}x, 95 % interval "
                     f"[{lo:.2f}, {hi:.2f}] ({len(kt)} seeds)",
                     "not shown (two bases)" if not same_base else
                     _verdict_count(sum(k >= 3 for k in kt), len(kt)) + " (>= 3x per seed)"))
        # against the study's homogeneous fleet (bf16 x 3): the study's own rule *Treatment* (same-base pairs only)
        tb = treatment({r["seed"]: r for r in runs_of(tre, "t-grpo")},
                       {r["seed"]: r for r in runs_of(data["treat_bf16"], "s-hom-grpo")})
        kb = tb["ratio_by_seed"]
        if kb:
            fx.update({f"f.treat_bf16.s{s}": k for s, k in kb.items()})
            fx.update({"f.treat_bf16.min": min(kb.values()), "f.treat_bf16.max": max(kb.values()),
                       "f.treat_bf16.n": tb["seeds"], "f.treat_bf16.at3": tb["at_least_3x"]})
            rows.append(("the treatment: the mixed fleet's mismatch exceeds the homogeneous one's",
                         "t-grpo vs the study's bf16 fleet (s-hom-grpo, first 6 updates, the pilot), same base: "
                         "run k3, mean of updates 2-6",
                         "mixed / homogeneous " + ", ".join(f"{k:.2f}x" for k in kb.values()) + " (seeds "
                         + ", ".join(map(str, kb)) + ")",
                         _verdict_count(tb["at_least_3x"], tb["seeds"]) + " (>= 3x per seed)"))
        growth = {rung: [r["kl_k3"][-1] / r["kl_k3"][0] for r in runs_of(tre, rung)] for rung in ("t-grpo", "t-c")}
        fx.update({f"f.treat.{rung}.growth_{x}": f(g) for rung, g in growth.items()
                   for x, f in (("min", min), ("max", max))})
    return rows, fx


# ---------------------------------------------------------------------------------------------- generated blocks

def _ladder_module() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import learning  # benchmarks/learning.py: the ladder table is its markdown_table, not a second copy
    finally:
        sys.path.pop(0)
    return learning


def block_ladder(data: dict[str, Any]) -> str:
    lad = data["ladder"]
    return _ladder_module().markdown_table(lad["summary"], lad["runs"])


def block_signs(data: dict[str, Any]) -> str:
    lines = ["| run | seed | held-out at each evaluation | training reward (first 5 -> last 5) | k3 peak (first "
             "> 3x) | no tool call > 50 % (max) | reward halved | all three |", "|---|---|---|---|---|---|---|---|"]
    for rung, doc, what in (("c-grpo-lr", data["ladder"], "mixed, dense"),
                            ("b-lr", data["same"], "one fp32 group, dense, c-grpo-lr's base"),
                            ("b-lr", data["ladder"], "one fp32 group, dense, another base"),
                            ("d-c300-grpo", data["ladder"], "mixed, MoE"),
                            ("d-b300", data["ladder"], "one fp32 group, MoE, another base")):
        for r in runs_of(doc, rung):
            s = collapse_signs(r)
            ev = ", ".join(f"{e['reward']:.3f}" for e in r["evals"])
            def at(u: int | None) -> str:
                return "never" if u is None else str(u)
            lines.append(f"| {rung} ({what}) | {r['seed']} | {ev} | {s.train_first5:.2f} -> {s.train_last5:.2f} | "
                         f"x{s.k3_peak_x:.0f} ({at(s.k3_3x)}) | {at(s.ntc_50)} ({s.ntc_max_pct:.0f} %) | "
                         f"{at(s.halved)} | {'yes' if s.collapsed else 'no'} |")
    return "\n".join(lines)


def block_final(data: dict[str, Any]) -> str:
    fin = data["final"]
    names = {"d-b300-c": "one fp32 group, async, SC+MIS+top-p", "d-c300": "mixed fleet, routing free",
             "d-c300-replay": "mixed fleet, routing replayed", "d-b300": "one fp32 group, async, GRPO"}
    lines = ["| policy | per seed | mean (se over seeds) | over the base |", "|---|---|---|---|"]
    for name, s in fin["summary"].items():
        if name.startswith("base/"):
            lines.append(f"| base ({name.split('/')[-1]}-step MoE pretraining) | {s['mean']:.3f} | | |")
            continue
        per = sorted((e for e in fin["evaluations"].values() if e["rung"] == name), key=lambda e: e["seed"])
        seeds = ", ".join(f"{e['reward']:.3f}" for e in per)
        lines.append(f"| {name}, {names.get(name, '')} | {seeds} | "
                     f"{s['mean']:.3f} ({s['se']:.3f}) | {s['gain_over_base']:+.3f} |")
    return "\n".join(lines)


def block_findings(data: dict[str, Any]) -> str:
    rows, _ = findings(data)
    lines = ["| finding | evidence | figures | verdict |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | **{d}** |" for a, b, c, d in rows]
    return "\n".join(lines) + "\n\n" + FINDINGS_RULES


def block_study_arms(data: dict[str, Any]) -> str:
    """The study's arms (studies/learning_study.py STUDY) with their estimated CPU time from the ladder's runs."""
    lines = ["| study | arm (rung) | loss | fleet (plan) | seeds | updates | base | est. CPU per run "
             "| est. CPU, all seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    totals = {}
    for study, arms in STUDY.items():
        for a in arms:
            est = estimate_s(a, data["ladder"])
            totals[study] = totals.get(study, 0.0) + est * len(a.seeds)
            lines.append(f"| {study} | {a.key} | {LABELS[a.variant]} | {a.fleet} ({a.plan}) | "
                         f"{','.join(map(str, a.seeds))} | {a.updates} | {a.model}, {a.pretrain_steps} steps | "
                         f"{est / 60:.0f} min | {est * len(a.seeds) / 3600:.1f} h |")
    t = data["treat"]["runs"]
    walls = {k: statistics.median(r["wall_s"] for r in t if r["rung"] in k) for k in (("t-grpo", "t-c"), ("b-lr",))}
    ratio = walls[("t-grpo", "t-c")] / walls[("b-lr",)]
    lines.append("")
    lines.append(f"Estimated CPU in all: {' + '.join(f'{v / 3600:.1f} h ({k})' for k, v in totals.items())}, one "
                 f"run at a time, plus each finished run's 512 x 2 re-evaluation. The estimate is the median wall "
                 f"per update of the like ladder rungs in learning.json (mixed: c-lr, c-grpo-lr; homogeneous: those "
                 f"and b-lr, b-c-lr; MoE: d-c300 and its kin) x the updates + {RUN_OVERHEAD_S:.0f} s start-up. The "
                 f"treatment's kernel noise is not in those rungs: over the same first 6 updates its runs took "
                 f"{ratio:.2f}x b-lr's wall (median, learning_treatment.json), so the mixed arms may take longer.")
    return "\n".join(lines)


def block_study_rules(data: dict[str, Any]) -> str:
    return RULES


def block_study_state(data: dict[str, Any], key: str = "study", name: str = STUDY_RESULTS,
                      what: str = "The dense study") -> str:
    """The dense study so far: its verdicts by RULES recomputed from the runs in learning_study.json (and the
    re-evaluations where made), with the runs done and left."""
    doc = data.get(key)
    runs = [r for r in (doc or {}).get("runs", []) if r.get("status") == "finished"]
    if not runs:
        return "No run of the study has finished yet."
    final = (data.get(f"{key}_final") or {}).get("evaluations", {})
    planned = sum(len(a.seeds) for a in STUDY["dense"])
    done = sorted(f"{r['rung']}/seed{r['seed']}" for r in runs)
    return (f"{what} after {len(runs)} of its {planned} runs ({', '.join(done)}; "
            f"benchmarks/results/{name}, the verdicts recomputed from its runs by the rules below):\n\n"
            + markdown(verdicts(runs, "dense", final)))


def block_study_r2_state(data: dict[str, Any]) -> str:
    """Round 2 of the dense study (learning_study_r2.json), as `block_study_state`."""
    return block_study_state(data, "study_r2", STUDY_R2, "Round 2 of the dense study")


BLOCKS = {"learning-table": block_ladder, "learning-signs": block_signs, "learning-final-eval": block_final,
          "learning-findings": block_findings, "study-arms": block_study_arms, "study-rules": block_study_rules,
          "study-state": block_study_state, "study-r2-state": block_study_r2_state}
BLOCK_RE = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end -->)", re.S)


# ---------------------------------------------------------------------------------------------- inline claims

@dataclass(frozen=True)
class Claim:
    file: str
    pattern: str              # one capture group per fact, in order
    facts: tuple[str, ...]


NUMBER = r"([+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?)"         # a quoted figure: 0.573, +0.036, 12, 1.7e-3


def q(template: str, *names: str, file: str = DOC) -> Claim:
    """A claim written as the page's text: each `{}` is a quoted figure checked against the fact named in the same
    place; the rest matches literally, any run of spaces or line breaks matching any other."""
    parts = template.split("{}")
    if len(parts) - 1 != len(names):
        raise ValueError(f"claim {template!r}: {len(parts) - 1} figures for {len(names)} facts")
    lit = [r"\s+".join(re.escape(w) for w in re.split(r"\s+", p)) for p in parts]
    return Claim(file, NUMBER.join(lit), names)


def curve(rung: str, seed: int, versions: range | tuple[int, ...]) -> tuple[str, ...]:
    return tuple(f"{rung}.s{seed}.v{v}" for v in versions)


def spread(rung: str) -> tuple[str, ...]:
    return (f"{rung}.start", f"{rung}.end", f"{rung}.min", f"{rung}.max")


V40, V30, V60 = range(0, 41, 10), range(0, 31, 10), range(0, 61, 10)
ABL300, ABL150 = "abl.moe-base300.mixed-moe", "abl.moe.mixed-moe"     # the MoE ablation reports' facts
SPREAD = "{} -> {} ({}..{})"
CLAIMS: list[Claim] = [
    # README: the tour's runs (benchmarks/results/tour_learning.json)
    q("tiny-cpu, 3 seeds x 30 updates, {} -> {}, {} -> {}, {} -> {} (mean gain {}, min {})",
      *[f"tour.tiny-cpu.s{i}.{e}" for i in range(3) for e in ("start", "end")], "tour.tiny-cpu.gain",
      "tour.tiny-cpu.min", file=README),
    q("mean gain {} over 20 updates ({} .. {} across seeds) and {} over 30 ({} .. {}), from a base at {}",
      "tour.tiny-moe-cpu-20.gain", "tour.tiny-moe-cpu-20.min", "tour.tiny-moe-cpu-20.max",
      "tour.tiny-moe-cpu-30.gain", "tour.tiny-moe-cpu-30.min", "tour.tiny-moe-cpu-30.max",
      "tour.tiny-moe-cpu-30.s0.start", file=README),
    # docs/learning.md, the summary
    q("held-out reward {} -> {} over 3 seeds (end {}..{})", *spread("a-lr")),
    q("0.419 -> {} in process (d-a0, 60 updates) and 0.419 -> {} through the runner (d-a300, 60 updates)",
      "d-a0.end", "d-a300.end"),
    # the ladder
    q("seeds 0 and 1 go {} -> {} -> {} -> {} -> {} and {} -> {} -> {} -> {} -> {} (versions 0, 10, 20, 30, 40), "
      "but seed 2 reaches {} at version 20 and then falls to {} / {}, with no no-tool-call collapse ({} % at the last",
      *curve("a", 0, V40), *curve("a", 1, V40), "a.s2.v20", "a.s2.v30", "a.s2.v40", "a.s2.ntc_last"),
    q("all three seeds rise steadily: {} -> {}, {} -> {}, {} -> {}; **mean {} -> {} ({})**",
      "a-lr.s0.v0", "a-lr.s0.v40", "a-lr.s1.v0", "a-lr.s1.v40", "a-lr.s2.v0", "a-lr.s2.v40", "a-lr.start",
      "a-lr.end", "a-lr.gain"),
    q("held-out reward to 0, k3 up to x{} its level at updates 2-6, {} % of episodes ending without a tool call at "
      "the last update", "b.s0.k3_peak_x", "b.s0.ntc_last"),
    q("training reward {} -> 0 by update {}, sampler-trainer k3 {} -> {} (the on-policy part is {}), episodes ending "
      "on three replies without a tool call 0 % -> {} %; held-out reward {} -> {}", "b.s0.tr.u1", "b.s0.tr_zero_from",
      "b.s0.k3.u2", "b.s0.k3_max", "b.s0.k3.u1", "b.s0.ntc_last", "b.s0.v0", "b.s0.v20"),
    q("(rung c, seed 0) the KL stays at {}..{} (no sustained growth), but from update 13 the no-tool-call share "
      "climbs to 61-{} % and the held-out reward reads {} at update 20 (from {}; continued to 40 updates it came "
      "back to {}", "c.s0.k3_min20", "c.s0.k3_max20", "c.s0.ntc_max", "c.s0.v20", "c.s0.v0", "c.s0.v40"),
    q("(rung b-c), stays stable (k3 {}..{} and no no-tool-call episodes over its first 20 updates) but does not "
      "learn in 20 updates (held-out {} -> {})", "b-c.s0.k3_min20", "b-c.s0.k3_max20", "b-c.s0.v0", "b-c.s0.v20"),
    q("{} -> {} -> {} -> ... -> {} at version 40", *curve("b-c", 0, (0, 10, 20, 40))),
    q("| the recipe | {} -> {} | {} |", "a0.s0.v0", "a0.s0.v10", "a0.s0.gain10"),
    q("20 updates of the recipe: {} -> {} -> {} (versions 0, 10, 20)", *curve("a0", 0, (0, 10, 20))),
    q("whose `mixfleet pretrain` built another base, start {})", "b-lr.start"),
    q("against {} at version 30 of the kept runs", "d-a0.v30"),
    q("(a-lr: {} in 40)", "a-lr.gain"),
    q("fleet's {} ({}..{}): on this evaluation the mixed fleet ends {} *above*", "d-c300.end", "d-c300.min",
      "d-c300.max", "d-c300_minus_d-b300-c_end"),
    q("The {} of the 128-episode evaluation was mostly its noise", "d-c300_minus_d-b300-c_end"),
    q("Their training reward starts at {}-{} over the first 5 updates, against {}-{} for the top-p-1 rungs",
      "x.topp_first5_min", "x.topp_first5_max", "x.top1_first5_min", "x.top1_first5_max"),
    q("b-c {} -> {}, b-c-drain {} -> {}, c {} -> {}, {} -> {} and {} -> {}",
      *(f"{r}.s{i}.train_{w}5" for r, i in (("b-c", 0), ("b-c-drain", 0), ("c", 0), ("c", 1), ("c", 2))
        for w in ("first", "last"))),
    q("b-c-drain (no in-flight weight update) {} -> {} at 20", "b-c-drain.start", "b-c-drain.end"),
    q("ends at {}, {} and {} (from {}, {}, {}; mean {} -> {})", "c.s0.v40", "c.s1.v40", "c.s2.v40", "c.s0.v0",
      "c.s1.v0", "c.s2.v0", "c.start", "c.end"),
    q("c - b-c = {} at the end", "c_minus_b-c_end"),
    *[q(f"| {rung}, {what} | " + "{}, {}, {}, {}, {} | " * 3 + f"{SPREAD}, {{}} |",
        *curve(rung, 0, V40), *curve(rung, 1, V40), *curve(rung, 2, V40), *spread(rung),
        f"{rung}.gain")
      for rung, what in (("b-c-lr", "one fp32 group"), ("c-lr", "mixed fleet (bf16 / fp8 / nvfp4)"))],
    q("**Mixed minus homogeneous at the end: {}**; per seed {}, {}, {} (se over seeds {}, 95 % interval [{}, {}])",
      "f.dense.diff", "f.dense.d0", "f.dense.d1", "f.dense.d2", "f.dense.se", "f.dense.lo", "f.dense.hi"),
    q("(mean of updates 1-5 -> last 5: b-c-lr {} -> {}, {} -> {}, {} -> {}; c-lr per group {}..{} -> {}..{}, bf16, "
      "fp8 and nvfp4 alike), no episode ends on three replies without a tool call on any update ({} % max), "
      "staleness {}. The training reward at their own top-p 0.95 rises, b-c-lr {}-{} -> {}-{}, c-lr {}-{} -> {}-{}",
      *(f"b-c-lr.s{i}.k3_{w}" for i in range(3) for w in ("first5", "last5")),
      "c-lr.grp.*.first5_min", "c-lr.grp.*.first5_max", "c-lr.grp.*.last5_min", "c-lr.grp.*.last5_max",
      "c-lr.ntc_max_all", "c-lr.staleness",
      *(f"{r}.tr_{w}5_{m}" for r in ("b-c-lr", "c-lr") for w in ("first", "last") for m in ("min", "max"))),
    q("(staleness-0 k3 per group at update 1: bf16 {}..{}, fp8 {}..{}, nvfp4 {}..{}, against ~{} at staleness 2 by "
      "update 5", *(f"c-grpo-lr.grp.cpu-{g}.u1_{m}" for g in ("bf16", "fp8", "nvfp4") for m in ("min", "max")),
      "c-grpo-lr.s0.k3.u5"),
    q("The start values ({}-{}) are below a-lr's ({}-{})", "b-c-lr.s1.v0", "b-c-lr.s0.v0", "a-lr.s1.v0",
      "a-lr.s0.v0"),
    q("+0.20 and +0.19 here against {} on-policy", "a-lr.gain"),
    q("held-out {} -> {} ({}..{}), where the same fleet with SC + MIS + top-p (c-lr) rises to {}",
      *spread("c-grpo-lr"), "c-lr.end"),
    q("Seed 2 rises on held-out and only its KL grows (x{} at its peak)", "c-grpo-lr.s2.k3_peak_x"),
    q("seed for seed** ({} -> {}), each sign {}-{} updates later", "b-lr@same.start", "b-lr@same.end",
      "f.sooner.min", "f.sooner.max"),
    q("by {}-{} updates out of ~17, on 3 seeds, and at update 40 the mixed fleet's held-out reward is the higher "
      "one on {} of 3 seeds", "f.sooner.min", "f.sooner.max", "f.sooner.mixed_higher_end"),
    q("2e-4..4e-4, against ~1e-2 at staleness 2 by update 5; the mixed fleet's run k3 over updates 2-6 is {}-{}x the "
      "homogeneous one's", "f.kl_ratio.min", "f.kl_ratio.max"),
    q("the mixed fleet's run k3 over updates 2-6 is {}-{}x the homogeneous one's, mean {}x", "f.treat.min",
      "f.treat.max", "f.treat.mean"),
    q("GRPO's k3 grows {}-{}x from update 1 to 6 and SC + MIS + top-p's {}-{}x", "f.treat.t-grpo.growth_min",
      "f.treat.t-grpo.growth_max", "f.treat.t-c.growth_min", "f.treat.t-c.growth_max"),
    q("Finding 2: GRPO collapses by all three signs on {} of 3 seeds on the mixed fleets, and on the homogeneous fleet "
      "from the same base on the same {} seeds; \"sooner on mixed\" is {}-{} updates, and at update 40 the mixed "
      "fleet's held-out reward is the higher one on {} of 3 seeds", "f.c-grpo-lr.collapsed", "f.b-lr@same.collapsed",
      "f.sooner.min", "f.sooner.max", "f.sooner.mixed_higher_end"),
    # the MoE
    *[q(f"- seed {s}: {{}}, {{}}, {{}}, {{}}, {{}}, {{}}, {{}}", *curve("d-a0", s, V60)) for s in range(3)],
    q("**Mean {} -> {} (end {}..{}), gain {}**", *spread("d-a0"), "d-a0.gain"),
    *[q(f"| {rung}, {what} | {{}}, {{}}, {{}}, {{}} | {{}}, {{}}, {{}}, {{}} | {{}}, {{}}, {{}}, {{}} | {SPREAD} |",
        *curve(rung, 0, V30), *curve(rung, 1, V30), *curve(rung, 2, V30), *spread(rung))
      for rung, what in (("d-c300", "routing free"), ("d-c300-replay", "routing replayed"))],
    q("| d-a0 (on-policy, in process) at version 30 | {} | {} | {} | {} -> {} ({}..{}) |", "d-a0.s0.v30",
      "d-a0.s1.v30", "d-a0.s2.v30", "d-a0.start", "d-a0.v30", "d-a0.s2.v30", "d-a0.s0.v30"),
    q("held-out reward rises on every seed: {} (free) and {} (replay) in 30 updates", "d-c300.gain",
      "d-c300-replay.gain"),
    q("d-c300 ends 0.008 below d-a0's version 30 ({} vs {};", "d-c300.end", "d-a0.v30"),
    q("versions 0, 10, 20, 30: {}, {}, {}, {}; {}, {}, {}, {}; {}, {}, {}, {}. **Mean {} -> {} ({}..{}, {})**",
      *curve("d-b300-c", 0, V30), *curve("d-b300-c", 1, V30), *curve("d-b300-c", 2, V30), *spread("d-b300-c"),
      "d-b300-c.gain"),
    q("the mixed fleet ends {} *above*", "d-c300_minus_d-b300-c_end"),
    q("homogeneous {} -> {}, mixed {} -> {})", "d-b300-c.tr_first5", "d-b300-c.tr_last5", "d-c300.tr_first5",
      "d-c300.tr_last5"),
    q("the gap is {} (se {}), 95 % interval [{}, {}]", "final.d-c300-d-b300-c.diff", "final.d-c300-d-b300-c.se",
      "f.moe.lo", "f.moe.hi"),
    q("**Mixed minus homogeneous (c - b): {} (se {}), 95 % interval over the 3 seed pairs [{}, {}]**",
      "final.d-c300-d-b300-c.diff", "final.d-c300-d-b300-c.se", "f.moe.lo", "f.moe.hi"),
    q("paired over the same draws: {} ({}), {} ({}), {} ({})", "final.d-c300-d-b300-c.s0",
      "final.d-c300-d-b300-c.s0.se", "final.d-c300-d-b300-c.s1", "final.d-c300-d-b300-c.s1.se",
      "final.d-c300-d-b300-c.s2", "final.d-c300-d-b300-c.s2.se"),
    q("seed 2 of d-b300-c reads {} there and {} here; seed 1 of d-c300 {} and {}", "d-b300-c.s2.v30",
      "final.d-b300-c.s2", "d-c300.s1.v30", "final.d-c300.s1"),
    q("Replayed minus free routing: {} (se {}, 95 % interval [{}, {}])", "final.d-c300-replay-d-c300.diff",
      "final.d-c300-replay-d-c300.se", "f.replay.lo", "f.replay.hi"),
    q("Every policy trained with SC + MIS + top-p is above the base ({}): the smallest gain is d-b300-c seed 1, {}",
      "final.base.mean",
      "f.final.smallest_gain"),
    q("- d-a300 (`--mode sync`, on-policy GRPO through the runner): {}, {}, {}, {}; {}, {}, {}, {}; {}, {}, {}, {}. "
      "**Mean {} -> {} at version 30 ({}..{})**, level with the mixed fleet's {} and the in-process d-a0's {}",
      *curve("d-a300", 0, V30), *curve("d-a300", 1, V30), *curve("d-a300", 2, V30), "d-a300.start", "d-a300.v30",
      "d-a300.s2.v30", "d-a300.s1.v30", "d-c300.end", "d-a0.v30"),
    q("GRPO without correction): {}, {}, {}, {}; {}, {}, {}, {}; {}, {}, {}, **{}**. **Mean {} -> {} ({}..{})**",
      *curve("d-b300", 0, V30), *curve("d-b300", 1, V30), *curve("d-b300", 2, V30), *spread("d-b300")),
    q("k3 grows {}x, {}x and {}x", "d-b300.s0.k3_growth", "d-b300.s1.k3_growth", "d-b300.s2.k3_growth"),
    q("the training reward falls on seed 2 only ({} -> {}; seeds 0, 1: {} -> {}, {} -> {})",
      "d-b300.s2.train_first5", "d-b300.s2.train_last5", "d-b300.s0.train_first5", "d-b300.s0.train_last5",
      "d-b300.s1.train_first5", "d-b300.s1.train_last5"),
    q("reach {} % on seed 2", "d-b300.s2.ntc_max_pct"),
    q("all three of the seed's signs together on {} of 3", "f.d-b300.collapsed"),
    q("versions 40, 50, 60 read {}, {}, {}; {}, {}, {}; {}, {}, {}. **Mean {} -> {} ({}..{})**",
      *curve("d-a300", 0, (40, 50, 60)), *curve("d-a300", 1, (40, 50, 60)), *curve("d-a300", 2, (40, 50, 60)),
      *spread("d-a300")),
    q("level with d-a0 in process ({}); {}, short of +0.25. Training reward {} -> {}", "d-a0.end", "d-a300.gain",
      "d-a300.tr_first5", "d-a300.tr_last5"),
    q("(held-out starts {}, {}, {} against {}, {}, {};", "d-c300-grpo.s0.v0", "d-c300-grpo.s1.v0",
      "d-c300-grpo.s2.v0", "d-c300.s0.v0", "d-c300.s1.v0", "d-c300.s2.v0"),
    q("**All three of the seed's signs on {} of 3 seeds** (seed 1", "f.d-c300-grpo.collapsed"),
    q("mean held-out {} -> {} at 30 and {} ({}..{}) at 40", "d-c300-grpo.start", "d-c300-grpo.v30",
      "d-c300-grpo.end", "d-c300-grpo.min", "d-c300-grpo.max"),
    q("GRPO showed all three signs on {} of 3 seeds in 30 updates, its KL crossing 3x at updates {}-{} against {} "
      "and {} here", "f.d-b300.collapsed", "d-b300.s2.k3_3x", "d-b300.s1.k3_3x", "d-c300-grpo.s1.k3_3x",
      "d-c300-grpo.s2.k3_3x"),
    q("**Free vs replayed routing:** {} vs {}, within the seed spread (512 x 2: {}, 95 % interval [{}, {}]",
      "d-c300.end", "d-c300-replay.end", "final.d-c300-replay-d-c300.diff", "f.replay.lo", "f.replay.hi"),
    q("(d-c) fell {} -> {}", "d-c.start", "d-c.end"),
    q("The runner's d-a (lr 3e-4, one seed, 20 updates): {} -> {}", "d-a.start", "d-a.end"),
    # the MoE ablation reports (docs/ablation/moe-base300/, docs/ablation/moe/: verdicts.json)
    q("weight noise 0.3 / 0.6 on two groups): all {} runs stable by the rule, GRPO included: held-out GRPO {} -> {} "
      "({}..{}), SC + MIS + top-p {} ({}..{}), with routing replayed {} ({}..{}); KL peak over start {}x, {}x, {}x",
      "abl.stable_base300", *(f"{ABL300}.grpo.{c}" for c in ("heldout_start", "heldout_end", "heldout_end_min",
                                                              "heldout_end_max")),
      *(f"{ABL300}.sc_mis_topp.{c}" for c in ("heldout_end", "heldout_end_min", "heldout_end_max")),
      *(f"{ABL300}-replay.sc_mis_topp.{c}" for c in ("heldout_end", "heldout_end_min", "heldout_end_max")),
      *(f"{ABL300}{v}.kl_peak" for v in (".grpo", ".sc_mis_topp", "-replay.sc_mis_topp"))),
    q("GRPO's collapse signs: {} of 3 seeds in 30 updates", f"{ABL300}.grpo.rkt"),
    q("GRPO's held-out reward falls {} -> {} on average (KL peak x{}-x{} in 3 of 3 seeds; all three signs together "
      "at the end window on {} of 3", *(f"{ABL150}.grpo.{c}" for c in ("heldout_start", "heldout_end",
                                                                        "kl_peak_min", "kl_peak_max", "rkt"))),
    q("collapses ({} of 3 by the stated rule, held-out {} -> {}); with routing replayed its KL stays flat but its "
      "reward still falls (held-out {} -> {}, {} seeds)",
      *(f"{ABL150}.sc_mis_topp.{c}" for c in ("collapsed", "heldout_start", "heldout_end")),
      *(f"{ABL150}-replay.sc_mis_topp.{c}" for c in ("heldout_start", "heldout_end", "n"))),
    q("(3 seeds: held-out GRPO {} -> {}, SC + MIS + top-p {}, with routing replayed {}; KL peak {}x, {}x, {}x;",
      f"{ABL300}.grpo.heldout_start", f"{ABL300}.grpo.heldout_end", f"{ABL300}.sc_mis_topp.heldout_end",
      f"{ABL300}-replay.sc_mis_topp.heldout_end",
      *(f"{ABL300}{v}.kl_peak" for v in (".grpo", ".sc_mis_topp", "-replay.sc_mis_topp")), file=README),
    q("routing free, GRPO {} -> {} (\"unstable\" {}/3 by the report's rule) and SC+MIS+top-p {} -> {} held-out "
      "(collapsed {}/3); routing replayed, SC+MIS+top-p {} -> {} with flat KL ({} seeds)",
      f"{ABL150}.grpo.heldout_start", f"{ABL150}.grpo.heldout_end", "abl.unstable_moe_grpo",
      *(f"{ABL150}.sc_mis_topp.{c}" for c in ("heldout_start", "heldout_end", "collapsed")),
      *(f"{ABL150}-replay.sc_mis_topp.{c}" for c in ("heldout_start", "heldout_end", "n")), file=README),
    q("nothing collapses: held-out GRPO {} -> {}, SC+MIS+top-p {}, replayed {}", f"{ABL300}.grpo.heldout_start",
      f"{ABL300}.grpo.heldout_end", f"{ABL300}.sc_mis_topp.heldout_end", f"{ABL300}-replay.sc_mis_topp.heldout_end",
      file=README),
    # A smaller step, Open
    q("rung a-lr above: {} over 3 seeds at version 40 against {} at 3e-4, with the spread {}..{} against {}..{}",
      "a-lr.end", "a.end", "a-lr.min", "a-lr.max", "a.min", "a.max"),
    q("(d-a0, {} at 60 updates) and through the runner (d-a300, {} at 30 updates, {} at 60)", "d-a0.end",
      "d-a300.v30", "d-a300.end"),
    q("and ends {} (se {}) above the homogeneous asynchronous fleet with the same loss on the 512 x 2 "
      "re-evaluation, 95 % interval [{}, {}]", "final.d-c300-d-b300-c.diff", "final.d-c300-d-b300-c.se",
      "f.moe.lo", "f.moe.hi"),
    q("asynchronous GRPO on that homogeneous fleet falls (d-b300, {})", "d-b300.end"),
    # README: the learning paragraph
    q("held-out reward **{} -> {}** (ends {}..{}), the issue's bar; at 3e-4 (rung a) {} -> {}, two seeds at {} / {} "
      "and one falling back to {}", *spread("a-lr"), "a.start", "a.end", "a.s0.v40", "a.s1.v40", "a.s2.v40",
      file=README),
    q("(c-grpo-lr) held-out **{} -> {}**, all three signs on {} of 3 seeds; on one fp32 group from the same base "
      "(b-lr) {} -> {}, the same 2 seeds collapsing {}-{} updates later", "c-grpo-lr.start", "c-grpo-lr.end",
      "f.c-grpo-lr.collapsed", "b-lr@same.start", "b-lr@same.end", "f.sooner.min", "f.sooner.max", file=README),
    q("(0-3 updates, and at update 40 the mixed fleet is the higher one on {} of 3 seeds)",
      "f.sooner.mixed_higher_end", file=README),
    q("one fp32 group (b-c-lr) **{} -> {}**, the mixed bf16 / fp8 / nvfp4 fleet (c-lr) **{} -> {}**: mixed minus "
      "homogeneous {} (se {}, 95 % interval [{}, {}])", "b-c-lr.start", "b-c-lr.end", "c-lr.start", "c-lr.end",
      "f.dense.diff", "f.dense.se", "f.dense.lo", "f.dense.hi", file=README),
    q("At 3e-4 the same rungs stay flat ({} -> {}, {} -> {})", "b-c.start", "b-c.end", "c.start", "c.end",
      file=README),
    q("on-policy in process (d-a0) **{} -> {}** over 3 seeds in 60 updates, through the real runner (d-a300) "
      "**{} -> {}**; the mixed asynchronous fleet with SC + MIS + top-p (d-c300) {} -> {} in 30 (routing replayed "
      "{}), level with on-policy at 30 ({} in process, {} through the runner) and, re-evaluated on 512 x 2 "
      "episodes, {} (se {}, 95 % interval [{}, {}])", "d-a0.start", "d-a0.end", "d-a300.start", "d-a300.end",
      "d-c300.start", "d-c300.end", "d-c300-replay.end", "d-a0.v30", "d-a300.v30", "final.d-c300-d-b300-c.diff",
      "final.d-c300-d-b300-c.se", "f.moe.lo", "f.moe.hi", file=README),
    q("(d-b300, {} -> {}; all three signs together on {} of 3 seeds)", "d-b300.start", "d-b300.end",
      "f.d-b300.collapsed", file=README),
    q("it collapses by all three of the seed's signs on {} of 3 seeds in 40 updates (held-out {} -> {})",
      "f.d-c300-grpo.collapsed", "d-c300-grpo.start", "d-c300-grpo.end", file=README),
    q("the mixed fleet's KL at the start is {}-{}x the homogeneous one's", "f.kl_ratio.min", "f.kl_ratio.max",
      file=README),
    q("first 6 updates, same base; benchmarks/results/learning_treatment_bf16.json), is {}x, {}x and {}x on seeds "
      "0, 1 and 2", "f.treat_bf16.s0", "f.treat_bf16.s1", "f.treat_bf16.s2"),
    q("on its fp8 / nvfp4 groups (the treatment fleet, same base) it is {}-{}x (mean {}x, {} seeds",
      "f.treat.min", "f.treat.max", "f.treat.mean", "f.treat.n", file=README),
    # README: the measured-figures rows
    q("**{} -> {}, {} -> {}, {} -> {} (mean {} -> {}): stable, not learning at lr 3e-4", "c.s0.v0", "c.s0.v40",
      "c.s1.v0", "c.s1.v40", "c.s2.v0", "c.s2.v40", "c.start", "c.end", file=README),
    q("(rung c-lr, 3 seeds, 40 updates, 12-13 min each) {} -> {} ({}..{}); one fp32 group at that rate (b-c-lr) "
      "{}, mixed minus homogeneous {}, 95 % interval [{}, {}]", *spread("c-lr"), "b-c-lr.end", "f.dense.diff",
      "f.dense.lo", "f.dense.hi", file=README),
    q("with no no-tool-call episodes at the end ({} % in all three c-lr seeds)", "c-lr.ntc_last_max", file=README),
    q("(c-grpo-lr) **{} -> {}**, collapsing by all three of the seed's signs on {} of 3 seeds (no-tool-call share at "
      "the last update {} %, {} %, {} %)", "c-grpo-lr.start", "c-grpo-lr.end", "f.c-grpo-lr.collapsed",
      "c-grpo-lr.s0.ntc_last", "c-grpo-lr.s1.ntc_last", "c-grpo-lr.s2.ntc_last", file=README),
    q("rung a-lr {} -> {} over 3 seeds in 40 updates", "a-lr.start", "a-lr.end", file=README),
    q("training reward {} -> 0 by update {}, k3 {} -> {}, {} % of episodes ending without a tool call", "b.s0.tr.u1",
      "b.s0.tr_zero_from", "b.s0.k3.u2", "b.s0.k3_max", "b.s0.ntc_last", file=README),
    q("`guess` held-out reward {} at T = 1 (256 episodes, bf16 engine, 8 replies; the runner's 128-episode evaluation "
      "reads {}-{} by seed)", "a0.s0.v0", "a.s1.v0", "a.s0.v0", file=README),
    q("mean staleness {}; staleness-0 KL k3 (update 1, rung c seed 0) bf16 {} < fp8 {} < nvfp4 {}", "c-lr.staleness",
      "c.s0.grp.cpu-bf16.u1", "c.s0.grp.cpu-fp8.u1", "c.s0.grp.cpu-nvfp4.u1", file=README),
    q("**{} -> {} ({}..{}) with routing free, {} -> {} ({}..{}) with routing replayed**", *spread("d-c300"),
      *spread("d-c300-replay"), file=README),
    q("on-policy in process (d-a0) {} at the same 30 updates and **{} ({}..{}) at 60**", "d-a0.v30", "d-a0.end",
      "d-a0.min", "d-a0.max", file=README),
    q("same loss (d-b300-c) {} -> {} ({}..{})", *spread("d-b300-c"), file=README),
    q("(`mixfleet evaluate`, base {}): **mixed {}, homogeneous {}, difference {} (se {}, 95 % interval [{}, {}]",
      "final.base.mean", "final.d-c300.mean", "final.d-b300-c.mean", "final.d-c300-d-b300-c.diff",
      "final.d-c300-d-b300-c.se", "f.moe.lo", "f.moe.hi", file=README),
    q("replayed {}; on-policy through the runner (d-a300) {} -> {} at 30 updates and **{} ({}..{}) at 60**",
      "final.d-c300-replay.mean", "d-a300.start", "d-a300.v30", "d-a300.end", "d-a300.min", "d-a300.max",
      file=README),
    q("(d-b300) **{} -> {}** (one seed to {}, k3 x{}..x{} from its first 5 updates to its last 5, all three "
      "collapse signs together on {} of 3 seeds)", "d-b300.start", "d-b300.end", "d-b300.min",
      "d-b300.s0.k3_growth", "d-b300.s2.k3_growth", "f.d-b300.collapsed", file=README),
    q("**{} -> {}**, all three collapse signs on {} of 3 seeds (one seed to {})", "d-c300-grpo.start",
      "d-c300-grpo.end", "f.d-c300-grpo.collapsed", "d-c300-grpo.min", file=README),
    q("the same fleet fell {} -> {}", "d-c.start", "d-c.end", file=README),
]


def check_claims(root: Path, f: dict[str, float]) -> list[str]:
    errors = []
    for c in CLAIMS:
        text = (root / c.file).read_text()
        ms = list(re.finditer(c.pattern, text))
        if not ms:
            errors.append(f"{c.file}: no text matches the claim /{c.pattern}/ (reworded? re-point it in CLAIMS)")
            continue
        for m in ms:
            if len(m.groups()) != len(c.facts):
                errors.append(f"CLAIMS: /{c.pattern}/ has {len(m.groups())} groups for {len(c.facts)} facts")
                break
            for quoted, name in zip(m.groups(), c.facts, strict=True):
                if name not in f:
                    errors.append(f"CLAIMS: no fact {name!r} in the results (quoted {quoted!r})")
                    continue
                want = f[name]
                mantissa, _, exponent = quoted.partition("e")
                decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
                tolerance = 0.5 * 10 ** (-decimals + int(exponent or 0))       # rounded as written
                got = float(quoted.replace("+", ""))
                if math.isnan(want) or abs(got - want) > tolerance * (1 + 1e-9):
                    line = text.count("\n", 0, m.start()) + 1
                    said = f"{want:.{decimals}e}" if exponent else f"{want:.{decimals}f}"
                    errors.append(f"{c.file}:{line}: quotes {quoted} for {name}, the results say {said} ({want!r})")
    return errors


def check_blocks(root: Path, data: dict[str, Any], write: bool) -> list[str]:
    errors = []
    seen = set()
    for rel in (DOC, README):
        path = root / rel
        text = path.read_text()

        def redo(m: re.Match[str], rel: str = rel, text: str = text) -> str:
            name = m.group(2)
            if name not in BLOCKS:
                errors.append(f"{rel}: unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
                return m.group(0)
            seen.add(name)
            want = BLOCKS[name](data) + "\n"
            if m.group(3) != want and not write:
                line = text.count("\n", 0, m.start()) + 2
                have, new = m.group(3).splitlines(), want.splitlines()
                diff = next((i for i, (a, b) in enumerate(zip(have, new, strict=False)) if a != b),
                            min(len(have), len(new)))
                errors.append(f"{rel}:{line + diff}: generated block {name!r} differs from the results "
                              f"(page: {have[diff] if diff < len(have) else '<end>'!r}; results: "
                              f"{new[diff] if diff < len(new) else '<end>'!r}); `--write` regenerates it")
            return m.group(1) + want + m.group(4)

        new_text = BLOCK_RE.sub(redo, text)
        if write and new_text != text:
            path.write_text(new_text)
    for name in BLOCKS:
        if name not in seen:
            errors.append(f"{DOC}: the generated block {name!r} is missing (`<!-- generated: {name} -->` ... "
                          "`<!-- end -->`)")
    return errors


def check(root: Path = ROOT, results: Path = RESULTS, write: bool = False) -> list[str]:
    data = load(results)
    return check_blocks(root, data, write) + check_claims(root, facts(data))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate the generated blocks before checking")
    ap.add_argument("--facts", action="store_true", help="print every fact a claim may quote")
    args = ap.parse_args(argv)
    if args.facts:
        for k, v in sorted(facts(load()).items()):
            print(f"{k} = {v:.4f}")
        return 0
    errors = check(write=args.write)
    for e in errors:
        print(e)
    n = len(CLAIMS)
    print(f"{len(errors)} disagreement(s); {len(BLOCKS)} generated blocks, {n} inline claims checked" if errors
          else f"ok: {len(BLOCKS)} generated blocks and {n} inline claims agree with the results files")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
