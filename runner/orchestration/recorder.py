"""Run-log writing for a real run: the header, each update's rows through the ledger (costmodel/records/ledger.py,
the twin's too), the batch's trajectories, and what a checkpoint keeps of them.

Per update: the trajectories of the batch (`trained_version`; dropped prompt-groups -1), one `GroupRecord`
per group and the `UpdateRecord` (the trainer's metrics as runner/corrections reports them: k1, k3,
out-of-band share as `masked_share`, the extreme-ratio shares, ESS, entropy, grad norm, loss), then a flush,
so a kill leaves every recorded update readable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mixfleet.costmodel.records.ledger import GroupBatch, GroupTotals, Ledger
from mixfleet.costmodel.records.runlog import RunLogWriter, TrajectoryRecord
from mixfleet.policies.prompt_buffer import PromptGroup
from mixfleet.runner.orchestration.batching import group_metrics, version_int
from mixfleet.runner.orchestration.config import RunContext
from mixfleet.runner.orchestration.rollouts import Sample, Session
from mixfleet.runner.rollout.agent import Episode


@dataclass(frozen=True, kw_only=True)
class UpdateView:
    """What the live view shows after each update."""

    version: int
    target: int
    elapsed_s: float
    reward_mean: float
    kl_k3: float
    kl_by_group: dict[str, float]
    kl_on_policy_by_group: dict[str, float]      # staleness-0 tokens only: the precision mismatch
    staleness_mean: float
    staleness_max: float
    tokens_per_s: float
    pass_at_k: float
    restarts: int
    replicas_up: dict[str, int]
    trainer_idle_share: float
    tool_s: float = math.nan                     # the batch's seconds in its tools (sandboxes), summed


class RunRecorder:
    """The run log of one run (`ctx.writer` once `open` is called)."""

    def __init__(self, ctx: RunContext, groups: tuple[str, ...], trainer_usd_per_hour: float) -> None:
        self.ctx, self.groups = ctx, groups
        self.ledger = Ledger(groups, trainer_usd_per_hour)
        self.fresh_kl: dict[str, list[float]] = {}    # group -> [k3 * tokens, k1 * tokens, tokens], staleness 0
        self.trained_restarted = 0                    # trained trajectories that were re-routed at least once

    def open(self, header: Mapping[str, Any], taken: Iterable[str] = ()) -> RunLogWriter:
        """The run log, new or reopened (`taken`: plan fields a resume took, RunLogWriter)."""
        self.ctx.writer = RunLogWriter(self.ctx.out, header, flush_every_s=5.0, flush_every_rows=None, taken=taken)
        return self.ctx.writer

    @property
    def last_update_s(self) -> float:
        """Run clock at the end of the last update recorded (of this run or, resumed, of its checkpoint)."""
        return self.ledger.last_update_s

    def write_trajectory(self, s: Session, ep: Episode, trained_version: int) -> None:
        w = self.ctx.writer
        if w is None:
            return
        first, last = ep.weight_version_span()
        v0, v1 = max(version_int(first), 0), max(version_int(last), 0)
        tbv = {version_int(k): v for k, v in ep.tokens_by_version().items()}
        w.append(TrajectoryRecord(
            run_id=w.run_id, prompt_id=str(s.prompt_id), sample_index=s.sample_index,
            group=ep.group_id or s.group, replica=max(s.replica, 0), version_start=v0, version_end=max(v1, v0),
            turns=ep.num_turns, prompt_tokens=len(ep.tokens) - ep.num_generated, generated_tokens=ep.num_generated,
            start_s=max(ep.start_s, 0.0), end_s=max(ep.end_s, ep.start_s, 0.0), reward=ep.reward,
            finish_reason=ep.finish_reason, restarts=s.restarts, tokens_by_version=tbv,
            trained_version=trained_version, tool_calls=ep.num_tool_calls, tool_s=ep.tool_s,
            turn_tool_s=list(ep.turn_tool_s), turn_output_tokens=list(ep.turn_output_tokens),
            **{k: list(v) for k in ("command_s", "sandbox_start_s", "pool_wait_s")
               if isinstance(v := ep.env_metrics.get(k), list | tuple)}))

    def log_update(self, prompts: list[PromptGroup[Sample]], batch: Any, metrics: Mapping[str, Any], *,
                   start_s: float, train_s: float, sync_s: float, pass_at_k: float,
                   totals: Mapping[str, GroupTotals], **live: Any) -> UpdateView:
        """Record update `batch.trained_version`; `live`: UpdateView's fields about the run as a whole (target,
        restarts, replicas_up, tokens_per_s, trainer_idle_share)."""
        w = self.ctx.writer
        assert w is not None
        v, now, nan = batch.trained_version, self.ctx.now(), math.nan
        tool_s = 0.0
        for p in prompts:
            for s, ep in p.samples:
                self.write_trajectory(s, ep, trained_version=v)
                self.trained_restarted += s.restarts > 0
                tool_s += ep.tool_s
        by_group, fresh = group_metrics(metrics, batch.group_names)
        for g, m in fresh.items():
            acc = self.fresh_kl.setdefault(g, [0.0, 0.0, 0.0])
            acc[0] += m.get("k3", 0.0) * m.get("tokens", 0.0)
            acc[1] += m.get("k1", 0.0) * m.get("tokens", 0.0)
            acc[2] += m.get("tokens", 0.0)
        batches = {}
        for g in self.groups:
            gm, fm = by_group.get(g, {}), fresh.get(g, {})
            batches[g] = GroupBatch(
                samples=batch.samples_by_group.get(g, 0), tokens_trained=batch.tokens_by_group.get(g, 0),
                staleness_mean=batch.staleness_by_group.get(g, nan), kl_k3=gm.get("k3", nan), kl_k1=gm.get("k1", nan),
                masked_share=gm.get("out_band_share", nan),
                extreme_share=gm.get("out_diag_low_share", nan) + gm.get("out_diag_high_share", nan),
                kl_k3_on_policy=fm.get("k3", nan), kl_k1_on_policy=fm.get("k1", nan),
                tokens_on_policy=int(fm.get("tokens", 0)), routing_token_share=gm.get("routing_token_share", nan),
                routing_layer_share=gm.get("routing_layer_share", nan))
        st = batch.staleness_stats()
        reward = sum(batch.rewards) / max(len(batch.rewards), 1)
        low, high = metrics.get("out_diag_low_share", nan), metrics.get("out_diag_high_share", nan)
        update, rows = self.ledger.record(
            version=v, now_s=now, start_s=start_s, totals=totals, batches=batches, train_step_s=train_s,
            weight_sync_s=sync_s, tokens=batch.num_tokens, trajectories=batch.num_trajectories, staleness=st,
            kl_k1=metrics.get("k1", nan), kl_k3=metrics.get("k3", nan), masked_share=metrics.get("out_band_share", nan),
            extreme_share=low + high, extreme_low_share=low, extreme_high_share=high, ess=metrics.get("ess", nan),
            entropy=metrics.get("entropy", nan), grad_norm=metrics.get("grad_norm", nan), loss=metrics.get("loss", nan),
            reward_mean=reward, pass_at_k=pass_at_k, tool_s=tool_s)
        w.extend(rows)
        w.append(update)
        w.flush()
        return UpdateView(version=v, elapsed_s=now, reward_mean=reward, kl_k3=float(metrics.get("k3", nan)),
                          kl_by_group={g: m.get("k3", nan) for g, m in by_group.items()},
                          kl_on_policy_by_group={g: m.get("k3", nan) for g, m in fresh.items()},
                          staleness_mean=st["staleness_mean"], staleness_max=st["staleness_max"], pass_at_k=pass_at_k,
                          tool_s=tool_s, **live)

    def on_policy_kl(self) -> dict[str, dict[str, float]]:
        """Per group, k3 / k1 over its staleness-0 trained tokens of the whole run (the precision mismatch alone)."""
        return {g: {"k3": a[0] / a[2], "k1": a[1] / a[2], "tokens": a[2]} for g, a in self.fresh_kl.items() if a[2] > 0}

    # ---- resume -----------------------------------------------------------------------------------------
    def state(self, totals: Mapping[str, GroupTotals]) -> dict[str, Any]:
        return {**self.ledger.state(totals), "fresh_kl": self.fresh_kl, "trained_restarted": self.trained_restarted}

    def restore(self, state: Mapping[str, Any], now_s: float) -> None:
        self.ledger.restore(state, now_s)
        self.fresh_kl = {g: [float(x) for x in a] for g, a in state.get("fresh_kl", {}).items()}
        self.trained_restarted = int(state.get("trained_restarted", 0))

    def close(self, status: str, **header: Any) -> None:
        w = self.ctx.writer
        if w is not None:
            w.update_header(**header)
            w.close(status)
            self.ctx.writer = None
