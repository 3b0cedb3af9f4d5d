"""Plotly figures for the Streamlit app, built from run-log frames and planner results.

Presentation only: each function reshapes columns that costmodel / twin / planner already produced
(run-log tables, `RunSummary.to_dict()`, Pareto points) into a figure with labelled axes and units.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

HEIGHT_PX = 320
_LAYOUT = {"height": HEIGHT_PX, "margin": {"l": 10, "r": 10, "t": 40, "b": 10},
           "legend": {"orientation": "h", "y": -0.25}}


def _fig(title: str, x: str, y: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, **_LAYOUT)
    return fig


def _integer_versions(fig: go.Figure, versions: pd.Series) -> go.Figure:
    """Whole-number ticks on a version axis when there are few versions."""
    if len(versions) and versions.max() - versions.min() <= 20:
        fig.update_xaxes(dtick=1, tickformat="d")
    return fig


def has_values(df: pd.DataFrame, column: str) -> bool:
    return column in df and len(df) > 0 and bool(df[column].notna().any())


# ---- per update ------------------------------------------------------------------------------------
def update_series(updates: pd.DataFrame, columns: Mapping[str, str], *, title: str, y: str,
                  overlay: pd.DataFrame | None = None, overlay_name: str = "twin prediction",
                  percent: bool = False) -> go.Figure:
    """Lines of update-table columns ({column: legend name}) vs version; the overlay dashed."""
    fig = _fig(title, "update (weight version)", y)
    k = 100.0 if percent else 1.0
    for col, name in columns.items():
        if has_values(updates, col):
            fig.add_trace(go.Scatter(x=updates["version"], y=updates[col] * k, mode="lines+markers", name=name))
        if overlay is not None and has_values(overlay, col):
            fig.add_trace(go.Scatter(x=overlay["version"], y=overlay[col] * k, mode="lines",
                                     name=f"{name} ({overlay_name})", line={"dash": "dash"}))
    return _integer_versions(fig, updates["version"])


def heldout_frame(events: pd.DataFrame | None) -> pd.DataFrame:
    """The run's held-out evaluations with their sampling settings (`costmodel.records.trackers.eval_frame`)."""
    from mixfleet.costmodel.records.trackers import eval_frame

    return eval_frame(events)


def heldout_settings(frame: pd.DataFrame) -> str:
    """How the held-out numbers were sampled, in words, from the last evaluation's record."""
    if len(frame) == 0:
        return ""
    last = frame.iloc[-1]
    head = f"{int(last['problems'])} held-out problems x {int(last['k'])} samples (pass@{int(last['k'])})"
    if pd.isna(last.get("temperature")):
        return head + "; its sampling settings are not recorded in this run log (evaluations before 2026-12-01)"
    turns = "the task's own turn cap" if pd.isna(last.get("max_turns")) else f"<= {int(last['max_turns'])} turns"
    top_p = last.get("top_p")
    nucleus = ("the full vocabulary (no top-p, no top-k)" if pd.isna(top_p) or float(top_p) >= 1
               else f"the top-p {float(top_p):g} nucleus (no top-k; the policy a top-p run trains)")
    return (f"{head} of task {last['task']}, sampled at temperature {float(last['temperature']):g} from {nucleus}, "
            f"<= {int(last['max_new_tokens'])} new tokens per turn, {turns}, {last['precision']} weights")


def extreme_share_frame(updates: pd.DataFrame) -> pd.DataFrame:
    """version + extreme_share: the share of tokens with ratio below 0.2 or above 5."""
    from mixfleet.costmodel.records.runlog import extreme_shares

    return pd.DataFrame({"version": updates["version"], "extreme_share": extreme_shares(updates)})


def tokens_per_s_frame(updates: pd.DataFrame, groups: pd.DataFrame) -> pd.DataFrame:
    """version + tokens_per_s: tokens the groups generated in each update's window / the window's length."""
    if len(updates) == 0:
        return pd.DataFrame({"version": [], "tokens_per_s": []})
    u = updates.sort_values("version")
    window_s = u["end_s"].diff().fillna(u["end_s"]).to_numpy()
    gen = groups.groupby("version")["tokens_generated"].sum() if len(groups) else pd.Series(dtype=float)
    tokens = u["version"].map(gen).astype(float).to_numpy()
    tps = [t / w if w > 0 and math.isfinite(t) else math.nan for t, w in zip(tokens, window_s, strict=True)]
    return pd.DataFrame({"version": u["version"].to_numpy(), "tokens_per_s": tps})


def group_series(groups: pd.DataFrame, column: str, *, title: str, y: str, percent: bool = False,
                 overlay: pd.DataFrame | None = None) -> go.Figure:
    """One line per group of a groups-table column vs version (the overlay's groups dashed)."""
    fig = _fig(title, "update (weight version)", y)
    k = 100.0 if percent else 1.0
    for src, dash, suffix in ((groups, None, ""), (overlay, "dash", " (twin)")):
        if src is None or not has_values(src, column):
            continue
        for name, g in src.groupby("group", sort=True):
            fig.add_trace(go.Scatter(x=g["version"], y=g[column] * k, mode="lines" + ("" if dash else "+markers"),
                                     name=f"{name}{suffix}", line={"dash": dash} if dash else {}))
    return _integer_versions(fig, groups["version"])


# ---- dry run ----------------------------------------------------------------------------------------
REPLICA_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
def timeline(updates: pd.DataFrame, groups: pd.DataFrame, events: pd.DataFrame, clock: str = "simulated") -> go.Figure:
    """Top: updates finished over time. Bottom: replicas up per group (per update window), with
    cold starts / scale events / preemptions marked."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("updates finished", "replicas up per group"))
    u = updates.sort_values("version")
    fig.add_trace(go.Scatter(x=[0.0, *u["end_s"]], y=[0, *u["version"]], mode="lines+markers", line={"shape": "hv"},
                             name="updates (version 0 = start)"), row=1, col=1)
    if len(groups) and len(u):
        ends = u.set_index("version")["end_s"]
        for i, (name, g) in enumerate(groups.groupby("group", sort=True)):
            g = g.sort_values("version")
            # each row is the time-mean over the window ending at that update: drawn as a step over the window
            starts = [0.0, *g["version"].map(ends).iloc[:-1]]
            xs = [x for a, b in zip(starts, g["version"].map(ends), strict=True) for x in (a, b)]
            ys = [y for y in g["replicas_up"] for _ in (0, 1)]
            # a dash pattern and width of its own per group: groups with equal counts draw on the same y, and
            # a solid line hid the others (issue 26)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=str(name),
                                     line={"dash": REPLICA_DASHES[i % len(REPLICA_DASHES)],
                                           "width": max(1.5, 5.0 - 1.2 * (i // len(REPLICA_DASHES)) - 0.5 * i)},
                                     hovertemplate=f"{name}: %{{y:.2f}} replicas<extra></extra>"), row=2, col=1)
    marks = events[events["kind"].isin(["cold_start", "scale_up", "scale_down", "preempt", "crash", "restart",
                                        "replan"])] if len(events) else events
    if len(marks):
        for kind, e in marks.groupby("kind", sort=True):
            fig.add_trace(go.Scatter(x=e["time_s"], y=[0] * len(e), mode="markers", name=str(kind),
                                     marker={"symbol": "triangle-up", "size": 9},
                                     text=e["group"], hovertemplate="%{text} at %{x:.1f} s"), row=2, col=1)
    fig.update_xaxes(title_text=f"time ({clock} s)", row=2, col=1)
    fig.update_yaxes(title_text="version", row=1, col=1)
    top = float(groups["replicas_up"].max()) if len(groups) else 1.0
    fig.update_yaxes(title_text="replicas", range=[0, 1.15 * max(top, 1.0)], row=2, col=1)
    fig.update_layout(title="Timeline", height=2 * HEIGHT_PX - 40, margin=_LAYOUT["margin"], legend=_LAYOUT["legend"])
    return fig


def staleness_histogram(trajectories: pd.DataFrame, updates: pd.DataFrame) -> go.Figure:
    """Trained tokens by staleness (versions behind the trainer), from the trajectories' tokens per version."""
    fig = _fig("Staleness of trained tokens", "staleness (versions)", "share of trained tokens (%)")
    counts: dict[int, float] = {}
    if len(trajectories) and "trained_version" in trajectories:
        t = trajectories[trajectories["trained_version"] >= 1]
        for trained, by_version in zip(t["trained_version"], t["tokens_by_version"], strict=True):
            if not by_version:
                continue
            for v, n in dict(by_version).items():
                s = int(trained) - 1 - int(v)
                counts[s] = counts.get(s, 0.0) + float(n)
    if not counts and len(updates):  # no per-token record: weight each update's mean staleness by its tokens
        for s, n in zip(updates["staleness_mean"].round().astype(int), updates["tokens"], strict=True):
            counts[int(s)] = counts.get(int(s), 0.0) + float(n)
    total = sum(counts.values()) or 1.0
    xs = sorted(counts)
    fig.add_trace(go.Bar(x=xs, y=[100 * counts[x] / total for x in xs], name="tokens"))
    return fig


def cost_breakdown(summary: Mapping[str, Any]) -> go.Figure:
    """USD per update per sampler group and for the trainer."""
    n = max(int(summary.get("updates") or 0), 1)
    groups = dict(summary.get("group_cost_usd") or {})
    names = sorted(groups, key=lambda g: -groups[g]) + ["trainer"]
    vals = [groups[g] / n for g in names[:-1]] + [summary.get("cost_trainer_per_update_usd") or 0.0]
    fig = _fig("Cost per update by group", "", "USD per update")
    fig.add_trace(go.Bar(x=names, y=vals, text=[f"${v:,.2f}" for v in vals], textposition="outside"))
    return fig


def share_vs_extreme(summary: Mapping[str, Any], extreme_token_share: Mapping[str, float]) -> go.Figure:
    """Per group: its share of samples next to its share of the extreme-ratio tokens (predicted)."""
    share = dict(summary.get("group_share_of_samples") or {})
    names = sorted(share, key=lambda g: -share[g])
    # the second bar is the group's part of all extreme tokens (the bars of one colour add up to 100 %), not the
    # share of the group's own tokens that are extreme (issue 44: "95 %" read as "95 % of tokens are extreme"
    # under a card saying 0.056 %)
    fig = _fig("Each group's part of the samples and of the extreme-ratio tokens", "", "% of the fleet's total")
    fig.add_trace(go.Bar(x=names, y=[100 * share[g] for g in names], name="its part of all samples"))
    fig.add_trace(go.Bar(x=names, y=[100 * extreme_token_share.get(g, math.nan) for g in names],
                         name="its part of all tokens with ratio outside [0.2, 5] (predicted)"))
    fig.update_layout(barmode="group")
    return fig


def compare_bars(summaries: Sequence[tuple[str, Mapping[str, Any]]], metrics: Mapping[str, str]) -> go.Figure:
    """Side by side: one subplot per metric ({summary key: title with unit}), one bar per plan."""
    keys = list(metrics)
    # each title on two lines (the unit under it) in a smaller font, so neighbours do not run into each other
    titles = [metrics[k].replace(" (", "<br>(", 1) for k in keys]
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=titles, horizontal_spacing=0.06)
    fig.update_annotations(font_size=12)
    for i, k in enumerate(keys, start=1):
        fig.add_trace(go.Bar(x=[lab for lab, _ in summaries], y=[s.get(k) for _, s in summaries],
                             marker={"color": ["#1f77b4", "#ff7f0e", "#2ca02c"][: len(summaries)]},
                             showlegend=False), row=1, col=i)
    fig.update_layout(height=HEIGHT_PX + 40, margin={**_LAYOUT["margin"], "t": 90})   # the section names it
    return fig


# ---- plan -------------------------------------------------------------------------------------------
PARETO_MAX_POINTS = 60      # Pareto mixes drawn (evenly over log time); more read as one blob
PARETO_X_SPAN = 4.0         # the time axis ends at this many times the slowest of the chosen mix and the references


def _pos(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _shown(shown: int, total: int) -> str:
    return f": {shown:,} of {total:,} shown" if shown < total else ""


def thin_pareto(points: pd.DataFrame, max_points: int = PARETO_MAX_POINTS) -> pd.DataFrame:
    """At most `max_points` of a Pareto set, evenly spread over log time per update (both ends kept)."""
    if len(points) <= max_points:
        return points
    import numpy as np

    p = points.sort_values("time_per_update_s").reset_index(drop=True)
    logt = np.log(p["time_per_update_s"].clip(lower=1e-9).to_numpy())
    targets = np.linspace(logt[0], logt[-1], max_points)
    keep = sorted({int(np.abs(logt - t).argmin()) for t in targets})
    return p.iloc[keep]


def pareto(points: pd.DataFrame, *, chosen: Mapping[str, float] | None = None,
           references: Sequence[Mapping[str, Any]] = (), twin_points: Sequence[Mapping[str, Any]] = ()) -> go.Figure:
    """The planner's Pareto set (cost, time, staleness) as cost per update vs time per update, colored by
    mean staleness (gray: unbounded, trainer-bound); the chosen mix starred; reference fleets (same
    analytic model) as labelled diamonds; twin dry runs (the chosen plan and the references) as open
    circles.

    points: columns time_per_update_s, cost_per_update_usd, staleness_mean (NaN = unbounded), label.
    references / chosen: dicts with the same keys (+ name)."""
    fig = _fig("Cost vs time per update", "time per update (s)", "cost per update (USD)")
    total = len(points)
    focus = [float(r["time_per_update_s"]) for r in (*references, *twin_points, *([chosen] if chosen else []))
             if _pos(r.get("time_per_update_s"))]
    x_hi = PARETO_X_SPAN * max(focus) if focus else math.inf
    off = points[points["time_per_update_s"] > x_hi] if len(points) else points
    points = thin_pareto(points[points["time_per_update_s"] <= x_hi] if len(points) else points)
    if len(points):
        bounded = points[points["staleness_mean"].notna()]
        unbounded = points[points["staleness_mean"].isna()]
        hover = "%{text}<br>%{x:,.1f} s, $%{y:,.2f} per update<extra></extra>"
        if len(bounded):
            fig.add_trace(go.Scatter(
                x=bounded["time_per_update_s"], y=bounded["cost_per_update_usd"], mode="markers",
                name=f"Pareto set (planner; color: staleness){_shown(len(points), total)}", text=bounded["label"],
                hovertemplate=hover,
                marker={"color": bounded["staleness_mean"], "colorscale": "Viridis", "size": 10, "showscale": True,
                        "colorbar": {"title": "staleness<br>(versions)"}}))
        if len(unbounded):
            fig.add_trace(go.Scatter(
                x=unbounded["time_per_update_s"], y=unbounded["cost_per_update_usd"], mode="markers",
                name="trainer-bound (staleness unbounded)", text=unbounded["label"], hovertemplate=hover,
                marker={"color": "lightgray", "size": 10, "line": {"width": 1, "color": "gray"}}))
    for refs, symbol, size in ((references, "diamond", 14), (twin_points, "circle-open", 12)):
        for i, ref in enumerate(refs):
            stale = ref.get("staleness_mean", float("nan"))
            box = ref.get("cost_sandbox_per_update_usd") or 0.0
            boxed = (f", sandboxes ${box:,.2f} ({100 * box / ref['cost_per_update_usd']:.0f} %)"
                     if box > 0 and ref.get("cost_per_update_usd") else "")
            # only the seed's diamonds carry a label, on alternating sides (the twin's open circles sit near them
            # and are named in the legend and on hover): the labels ran into a blob (issue 26)
            labelled = symbol == "diamond"
            fig.add_trace(go.Scatter(
                x=[ref["time_per_update_s"]], y=[ref["cost_per_update_usd"]],
                mode="markers+text" if labelled else "markers",
                name=str(ref["name"]), text=[str(ref["name"])], textposition=("middle left", "middle right")[i % 2],
                hovertemplate=f"{ref['name']}<br>%{{x:,.1f}} s, $%{{y:,.2f}} per update, staleness "
                              f"{stale:.2f}{boxed}<extra></extra>",
                marker={"symbol": symbol, "size": size, "line": {"width": 2 if symbol == "circle-open" else 1,
                                                                 "color": "black"}}))
    if chosen is not None:
        fig.add_trace(go.Scatter(x=[chosen["time_per_update_s"]], y=[chosen["cost_per_update_usd"]],
                                 mode="markers+text", name="chosen mix (planner)", text=["chosen"],
                                 textposition="bottom center",
                                 marker={"symbol": "star", "size": 20, "color": "red",
                                         "line": {"width": 1, "color": "black"}}))
    if len(off):
        fig.add_annotation(x=1, y=1, xref="paper", yref="paper", xanchor="right", yanchor="bottom", showarrow=False,
                           text=f"{len(off):,} slower Pareto mixes off the chart (up to "
                                f"{off['time_per_update_s'].max():,.0f} s) →", font={"size": 11})
    fig.update_xaxes(type="log", nticks=8, title_text="time per update (s, log scale)")
    fig.update_yaxes(type="log", nticks=8, title_text="cost per update (USD, log scale)")
    fig.update_layout(height=HEIGHT_PX + 160)
    return fig
