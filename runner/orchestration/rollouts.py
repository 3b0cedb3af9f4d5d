"""Rollouts: prompt-groups kept generating and every reply routed to a sampler replica.

The feeder starts the prompt-groups the batcher admits (the prompt buffer, policies/prompt_buffer.py);
each sample is one asyncio task running the agent loop (runner/rollout/agent.py, token in / token out)
whose every reply is routed by the plan's router (session-sticky) to a replica over HTTP. A dropped
connection to a live replica is resent there (up to `MAX_SAME_REPLICA_RETRIES`); to a dead one, the replica
is marked lost and the turn re-runs on another (`restarts` counted on the session and the run).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from mixfleet.policies.prompt_buffer import PromptBuffer, PromptGroup
from mixfleet.runner.checkpoint.hf_checkpoint import load_config
from mixfleet.runner.orchestration.batching import version_int
from mixfleet.runner.orchestration.config import RunContext
from mixfleet.runner.orchestration.sampler_fleet import SamplerFleet
from mixfleet.runner.rollout.agent import AgentConfig, Episode, run_episode
from mixfleet.runner.rollout.tasks import make_task
from mixfleet.runner.sampler.client import SamplerHTTPError, SamplerUnavailable, routed_experts
from mixfleet.runner.sampler.engine_api import RequestResult, SamplingParams, TokenOutput

MAX_SAME_REPLICA_RETRIES = 3       # per session: resends to a live replica after a dropped connection


@dataclass
class Session:
    sid: int
    prompt_id: int
    sample_index: int
    session_id: str
    restarts: int = 0
    retries: int = 0                           # requests resent to the same (live) replica
    replica: int = -1
    group: str = ""


Sample = tuple[Session, Episode]            # a prompt-group's finished sample: the session and its episode


def sample_min_version(sample: Sample) -> int | None:
    """The oldest weight version of an episode's sampled tokens (None: none carries one)."""
    vs = [v for v in map(version_int, sample[1].tokens_by_version()) if v >= 0]
    return min(vs) if vs else None


def routed_shape(checkpoint: str) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) of a MoE checkpoint folder; None for a dense one or no folder."""
    if not checkpoint or not (Path(checkpoint) / "config.json").exists():
        return None
    cfg = load_config(checkpoint)
    return (cfg.num_hidden_layers, cfg.num_experts_per_tok) if cfg.is_moe else None


def result_from_response(resp: Mapping[str, Any], *, routed_shape: tuple[int, int] | None = None) -> RequestResult:
    """An SGLang /generate response (one item) -> the engine's RequestResult (what the agent loop consumes);
    with `routed_shape` (layers, top_k) its `meta_info.routed_experts` is decoded (start 0: every position)."""
    meta = resp.get("meta_info", {})
    ids = [int(i) for i in resp.get("output_ids", [])]
    lps = meta.get("output_token_logprobs") or [[0.0, i, None] for i in ids]
    tops = meta.get("output_top_logprobs") or [None] * len(ids)
    masks = meta.get("output_token_sampling_mask") or [None] * len(ids)
    mask_lps = meta.get("output_token_sampling_logprobs") or [None] * len(ids)
    vers = meta.get("output_token_weight_versions") or [str(meta.get("weight_version", "0"))] * len(ids)
    tokens = []
    for j, tid in enumerate(ids):
        top = [(float(t[0]), int(t[1])) for t in tops[j]] if tops[j] else []
        mids = list(masks[j]) if masks[j] is not None else None
        mlp = mask_lps[j] if isinstance(mask_lps[j], list) else None
        tokens.append(TokenOutput(token_id=tid, logprob=float(lps[j][0]), top_logprobs=top, mask_ids=mids,
                                  mask_logprobs=[float(x) for x in mlp] if mlp is not None else None,
                                  weight_version=str(vers[j])))
    fr = meta.get("finish_reason") or {"type": "length", "length": len(ids)}
    return RequestResult(rid=str(meta.get("id", "")), output_ids=ids, tokens=tokens, finish_reason=dict(fr),
                         prompt_tokens=int(meta.get("prompt_tokens", 0)),
                         cached_tokens=int(meta.get("cached_tokens", 0)),
                         weight_version=str(meta.get("weight_version", "0")),
                         e2e_latency=float(meta.get("e2e_latency", 0.0)),
                         routed_experts=None if routed_shape is None else routed_experts(
                             resp, num_layers=routed_shape[0], top_k=routed_shape[1]))


class _Served:
    """A RequestResult plus the group that served it (the agent loop reads `group_id`)."""

    def __init__(self, result: RequestResult, group_id: str) -> None:
        self._r, self.group_id = result, group_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._r, name)


def _tokens_by_group(ep: Episode) -> dict[str, int]:
    out: dict[str, int] = {}
    for g, m in zip(ep.group_ids, ep.loss_mask, strict=True):
        if m and g is not None:
            out[g] = out.get(g, 0) + 1
    return out


class Rollouts:
    """The prompt buffer's producers: the feeder and one task per sample."""

    def __init__(self, ctx: RunContext, prompts: PromptBuffer[Sample], fleet: SamplerFleet, *, router: Any,
                 agent_config: AgentConfig, task: str, top_p_replay: bool,
                 routed_shape: tuple[int, int] | None = None) -> None:
        self.ctx, self.prompts, self.fleet, self.router = ctx, prompts, fleet, router
        self.agent_config, self.task, self.top_p_replay = agent_config, task, top_p_replay
        self.routed_shape = routed_shape             # MoE: (layers, top_k); replies then carry each token's experts
        self.sessions: dict[str, Session] = {}
        self._sid = itertools.count()
        self.tokens_generated: dict[str, int] = dict.fromkeys(fleet.names, 0)
        self.restarts = 0                             # turns re-run on another replica after a replica loss

    async def feeder(self) -> None:
        """Keep as many prompt-groups generating as the batcher admits (samplers never wait for the trainer)."""
        ctx = self.ctx
        spp = self.prompts.samples_per_prompt
        while not ctx.stopping:
            for p in self.prompts.admit(ctx.version):
                for i in range(spp):
                    ctx.spawn(self._session(p, i))
            await ctx.wait_wake()

    async def _session(self, p: PromptGroup[Sample], sample_index: int) -> None:
        ctx, cfg = self.ctx, self.agent_config
        sid = next(self._sid)
        seed = ctx.config.seed * 1_000_003 + p.prompt_id
        s = Session(sid=sid, prompt_id=p.prompt_id, sample_index=sample_index,
                    session_id=f"p{p.prompt_id}-s{sample_index}-{uuid.uuid4().hex[:8]}")
        self.sessions[s.session_id] = s
        if cfg.sampling.sampling_seed is None:
            cfg = replace(cfg, sampling=replace(cfg.sampling, sampling_seed=(seed * 131 + sample_index) % (2**31)))
        try:
            ep = await run_episode(make_task(self.task, **ctx.settings.task_options), seed, self._generate,
                                   config=cfg, session_id=s.session_id, clock=ctx.now)
        finally:
            self.router.release(sid)
            self.sessions.pop(s.session_id, None)
        for g, n in _tokens_by_group(ep).items():
            self.tokens_generated[g] = self.tokens_generated.get(g, 0) + n
        if ep.finish_reason == "error" and not ep.num_generated:
            self.prompts.abort(p, ctx.now())
        else:
            self.prompts.finish(p, (s, ep), ctx.now())
        ctx.wake.set()

    async def _generate(self, input_ids: list[int], params: SamplingParams, session_id: str) -> RequestResult:
        """One reply of a session: routed (sticky) by the plan's router; re-routed when its replica is lost."""
        ctx, fleet = self.ctx, self.fleet
        s = self.sessions[session_id]
        body = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "stop_token_ids": list(params.stop_token_ids)}
        if params.sampling_seed is not None:
            body["sampling_seed"] = int(params.sampling_seed) + 7919 * s.restarts
        while True:
            route = self.router.route(s.sid, fleet.fleet_view())
            if route is None:                     # nothing up (all crashed / draining): wait for the monitor
                await asyncio.sleep(0.2)
                continue
            rep = next((r for r in fleet.replicas[route[0]] if r.index == route[1]), None)
            if rep is None or not rep.up:
                await asyncio.sleep(0.05)
                continue
            if not rep.admitting.is_set():
                await rep.admitting.wait()
                continue
            rep.begin(ctx.now(), params.max_new_tokens)
            try:
                resp = await rep.client.generate_ids(
                    input_ids, body, top_logprobs_num=ctx.settings.top_k_record, return_logprob=True,
                    return_sampling_mask=self.top_p_replay,
                    sampling_logprobs_mode="support" if self.top_p_replay else None, routing_key=session_id,
                    return_routed_experts=self.routed_shape is not None)
            except (SamplerUnavailable, httpx.HTTPError, SamplerHTTPError) as e:
                rep.end(ctx.now(), params.max_new_tokens)
                if isinstance(e, SamplerHTTPError) and e.status < 500:
                    raise                              # a request the sampler refuses: this episode's error
                if await fleet.probe(rep) is not False and rep.up and s.retries < MAX_SAME_REPLICA_RETRIES:
                    s.retries += 1                     # a dropped connection to a live replica: resend there
                    continue
                fleet.lost(rep, f"{type(e).__name__}: {e}")
                s.restarts += 1
                self.restarts += 1
                continue
            rep.end(ctx.now(), params.max_new_tokens)
            s.replica, s.group = rep.index, rep.group
            return _Served(result_from_response(resp, routed_shape=self.routed_shape), rep.group)
