"""The ablation report: reads the study's run logs (studies/ablation.py) and writes Markdown + plots.

Per variant over updates (mean over seeds, per fleet): reward, sampler-trainer KL (k3) overall and per sampler
group, share of tokens whose ratio r = p/q is outside [0.2, 5], gradient norm, entropy, and the share of
episodes ending on three replies without a tool call ("no_tool_call_3x"). A verdict per run by the rule in
`VERDICT_RULE` (written into the report). Per group: share of samples vs share of the extreme-ratio tokens
(the seed's H100-FP8 vs NVFP4 comparison), plus the share outside the MIS band [0.5, 2].

Plots are PNG through plotly + kaleido when kaleido (and a Chromium) work here, else plotly HTML files
(plotly.js from its CDN when opened; nothing is downloaded while the report is built).

    from mixfleet.studies.ablation_report import write_report
    write_report("runs/ablation", "docs/ablation", notes="docs/ablation/notes.md")
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from mixfleet.costmodel.records.runlog import RunLog, extreme_shares
from mixfleet.costmodel.records.trackers import eval_frame

RUN_FILE = "ablation_run.json"          # the sidecar studies/ablation.py writes (kept in sync by name)
ABLATION_FILE = "ablation.json"
NO_TOOL = "no_tool_call_3x"
REWARD_DROP = 0.1                        # reward units (episode reward in [0, 1])
KL_GROWTH = 3.0                          # x from the start window
NO_TOOL_END = 0.25                       # share of episodes ending on 3 replies without a tool call
VERDICT_RULE = (
    "For each run, the *end window* is its last w updates, w = max(1, min(4, updates // 4)). The reward's "
    "*start window* is its first w updates: their batches were sampled (almost) by the base policy, so their "
    "mean reward is the base policy's reward on that fleet. The KL's start window is the first w updates once "
    "the staleness has reached its plateau (mean staleness >= 0.9x the run's median): the first updates are "
    "trained on fresher samples, and their lower KL would inflate the growth. A run **collapsed** if its "
    f"end-window mean reward is more than {REWARD_DROP} below its start-window mean **and** its end-window mean "
    f"KL (k3) is >= {KL_GROWTH:g}x its start-window mean (the seed's two signs together). It is **unstable** if "
    "exactly one of the two holds, else **stable**. The *signs* column lists which of the seed's three signs "
    f"occurred: R (reward fell by more than {REWARD_DROP}), K (KL >= {KL_GROWTH:g}x), T (>= "
    f"{NO_TOOL_END:.0%} of the end window's episodes ended on three replies without a tool call, up from the "
    "start). *KL peak* (the run's largest KL over its start window) is reported beside the rule, not in it: a "
    "policy that has collapsed into one deterministic reply can bring the end-window KL back down. The thresholds "
    "were set in the first ablation, after its first two runs were seen, and have not changed "
    "since: every run reported with this text started after the rule was fixed. The numbers are all in the "
    "tables, so other rules can be applied to them. Held-out reward (the runner's evaluation: the task's eval "
    "split at the run's temperature over the full vocabulary) is reported beside the rule, not part of it.")
ORDER = ("grpo", "grpo_mis", "sc", "grpo_topp", "sc_mis", "sc_mis_topp")
LABELS = {"grpo": "GRPO", "grpo_mis": "GRPO+MIS", "sc": "SC", "grpo_topp": "GRPO+top-p", "sc_mis": "SC+MIS",
          "sc_mis_topp": "SC+MIS+top-p"}
COLORS = {"grpo": "#d62728", "grpo_mis": "#ff7f0e", "sc": "#9467bd", "grpo_topp": "#8c564b", "sc_mis": "#1f77b4",
          "sc_mis_topp": "#2ca02c"}
SMOOTH = 3                               # rolling mean (updates) of the noisy per-batch shares in the plots
SMOOTHED = ("reward", "no_tool_share")
METRICS = (("reward", f"reward (rolling mean of {SMOOTH})"), ("kl_k3", "KL k3 (sampler vs trainer)"),
           ("extreme_share", "share of tokens r outside [0.2, 5]"), ("grad_norm", "gradient norm"),
           ("entropy", "entropy (nats/token)"),
           ("no_tool_share", f"episodes ending: 3 replies w/o tool call ({SMOOTH})"))


@dataclass(frozen=True, kw_only=True)
class RunData:
    """One run's per-update series and per-group rows."""

    fleet: str
    variant: str
    seed: int
    path: Path
    status: str
    series: pd.DataFrame          # index version: reward, kl_k3, extreme_share, masked_share, grad_norm, entropy,
                                  # no_tool_share, tokens, staleness, kl_on_policy
    groups: pd.DataFrame          # the run log's groups table
    on_policy: pd.DataFrame       # per (version, group): k3, tokens over staleness-0 tokens (groups table)
    evals: pd.DataFrame           # held-out evaluations: version, reward (mean, at T), pass_at_k, k, problems


def _window(n: int) -> int:
    return max(1, min(4, n // 4))


def load_run(path: str | Path) -> RunData:
    """Read one run folder (run log + `ablation_run.json`)."""
    path = Path(path)
    meta = json.loads((path / RUN_FILE).read_text()) if (path / RUN_FILE).exists() else {}
    log = RunLog.open(path)
    up = log.updates.sort_values("version").drop_duplicates("version", keep="last").set_index("version")
    s = pd.DataFrame(index=up.index)
    s["reward"] = up["reward_mean"]
    s["kl_k3"] = up["kl_k3"]
    s["extreme_share"] = extreme_shares(up).fillna(0.0)
    s["masked_share"] = up["masked_share"]
    s["grad_norm"] = up["grad_norm"]
    s["entropy"] = up["entropy"]
    s["tokens"] = up["tokens"]
    s["staleness"] = up["staleness_mean"]
    on_policy = _on_policy(log.groups)
    if len(on_policy):
        w = on_policy.assign(kt=on_policy["k3"] * on_policy["tokens"]).groupby("version")[["kt", "tokens"]].sum()
        s["kl_on_policy"] = (w["kt"] / w["tokens"].where(w["tokens"] > 0)).reindex(s.index)
    else:
        s["kl_on_policy"] = math.nan
    tr = log.trajectories
    tr = tr[tr["trained_version"] >= 1] if len(tr) else tr
    if len(tr):
        share = tr.assign(nt=(tr["finish_reason"] == NO_TOOL).astype(float)).groupby("trained_version")["nt"].mean()
        s["no_tool_share"] = share.reindex(s.index)
    else:
        s["no_tool_share"] = math.nan
    fleet = meta.get("fleet") or path.parent.parent.name
    variant = meta.get("variant") or path.parent.name
    seed = int(meta.get("seed", log.header.get("seed", 0)))
    return RunData(fleet=fleet, variant=variant, seed=seed, path=path, status=str(log.header.get("status", "")),
                   series=s, groups=log.groups, on_policy=on_policy, evals=eval_frame(log.events))


def heldout_change(r: RunData) -> tuple[float, float]:
    """(held-out reward at the first evaluation, at the last); NaN where the run has fewer than two."""
    e = r.evals
    if len(e) < 2:
        return math.nan, math.nan
    return float(e["reward"].iloc[0]), float(e["reward"].iloc[-1])


def spread(values: list[float]) -> str:
    """"mean (min..max)" of the finite values, "n/a" without any."""
    v = [x for x in values if math.isfinite(x)]
    if not v:
        return "n/a"
    return f"{sum(v) / len(v):.3f} ({min(v):.3f}..{max(v):.3f})"


def _on_policy(groups: pd.DataFrame) -> pd.DataFrame:
    """The groups table's on-policy KL (over tokens sampled by the weights being trained: the precision
    mismatch without staleness) as rows (version, group, k3, tokens), where a group had such tokens."""
    g = groups[(groups["tokens_on_policy"] > 0) & groups["kl_k3_on_policy"].notna()] if len(groups) else groups
    return pd.DataFrame({"version": g["version"].astype(int), "group": g["group"], "k3": g["kl_k3_on_policy"],
                         "tokens": g["tokens_on_policy"].astype(float)}).reset_index(drop=True)


def find_runs(root: str | Path) -> list[RunData]:
    """Every run under `root` that has a run log with at least one update (sorted fleet, variant, seed)."""
    runs = []
    for p in sorted(Path(root).rglob("run.json")):
        if not RunLog.is_run_log(p.parent):
            continue
        r = load_run(p.parent)
        if len(r.series):
            runs.append(r)
    key = {v: i for i, v in enumerate(ORDER)}
    return sorted(runs, key=lambda r: (r.fleet != "mixed", r.fleet, key.get(r.variant, 99), r.variant, r.seed))


def verdict(series: pd.DataFrame) -> dict[str, Any]:
    """The stated rule (`VERDICT_RULE`) on one run's series, with the numbers it used."""
    n = len(series)
    w = _window(n)
    a, b = series.iloc[:w], series.iloc[-w:]
    st = series["staleness"] if "staleness" in series else pd.Series(0.0, index=series.index)
    plateau = series[st >= 0.9 * float(st.median())] if st.notna().any() else series
    ka = plateau.iloc[:w] if len(plateau) >= 2 * w else a
    r0, r1 = float(a["reward"].mean()), float(b["reward"].mean())
    k0, k1 = float(ka["kl_k3"].mean()), float(b["kl_k3"].mean())
    growth = k1 / k0 if k0 > 0 else (math.inf if k1 > 0 else 1.0)
    kpeak = float(series["kl_k3"].max())
    peak = kpeak / k0 if k0 > 0 else (math.inf if kpeak > 0 else 1.0)   # reported beside the rule, not in it
    reward_fell = r1 < r0 - REWARD_DROP
    kl_grew = growth >= KL_GROWTH
    nt0, nt1 = float(a["no_tool_share"].mean()), float(b["no_tool_share"].mean())
    no_tool = nt1 >= NO_TOOL_END and nt1 > nt0
    signs = "".join(c for c, on in (("R", reward_fell), ("K", kl_grew), ("T", no_tool)) if on) or "-"
    v = "collapsed" if reward_fell and kl_grew else "unstable" if reward_fell or kl_grew else "stable"
    nonzero = series["grad_norm"][series["grad_norm"] > 0]     # 0: a batch whose groups all had equal rewards
    g0 = float(nonzero.iloc[:w].mean()) if len(nonzero) else math.nan
    return {"updates": n, "window": w, "reward_start": r0, "reward_end": r1, "kl_start": k0, "kl_end": k1,
            "kl_growth": growth, "kl_peak_growth": peak, "reward_fell": reward_fell, "kl_grew": kl_grew,
            "no_tool_rose": no_tool,
            "signs": signs, "verdict": v, "kl_start_from_update": int(ka.index[0]),
            "extreme_start": float(a["extreme_share"].mean()), "extreme_end": float(b["extreme_share"].mean()),
            "grad_start": g0, "grad_max_over_start": float(nonzero.max()) / g0 if g0 > 0 else math.nan,
            "entropy_start": float(a["entropy"].mean()), "entropy_end": float(b["entropy"].mean()),
            "no_tool_start": nt0, "no_tool_end": nt1}


def mean_series(runs: list[RunData]) -> pd.DataFrame:
    """Mean over runs (seeds) per version, on the versions every run reached."""
    frames = [r.series for r in runs]
    common = frames[0].index
    for f in frames[1:]:
        common = common.intersection(f.index)
    return sum(f.loc[common] for f in frames) / len(frames)


def group_table(runs: list[RunData]) -> pd.DataFrame:
    """Per group over the given runs: share of samples, of trained tokens, of extreme-ratio tokens (r outside
    [0.2, 5]) and of out-of-band tokens (r outside the MIS band [0.5, 2]), token-weighted KL k3."""
    g = pd.concat([r.groups for r in runs], ignore_index=True) if runs else pd.DataFrame()
    if not len(g):
        return pd.DataFrame()
    g = g.assign(tok=g["tokens_trained"].astype(float))
    g = g.assign(ext_tok=g["extreme_share"].fillna(0.0) * g["tok"], band_tok=g["masked_share"].fillna(0.0) * g["tok"],
                 kl_tok=g["kl_k3"].fillna(0.0) * g["tok"])
    agg = g.groupby("group")[["samples", "tok", "ext_tok", "band_tok", "kl_tok"]].sum()
    out = pd.DataFrame(index=agg.index)
    out["share_of_samples"] = agg["samples"] / max(agg["samples"].sum(), 1e-12)
    out["share_of_tokens"] = agg["tok"] / max(agg["tok"].sum(), 1e-12)
    out["extreme_tokens"] = agg["ext_tok"]
    out["share_of_extreme_tokens"] = agg["ext_tok"] / agg["ext_tok"].sum() if agg["ext_tok"].sum() > 0 else math.nan
    out["extreme_share_in_group"] = agg["ext_tok"] / agg["tok"].clip(lower=1e-12)
    out["share_of_out_of_band_tokens"] = (agg["band_tok"] / agg["band_tok"].sum() if agg["band_tok"].sum() > 0
                                          else math.nan)
    out["out_of_band_share_in_group"] = agg["band_tok"] / agg["tok"].clip(lower=1e-12)
    out["kl_k3"] = agg["kl_tok"] / agg["tok"].clip(lower=1e-12)
    op = pd.concat([r.on_policy for r in runs], ignore_index=True)
    if len(op):
        op = op.assign(kt=op["k3"] * op["tokens"]).groupby("group")[["kt", "tokens"]].sum()
        out["kl_on_policy"] = (op["kt"] / op["tokens"]).reindex(out.index)
    else:
        out["kl_on_policy"] = math.nan
    return out


# ---- plots -------------------------------------------------------------------------------------------------
def _png_ok() -> bool:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return True


def _save(fig: Any, out: Path, stem: str, png: bool, width: int, height: int) -> str:
    if png:
        try:
            fig.write_image(str(out / f"{stem}.png"), width=width, height=height, scale=1)
            return f"{stem}.png"
        except Exception:  # noqa: BLE001 - no Chromium / kaleido failure: fall back to HTML
            pass
    fig.write_html(str(out / f"{stem}.html"), include_plotlyjs="cdn")
    return f"{stem}.html"


def _smooth(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for col in SMOOTHED:
        out[col] = df[col].rolling(SMOOTH, min_periods=1).mean()
    return out


def _fig_metrics(fleet: str, by_variant: dict[str, list[RunData]]) -> Any:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=3, subplot_titles=[t for _, t in METRICS], horizontal_spacing=0.07,
                        vertical_spacing=0.12)
    for v, runs in by_variant.items():
        m = _smooth(mean_series(runs))
        for i, (col, _) in enumerate(METRICS):
            row, c = i // 3 + 1, i % 3 + 1
            for r in runs:                                    # thin lines: each seed
                y = _smooth(r.series)[col]
                fig.add_scatter(x=list(r.series.index), y=list(y), mode="lines", row=row, col=c,
                                line={"color": COLORS.get(v, "#777"), "width": 0.7}, opacity=0.35,
                                showlegend=False, hoverinfo="skip")
            fig.add_scatter(x=list(m.index), y=list(m[col]), mode="lines", name=LABELS.get(v, v), row=row, col=c,
                            line={"color": COLORS.get(v, "#777"), "width": 2.2}, legendgroup=v, showlegend=i == 0)
    for i, (col, _) in enumerate(METRICS):
        if col == "kl_k3":
            fig.update_yaxes(type="log", row=i // 3 + 1, col=i % 3 + 1)
    fig.update_xaxes(title_text="update")
    fig.update_layout(title=f"{fleet} fleet: per variant (thick: mean over seeds; thin: each seed)",
                      template="plotly_white", legend={"orientation": "h", "y": -0.12})
    return fig


def _fig_heldout(fleet: str, by_variant: dict[str, list[RunData]]) -> Any:
    """Held-out reward per variant over versions: each seed thin, the mean thick, the seeds' min..max shaded."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for v, runs in by_variant.items():
        ev = [r.evals.set_index("version")["reward"] for r in runs if len(r.evals)]
        if not ev:
            continue
        color = COLORS.get(v, "#777")
        for r, e in zip(runs, ev, strict=False):
            fig.add_scatter(x=list(e.index), y=list(e), mode="lines+markers", line={"color": color, "width": 0.7},
                            opacity=0.35, showlegend=False, hovertext=f"seed {r.seed}")
        both = pd.concat(ev, axis=1).dropna()             # versions every seed evaluated
        if not len(both):
            continue
        lo, hi, mean = both.min(axis=1), both.max(axis=1), both.mean(axis=1)
        fig.add_scatter(x=list(both.index) + list(both.index[::-1]), y=list(hi) + list(lo[::-1]), fill="toself",
                        line={"width": 0}, fillcolor=color, opacity=0.15, showlegend=False, hoverinfo="skip")
        fig.add_scatter(x=list(both.index), y=list(mean), mode="lines+markers", name=LABELS.get(v, v),
                        line={"color": color, "width": 2.4})
    fig.update_layout(title=f"{fleet} fleet: held-out reward at T = 1 (thick: mean over seeds; band: min..max)",
                      template="plotly_white", xaxis_title="version (update)", yaxis_title="held-out reward",
                      yaxis={"range": [0, 1]})
    return fig


def _fig_group_kl(fleet: str, by_variant: dict[str, list[RunData]]) -> Any:
    from plotly.subplots import make_subplots

    keys = list(by_variant)
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=[LABELS.get(k, k) for k in keys], shared_yaxes=True)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    names: list[str] = []
    for j, k in enumerate(keys):
        g = pd.concat([r.groups for r in by_variant[k]], ignore_index=True)
        if not len(g):
            continue
        per = g.groupby(["group", "version"])["kl_k3"].mean().reset_index()
        for name, d in per.groupby("group"):
            if name not in names:
                names.append(name)
            fig.add_scatter(x=list(d["version"]), y=list(d["kl_k3"]), mode="lines", name=str(name), row=1, col=j + 1,
                            line={"color": palette[names.index(name) % len(palette)]}, legendgroup=str(name),
                            showlegend=j == 0)
    fig.update_yaxes(type="log")
    fig.update_xaxes(title_text="update")
    fig.update_layout(title=f"{fleet} fleet: KL k3 per sampler group (mean over seeds)", template="plotly_white")
    return fig


def _fig_group_shares(fleet: str, table: pd.DataFrame) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for col, name in (("share_of_samples", "share of samples"),
                      ("share_of_extreme_tokens", "share of tokens with r outside [0.2, 5]"),
                      ("share_of_out_of_band_tokens", "share of tokens with r outside [0.5, 2]")):
        fig.add_bar(x=list(table.index), y=[0.0 if pd.isna(x) else float(x) for x in table[col]], name=name)
    fig.update_layout(barmode="group", title=f"{fleet} fleet: per sampler group (all variants and seeds)",
                      template="plotly_white", yaxis_title="share")
    return fig


# ---- Markdown ----------------------------------------------------------------------------------------------
def _f(x: float, spec: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.2f} %"


def build_report(root: str | Path, out_dir: str | Path, *, notes: str | Path | None = None,
                 plots: bool = True, include_unfinished: bool = False,
                 seeds: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Read the runs under `root`, write `out_dir/README.md`, the plots, `verdicts.json` and `series.csv` (every
    run's per-update series); returns the verdicts and the per-group tables."""
    root, out = Path(root), Path(out_dir)
    found = [r for r in find_runs(root) if seeds is None or r.seed in seeds]
    runs = [r for r in found if include_unfinished or r.status == "finished"]
    left_out = [r for r in found if r not in runs]
    if not runs:
        raise ValueError(f"ablation report: no run log with updates under {root}; allowed: the --out folder of "
                         "`mixfleet experiment ablation`")
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((root / ABLATION_FILE).read_text()) if (root / ABLATION_FILE).exists() else {}
    png = plots and _png_ok()
    lines: list[str] = ["# Ablation: which corrections keep mixed-sampler RL stable (small scale)", ""]
    if notes is not None and Path(notes).exists():
        lines += [Path(notes).read_text().rstrip(), ""]
    cfg = manifest.get("config", {})
    fleets = sorted({r.fleet for r in runs}, key=lambda f: (f != "mixed", f))
    seeds = sorted({r.seed for r in runs})
    n_up = sorted({len(r.series) for r in runs})
    lines += ["## Setup", "",
              f"- Runs: {len(runs)} ({', '.join(fleets)} fleets x {len({r.variant for r in runs})} variants x "
              f"{len(seeds)} seeds: {', '.join(map(str, seeds))}); updates per run: "
              f"{', '.join(map(str, n_up))} (target {cfg.get('updates', 'n/a')}).",
              f"- Plans: {', '.join(f'{k}: `{v}`' for k, v in manifest.get('plans', {}).items()) or 'n/a'}; "
              f"learning rate {cfg.get('lr', 'n/a')}; top-p of the top-p variants {cfg.get('top_p', 'n/a')}.",
              f"- Base policy: `{Path(str(manifest.get('base_policy', ''))).name or 'n/a'}` (the cached "
              "`mixfleet pretrain` checkpoint unless the study set another).",
              "- Not finished, left out: " + (", ".join(f"{r.fleet}/{r.variant}/seed{r.seed} ({len(r.series)} updates)"
                                                       for r in left_out) or "none") + ".", "",
              "## Verdict rule", "", VERDICT_RULE, ""]
    result: dict[str, Any] = {"verdicts": [], "groups": {}}
    for fleet in fleets:
        fr = [r for r in runs if r.fleet == fleet]
        by_variant: dict[str, list[RunData]] = {}
        for r in fr:
            by_variant.setdefault(r.variant, []).append(r)
        lines += [f"## {fleet.capitalize()} fleet", ""]
        if plots:
            name = _save(_fig_metrics(fleet, by_variant), out, f"{fleet}_metrics", png, 1500, 850)
            lines += [f"![{fleet} metrics]({name})" if name.endswith(".png") else f"[{fleet} metrics (HTML)]({name})",
                      ""]
            if any(len(r.evals) for r in fr):
                name = _save(_fig_heldout(fleet, by_variant), out, f"{fleet}_heldout", png, 900, 450)
                lines += [f"![{fleet} held-out reward]({name})" if name.endswith(".png")
                          else f"[{fleet} held-out reward (HTML)]({name})", ""]
        lines += ["| variant | seed | updates | reward start -> end | held-out start -> end | KL k3 start -> end (x) | "
                  "KL peak (x) | r outside [0.2, 5] start -> end | grad norm max / start (non-zero) | "
                  "entropy start -> end | no tool call x3 start -> end | signs | verdict |", "|" + "---|" * 13]
        for r in fr:
            v = verdict(r.series)
            h0, h1 = heldout_change(r)
            result["verdicts"].append({"fleet": fleet, "variant": r.variant, "seed": r.seed, **v,
                                       "heldout_start": h0, "heldout_end": h1})
            lines.append(
                f"| {LABELS.get(r.variant, r.variant)} | {r.seed} | {v['updates']} | {_f(v['reward_start'])} -> "
                f"{_f(v['reward_end'])} | {_f(h0)} -> {_f(h1)} | "
                f"{_f(v['kl_start'], '.2e')} -> {_f(v['kl_end'], '.2e')} "
                f"({_f(v['kl_growth'], '.1f')}x) | {_f(v['kl_peak_growth'], '.1f')}x | "
                f"{_pct(v['extreme_start'])} -> {_pct(v['extreme_end'])} | "
                f"{_f(v['grad_max_over_start'], '.1f')} | {_f(v['entropy_start'])} -> {_f(v['entropy_end'])} | "
                f"{_pct(v['no_tool_start'])} -> {_pct(v['no_tool_end'])} | {v['signs']} | **{v['verdict']}** |")
        lines += ["", "Per variant (over seeds; mean (min..max)):", "", "| variant | seeds | verdicts | runs with each "
                  "sign (R, K, T) | reward start | reward end | held-out start | held-out end | KL growth | KL peak | "
                  "share of episodes without tool calls, end |", "|" + "---|" * 11]
        for k, rs in by_variant.items():
            vs = [verdict(r.series) for r in rs]
            hs = [heldout_change(r) for r in rs]
            counts = {x: sum(1 for y in vs if y["verdict"] == x) for x in ("stable", "unstable", "collapsed")}
            sign_counts = ", ".join(f"{c} {sum(1 for y in vs if c in y['signs'])}/{len(vs)}" for c in "RKT")
            lines.append(f"| {LABELS.get(k, k)} | {len(rs)} | " + ", ".join(f"{c} {x}" for x, c in counts.items() if c)
                         + f" | {sign_counts} | {spread([v['reward_start'] for v in vs])} | "
                         f"{spread([v['reward_end'] for v in vs])} | {spread([h[0] for h in hs])} | "
                         f"{spread([h[1] for h in hs])} | {spread([v['kl_growth'] for v in vs])} | "
                         f"{spread([v['kl_peak_growth'] for v in vs])} | "
                         f"{spread([v['no_tool_end'] for v in vs])} |")
        lines.append("")
        table = group_table(fr)
        result["groups"][fleet] = table
        if len(table):
            if plots and len(table) > 1:
                name = _save(_fig_group_kl(fleet, by_variant), out, f"{fleet}_group_kl", png, 1500, 420)
                lines += [f"![{fleet} KL per group]({name})" if name.endswith(".png")
                          else f"[{fleet} KL per group (HTML)]({name})", ""]
                name = _save(_fig_group_shares(fleet, table), out, f"{fleet}_group_shares", png, 900, 450)
                lines += [f"![{fleet} group shares]({name})" if name.endswith(".png")
                          else f"[{fleet} group shares (HTML)]({name})", ""]
            lines += ["Per sampler group (all variants and seeds; token-weighted):", "",
                      "| group | share of samples | share of trained tokens | KL k3 | KL k3 on-policy tokens | "
                      "r outside [0.2, 5]: in group | share of all such tokens | r outside [0.5, 2]: in group | "
                      "share of all such tokens |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for g, row in table.iterrows():
                lines.append(f"| {g} | {_pct(row['share_of_samples'])} | {_pct(row['share_of_tokens'])} | "
                             f"{_f(row['kl_k3'], '.2e')} | {_f(row['kl_on_policy'], '.2e')} | "
                             f"{_pct(row['extreme_share_in_group'])} | "
                             f"{_pct(row['share_of_extreme_tokens'])} | {_pct(row['out_of_band_share_in_group'])} | "
                             f"{_pct(row['share_of_out_of_band_tokens'])} |")
            lines += ["", "KL k3 is over all trained tokens (sampled up to the plan's max staleness versions before); "
                      "'on-policy tokens' is over the tokens sampled by the very weights being trained (staleness "
                      "0): the precision / kernel mismatch alone.", ""]
    if not png and plots:
        lines += ["(Plots are HTML: kaleido was not available to render PNGs.)", ""]
    (out / "README.md").write_text("\n".join(lines))
    (out / "verdicts.json").write_text(json.dumps(result["verdicts"], indent=1, default=float))
    series = pd.concat([r.series.reset_index().assign(fleet=r.fleet, variant=r.variant, seed=r.seed) for r in runs],
                       ignore_index=True)
    cols = ["fleet", "variant", "seed", "version"] + [c for c in series.columns
                                                      if c not in ("fleet", "variant", "seed", "version")]
    series[cols].to_csv(out / "series.csv", index=False, float_format="%.6g")
    return result
