"""Episodes drawn from a workload: per session, its turns, prompt, reply and tool-output tokens, tool latency.

One draw per prompt-group (all its samples at once, vectorized), from the run's seeded generator, so
a run is reproducible. An episode whose context would pass the workload's `max_context` is cut at
the last turn that fits (finish reason "max_turns").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mixfleet.costmodel.workload import WorkloadSpec


@dataclass(frozen=True, slots=True)
class Episode:
    turns: int                       # model replies
    prompt_tokens: int               # first prompt
    reply_tokens: tuple[int, ...]    # per turn
    tool_tokens: tuple[int, ...]     # tool output after turn i (len turns - 1)
    tool_s: tuple[float, ...]        # tool latency after turn i (len turns - 1)
    reward: float
    finish_reason: str


def draw_episodes(workload: WorkloadSpec, rng: np.random.Generator, n: int) -> list[Episode]:
    """n episodes (one prompt-group's samples)."""
    base = workload.sample_episodes(rng, n)
    turns = base["turns"]
    total = int(turns.sum())
    replies = np.maximum(workload.reply_tokens.sample(rng, total), 1).astype(np.int64)
    tools = np.maximum(workload.tool_output_tokens.sample(rng, total), 0).astype(np.int64)
    lat = np.maximum(workload.tool_latency_s.sample(rng, total), 0.0)
    rewards = (rng.random(n) < workload.success_prob).astype(np.float64)
    out, at = [], 0
    for i in range(n):
        t, p = int(turns[i]), int(base["prompt_tokens"][i])
        r, o, s = replies[at:at + t], tools[at:at + t - 1], lat[at:at + t - 1]
        at += t
        ctx = p + np.cumsum(r) + np.concatenate(([0], np.cumsum(o)))  # context after each reply
        fits = int(np.searchsorted(ctx, workload.max_context, side="right"))
        reason = "done"
        if fits < t:
            t, reason = max(fits, 1), "max_turns"
            r, o, s = r[:t], o[:t - 1], s[:t - 1]
        out.append(Episode(turns=t, prompt_tokens=p, reply_tokens=tuple(r.tolist()), tool_tokens=tuple(o.tolist()),
                           tool_s=tuple(s.tolist()), reward=float(rewards[i]), finish_reason=reason))
    return out
