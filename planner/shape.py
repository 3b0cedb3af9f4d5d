"""The workload's shape for the planner's analytic model, and the episode draw it is measured on.

`draw_episodes(workload, rng, n)`: one prompt-group's episodes: per session, its turns, prompt, reply and
tool-output tokens, tool latency, reward. One draw per prompt-group (all its samples at once, vectorized), from
the caller's seeded generator, so a run is reproducible. An episode whose context would pass the workload's
`max_context` is cut at the last turn that fits (finish reason "max_turns"). The twin draws its sessions with it
(twin/episodes.py binds its compiled `Episode`), so the planner's screen and the twin see the same episodes.

`workload_shape(workload, samples_per_prompt)`: what the screen needs from those episodes (`WorkloadShape`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
from mixfleet.costmodel.specs.workload import WorkloadSpec

T = TypeVar("T")


class Drawn(NamedTuple):
    """One session's draw as plain values (the twin's `twin.core.Episode` has the same fields)."""
    turns: int
    prompt_tokens: int
    reply_tokens: tuple[int, ...]
    tool_tokens: tuple[int, ...]
    tool_s: tuple[float, ...]
    reward: float
    finish_reason: str


def draw_episodes(workload: WorkloadSpec, rng: np.random.Generator, n: int,
                  episode: Callable[..., T] = Drawn) -> list[T]:  # type: ignore[assignment]
    """n episodes (one prompt-group's samples), each built by `episode` from its fields (keywords as `Drawn`'s:
    the twin passes its compiled `twin.core.Episode`)."""
    base = workload.sample_episodes(rng, n)
    turns = base["turns"]
    total = int(turns.sum())
    replies = np.maximum(workload.reply_tokens.sample(rng, total), 1).astype(np.int64)
    tools = np.maximum(workload.tool_output_tokens.sample(rng, total), 0).astype(np.int64)
    lat = np.maximum(workload.tool_latency_s.sample(rng, total), 0.0)
    rewards = (rng.random(n) < workload.success_prob).astype(np.float64)
    ts, prompts, rw = turns.tolist(), base["prompt_tokens"].tolist(), rewards.tolist()
    rl, ol, sl = replies.tolist(), tools.tolist(), lat.tolist()
    limit = workload.max_context
    out, at = [], 0
    for i in range(n):
        t, p = ts[i], prompts[i]
        r, o = rl[at:at + t], ol[at:at + t - 1]
        reason = "done"
        if p + sum(r) + sum(o) > limit:  # the context after some reply passes max_context: cut before that reply
            ctx, fits = p, 0
            for j in range(t):
                ctx += r[j]              # the context after reply j: prompt, replies 0..j, tool outputs 0..j-1
                if ctx > limit:
                    break
                fits += 1
                if j < t - 1:
                    ctx += o[j]
            t, reason = max(fits, 1), "max_turns"
            r, o = r[:t], o[:t - 1]
        out.append(episode(turns=t, prompt_tokens=p, reply_tokens=tuple(r), tool_tokens=tuple(o),
                           tool_s=tuple(sl[at:at + t - 1]), reward=rw[i], finish_reason=reason))
        at += ts[i]
    return out


@dataclass(frozen=True, kw_only=True)
class WorkloadShape:
    """What the planner's analytic screen needs from a workload's episodes, measured on a seeded draw of the
    twin's own episodes (`draw_episodes`, the max_context cut included), so screen and twin see the same
    episodes. A replica decodes every running request at the same rate, so a request holds its KV for a time
    proportional to its reply: the running set is the turns weighted by their reply tokens (the long, late
    turns of long episodes), not the mean turn."""
    generated_per_episode: float     # reply tokens per episode
    turns_per_episode: float
    new_tokens_per_turn: float       # prefilled (not cached) tokens per turn: the prompt, then tool outputs
    kv_per_request: float            # KV a running request reserves (context + reply), reply-weighted
    decode_context: float            # the step time's context of a running request (context + reply / 2)
    group_span: float                # r = E[longest of a prompt's samples] / E[one sample] (in turns)
    stale_fraction: float            # f: a token's mean age at its group's completion / the group's lifetime


def workload_shape(workload: WorkloadSpec, samples_per_prompt: int, groups: int = 1500,
                   seed: int = 0) -> WorkloadShape:
    """`WorkloadShape` of `groups` prompt-groups of `samples_per_prompt` episodes (seeded; cached per workload).

    f: a sample of duration D (turns: the twin's turns take similar times) spreads its tokens evenly over
    [start, start + D]; its group completes at start + max D. Token-weighted mean age at completion over the
    group's lifetime E[max D]: f = E[sum_i D_i (max D - D_i / 2)] / (E[sum_i D_i] E[max D]) (1/2 for constant
    episodes; larger when long episodes hold most tokens and set the group's end)."""
    key = (repr(sorted(workload.to_dict().items())), int(samples_per_prompt), int(groups), int(seed))
    hit = _SHAPES.get(key)
    if hit is not None:
        return hit
    rng = np.random.default_rng(seed)
    spp = int(samples_per_prompt)
    turns = np.empty((groups, spp))
    gen, new, w_sum, kv_w, ctx_w = 0.0, 0.0, 0.0, 0.0, 0.0
    for g in range(groups):
        for i, ep in enumerate(draw_episodes(workload, rng, spp)):
            r = np.asarray(ep.reply_tokens, dtype=np.float64)
            o = np.asarray(ep.tool_tokens, dtype=np.float64)
            before = ep.prompt_tokens + np.concatenate(([0.0], np.cumsum(r[:-1] + o)))  # context before each reply
            turns[g, i] = ep.turns
            gen += r.sum()
            new += ep.prompt_tokens + o.sum()
            w_sum += r.sum()
            kv_w += (r * (before + r)).sum()
            ctx_w += (r * (before + r / 2)).sum()
    n_ep = groups * spp
    d, longest = turns, turns.max(axis=1, keepdims=True)
    shape = WorkloadShape(
        generated_per_episode=float(gen / n_ep), turns_per_episode=float(turns.mean()),
        new_tokens_per_turn=float(new / turns.sum()), kv_per_request=float(kv_w / w_sum),
        decode_context=float(ctx_w / w_sum),
        group_span=float(longest.mean() / d.mean()),
        stale_fraction=float((d * (longest - d / 2)).sum() / d.sum() / longest.mean()))
    _SHAPES[key] = shape
    return shape


_SHAPES: dict[tuple, WorkloadShape] = {}
