"""Workload specs: what an RL update asks of the samplers, as distributions.

A workload (data/workloads/*.toml, or any path) says how many prompts and samples per prompt make
an update, and per episode: turns, first-turn prompt tokens, reply tokens and tool-output tokens
per turn, tool latency, the context limit, and the probability a trajectory earns reward 1; optionally the
seconds an episode's sandbox takes to start (`sandbox_start_s`, `mixfleet calibrate --workload-out` measures it). The
twin samples episodes from it; the planner uses the closed-form means below. Each distribution's support
is bounded (costmodel/limits.py `WORKLOAD_DIST_BOUNDS`: never negative, turns at most 4,096, ...), a value
beyond refused with the limit named; a lognormal without `max` is clipped at its field's limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.limits import (
    MAX_CONTEXT_TOKENS,
    MAX_PROMPTS_PER_UPDATE,
    MAX_SAMPLES_PER_PROMPT,
    MAX_TRAJECTORIES_PER_UPDATE,
    WORKLOAD_DIST_BOUNDS,
    check_count,
    check_product,
)
from mixfleet.costmodel.paths import resolve_shipped, shipped_names
from mixfleet.costmodel.specs.dist import Dist, dist_from_dict
from mixfleet.costmodel.tomlread import check_keys, get_float, get_int, get_str, read_toml

DIST_FIELDS = ("turns", "prompt_tokens", "reply_tokens", "tool_output_tokens", "tool_latency_s")
OPTIONAL_DIST_FIELDS = ("sandbox_start_s",)     # absent: the workload says nothing about it (None)


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    name: str
    prompts_per_update: int            # prompts (task instances) per trainer update
    samples_per_prompt: int            # trajectories per prompt (the GRPO group size)
    turns: Dist                        # model replies per episode
    prompt_tokens: Dist                # tokens of the first turn's prompt (system + task)
    reply_tokens: Dist                 # tokens generated per reply
    tool_output_tokens: Dist           # tokens appended per tool call result
    tool_latency_s: Dist               # seconds a tool call takes (sandbox)
    max_context: int                   # tokens; an episode stops growing its context here
    success_prob: float = 0.5          # probability a trajectory earns reward 1
    no_tool_call_prob: float = 0.0     # probability a reply makes no tool call (3 in a row end it)
    sandbox_start_s: Dist | None = None  # seconds to start an episode's sandbox (None: not given; optional)
    description: str = ""
    source: str = ""
    date: str = ""

    def __post_init__(self) -> None:
        where = f"workload '{self.name}'"
        for f, hi in (("prompts_per_update", MAX_PROMPTS_PER_UPDATE), ("samples_per_prompt", MAX_SAMPLES_PER_PROMPT),
                      ("max_context", MAX_CONTEXT_TOKENS)):
            check_count(where, f, getattr(self, f), 1, hi)
        check_product(where, "prompts_per_update x samples_per_prompt",
                      self.prompts_per_update * self.samples_per_prompt, MAX_TRAJECTORIES_PER_UPDATE)
        for f in (*DIST_FIELDS, *OPTIONAL_DIST_FIELDS):
            d = getattr(self, f)
            if d is None and f in OPTIONAL_DIST_FIELDS:
                continue
            if not isinstance(d, Dist):
                raise SpecError(where, f, d, "a Dist" + (" or None" if f in OPTIONAL_DIST_FIELDS else ""))
            if d.where == "dist":                          # built in code: say which workload and field it is
                d = dataclasses.replace(d, where=f"{where} {f}")
            lo, hi, limit = WORKLOAD_DIST_BOUNDS[f]
            object.__setattr__(self, f, d.within(lo, hi, limit))   # frozen: the bounded Dist replaces it once
        for f in ("success_prob", "no_tool_call_prob"):
            v = getattr(self, f)
            if not 0.0 <= v <= 1.0:
                raise SpecError(where, f, v, "a probability in [0, 1]")

    @property
    def trajectories_per_update(self) -> int:
        return self.prompts_per_update * self.samples_per_prompt

    # ---- closed-form means for the planner (context truncation ignored except the cap) ------
    @property
    def mean_generated_tokens_per_episode(self) -> float:
        return self.turns.mean * self.reply_tokens.mean

    @property
    def mean_prefill_tokens_per_episode(self) -> float:
        """New (non-cached) tokens prefilled per episode: the prompt + every tool output but the last."""
        return self.prompt_tokens.mean + max(self.turns.mean - 1.0, 0.0) * self.tool_output_tokens.mean

    @property
    def mean_final_context(self) -> float:
        """Context at an episode's last token, capped at max_context."""
        full = self.prompt_tokens.mean + self.turns.mean * self.reply_tokens.mean \
            + max(self.turns.mean - 1.0, 0.0) * self.tool_output_tokens.mean
        return float(min(full, self.max_context))

    @property
    def mean_decode_context(self) -> float:
        """Mean context a generated token sees (context grows linearly over the turns), capped."""
        mid = self.prompt_tokens.mean + max(self.turns.mean - 1.0, 0.0) / 2 * \
            (self.reply_tokens.mean + self.tool_output_tokens.mean) + self.reply_tokens.mean / 2
        return float(min(mid, self.max_context))

    @property
    def mean_tool_time_s_per_episode(self) -> float:
        return max(self.turns.mean - 1.0, 0.0) * self.tool_latency_s.mean

    def sample_episodes(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
        """Per-episode draws: turns (int) and first-turn prompt tokens (int), for n episodes."""
        return {"turns": np.maximum(self.turns.sample(rng, n), 1).astype(np.int64),
                "prompt_tokens": np.maximum(self.prompt_tokens.sample(rng, n), 1).astype(np.int64)}

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "description": self.description, "source": self.source,
                             "date": self.date, "prompts_per_update": self.prompts_per_update,
                             "samples_per_prompt": self.samples_per_prompt, "max_context": self.max_context,
                             "success_prob": self.success_prob, "no_tool_call_prob": self.no_tool_call_prob}
        for f in DIST_FIELDS:
            d[f] = getattr(self, f).to_dict()
        for f in OPTIONAL_DIST_FIELDS:
            if getattr(self, f) is not None:
                d[f] = getattr(self, f).to_dict()
        return d


def workload_from_dict(raw: dict[str, Any], where: str = "workload") -> WorkloadSpec:
    """Build a WorkloadSpec from a TOML table; unknown keys are refused, naming the known ones."""
    scalars = ("name", "description", "source", "date", "prompts_per_update", "samples_per_prompt", "max_context",
               "success_prob", "no_tool_call_prob")
    check_keys(where, raw, (*scalars, *DIST_FIELDS, *OPTIONAL_DIST_FIELDS))
    dists = {}
    for f in DIST_FIELDS:
        if f not in raw:
            raise SpecError(where, f, None, "a distribution (the field is required)")
        dists[f] = dist_from_dict(raw[f], where=f"{where} {f}")
    for f in OPTIONAL_DIST_FIELDS:
        if f in raw:
            dists[f] = dist_from_dict(raw[f], where=f"{where} {f}")
    return WorkloadSpec(
        name=get_str(where, raw, "name"), description=get_str(where, raw, "description", default=""),
        source=get_str(where, raw, "source", default=""), date=get_str(where, raw, "date", default=""),
        prompts_per_update=get_int(where, raw, "prompts_per_update", lo=1, hi=MAX_PROMPTS_PER_UPDATE),
        samples_per_prompt=get_int(where, raw, "samples_per_prompt", lo=1, hi=MAX_SAMPLES_PER_PROMPT),
        max_context=get_int(where, raw, "max_context", lo=1, hi=MAX_CONTEXT_TOKENS),
        success_prob=get_float(where, raw, "success_prob", default=0.5, lo=0.0, hi=1.0),
        no_tool_call_prob=get_float(where, raw, "no_tool_call_prob", default=0.0, lo=0.0, hi=1.0),
        **dists,
    )


def known_workloads() -> list[str]:
    """Names of the workloads shipped in data/workloads."""
    return shipped_names("workloads")


def load_workload(name_or_path: str | Path) -> WorkloadSpec:
    """Load a workload by shipped name (e.g. 'seed-agentic-coding') or by TOML path."""
    path = resolve_shipped("workloads", name_or_path, "workload")
    return workload_from_dict(read_toml(path), where=str(path))
