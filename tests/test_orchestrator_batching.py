"""Batch assembly (runner/orchestration/batching.py), the fleet from a plan (runner/orchestration/fleet.py)
and the response -> result conversion of the orchestrator: exact, model-free checks.

Covers: the causal shift (row t predicts token t + 1) and the loss mask on generated tokens only,
GRPO advantages by prompt-group, per-token staleness (v - 1) - u, top-K and kept-set records landing on
the right rows, per-group token / sample counts, per-group metric parsing, the loss running on the batch
(`policy_loss` with every correction), embedded scaling of replica counts, and bad inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from mixfleet.policies.plan import plan_from_dict
from mixfleet.runner.corrections import CorrectionConfig, policy_loss
from mixfleet.runner.orchestration.batching import (
    BatchItem,
    BatchOptions,
    build_batch,
    correction_batch,
    group_metrics,
    version_int,
)
from mixfleet.runner.orchestration.fleet import fleet_from_plan
from mixfleet.runner.orchestration.orchestrator import RunConfig, result_from_response
from mixfleet.runner.rollout.agent import Episode


def _episode(tokens: list[int], mask: list[int], versions: list[str | None], group: str, reward: float,
             top: bool = False, kept: bool = False) -> Episode:
    return Episode(task="t", seed=0, session_id="s", prompt_len=2, tokens=tokens, loss_mask=mask,
                   logprobs=[-0.5 - 0.01 * i if m else 0.0 for i, m in enumerate(mask)],
                   weight_versions=[v if m else None for v, m in zip(versions, mask, strict=True)],
                   group_ids=[group if m else None for m in mask],
                   top_logprobs=[[(-0.5, t), (-1.5, 7)] if (m and top) else None
                                 for t, m in zip(tokens, mask, strict=True)],
                   mask_ids=[[t, 7] if (m and kept) else None for t, m in zip(tokens, mask, strict=True)],
                   mask_logprobs=[[-0.3, -1.4] if (m and kept) else None for m in mask],
                   turns=[], reward=reward, finish_reason="done")


def _items() -> list[BatchItem]:
    a = _episode([1, 20, 21, 22, 3, 30], [0, 0, 1, 1, 0, 1], ["0"] * 6, "A", 1.0, top=True, kept=True)
    b = _episode([1, 20, 40, 41], [0, 0, 1, 1], ["0", "0", "1", "2"], "B", 0.0, top=True, kept=True)
    c = _episode([1, 50, 51], [0, 1, 1], ["2"] * 3, "A", 0.5, top=True, kept=True)
    return [BatchItem(episode=a, prompt_id=7, sample_index=0), BatchItem(episode=b, prompt_id=7, sample_index=1),
            BatchItem(episode=c, prompt_id=9, sample_index=0)]


def test_shift_mask_advantages_and_staleness_are_exact() -> None:
    batch = build_batch(_items(), trained_version=3, group_names=("A", "B"), options=BatchOptions(top_k=2))
    t = batch.tensors
    assert t["input_ids"].shape == (3, 6)
    assert t["input_ids"][1].tolist() == [1, 20, 40, 41, 2, 2]          # right-padded with EOS
    s = 6
    mask = t["loss_mask"].view(3, s)
    # row t is trained when token t + 1 was generated
    assert mask[0].tolist() == [False, True, True, False, True, False]
    assert mask[1].tolist() == [False, True, True, False, False, False]
    assert mask[2].tolist() == [True, True, False, False, False, False]
    labels = t["labels"].view(3, s)
    assert labels[0, 1].item() == 21 and labels[0, 4].item() == 30 and labels[2, 0].item() == 50
    # sampler log-prob of token t + 1 sits on row t
    assert t["sampler_logprobs"].view(3, s)[0, 1].item() == pytest.approx(-0.52)
    # GRPO: prompt 7 has rewards (1, 0) -> +-0.5; prompt 9 is alone -> 0
    adv = t["advantages"].view(3, s)
    assert adv[0, 1].item() == pytest.approx(0.5) and adv[1, 2].item() == pytest.approx(-0.5)
    assert adv[2, 0].item() == 0.0 and adv[0, 0].item() == 0.0        # masked rows carry no advantage
    # staleness (v - 1) - u with v = 3: versions 0 -> 2, 1 -> 1, 2 -> 0
    assert sorted(batch.staleness.tolist()) == [0, 0, 0, 1, 2, 2, 2]
    st = batch.staleness_stats()
    assert st["staleness_max"] == 2 and st["staleness_mean"] == pytest.approx(1.0)
    assert batch.tokens_by_group == {"A": 5, "B": 2} and batch.samples_by_group == {"A": 2, "B": 1}
    assert batch.staleness_by_group["B"] == pytest.approx(0.5)
    assert batch.num_tokens == 7 and batch.num_trajectories == 3
    g = t["group_ids"].view(3, s)
    # group id 2 i + (stale > 0): A's tokens of version 0 are stale (2), C's of version 2 fresh (0); B: 1 -> 3, 2 -> 2
    assert g[0, 1].item() == 1 and g[2, 0].item() == 0 and g[1, 1].item() == 3 and g[1, 2].item() == 2
    assert g[0, 0].item() == -1
    assert t["topk_ids"].view(3, s, 2)[0, 1].tolist() == [21, 7]
    assert "kept_ids" not in t


def test_kept_sets_and_the_loss_run_on_the_batch() -> None:
    batch = build_batch(_items(), trained_version=3, group_names=("A", "B"),
                        options=BatchOptions(top_k=2, top_p_replay=True))
    t = batch.tensors
    assert t["kept_ids"].view(3, 6, 2)[0, 4].tolist() == [30, 7]
    assert t["kept_logprobs"].view(3, 6, 2)[0, 4].tolist() == pytest.approx([-0.3, -1.4])
    logits = torch.randn(3 * 6, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for method, replay in (("grpo", False), ("sc_mis", True), ("sc_mis", False), ("mis", False)):
        tens = dict(t)
        if not replay:
            tens.pop("kept_ids")
            tens.pop("kept_logprobs")
        cfg = CorrectionConfig(method=method, top_p_replay=replay)
        loss, metrics = policy_loss(logits, correction_batch(tens), cfg)
        assert math.isfinite(float(loss.detach()))
        per_group, fresh = group_metrics(metrics, batch.group_names)
        assert set(per_group) == {"A", "B"}
        assert per_group["A"]["tokens"] == 5 and per_group["B"]["tokens"] == 2
        assert fresh["A"]["tokens"] == 2 and fresh["B"]["tokens"] == 1          # staleness-0 tokens only
        a_all = (metrics["group/0/k3"] * 2 + metrics["group/1/k3"] * 3) / 5    # recombined token mean
        assert per_group["A"]["k3"] == pytest.approx(float(a_all))
        assert fresh["A"]["k3"] == pytest.approx(float(metrics["group/0/k3"]))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="no trajectories"):
        build_batch([], trained_version=1, group_names=("A",))
    with pytest.raises(ValueError, match="trained_version"):
        build_batch(_items(), trained_version=0, group_names=("A",))
    with pytest.raises(ValueError, match="top_k"):
        BatchOptions(top_k=-1)
    assert version_int("12") == 12 and version_int(None) == -1 and version_int("x") == -1


def _plan(**over: object) -> dict:
    raw = {"name": "p", "model": "tiny", "workload": "tiny-cpu",
           "trainer": {"accelerator": "CPU-2core", "gpus": 1},
           "groups": [{"name": "a", "accelerator": "H100", "precision": "fp8", "replicas": 10},
                      {"name": "b", "accelerator": "B200", "precision": "nvfp4", "replicas": 4},
                      {"name": "c", "accelerator": "H100", "precision": "bf16", "kv_dtype": "bf16", "replicas": 0}],
           "embedded": {"max_replicas_per_group": 2}}
    raw.update(over)
    return raw


def test_fleet_scales_embedded_groups_down_and_keeps_their_formats() -> None:
    fleet = fleet_from_plan(plan_from_dict(_plan()), mode="embedded")
    a, b, c = fleet.groups
    assert (a.replicas, b.replicas, c.replicas) == (2, 2, 0)
    assert (a.planned_replicas, b.planned_replicas) == (10, 4)
    assert (a.precision, a.kv_dtype, b.precision, c.kv_dtype) == ("fp8", "fp8_e4m3", "nvfp4", "bf16")
    assert a.capacity_tokens_per_s > 0 and b.capacity_tokens_per_s > 0
    assert fleet.resources == {"H100": 2.0, "B200": 2.0}
    real = fleet_from_plan(plan_from_dict(_plan()), mode="sglang")
    assert real.groups[0].replicas == 10
    # scaled down 10 -> 2, each local replica carries 5 planned replicas' routing weight
    assert a.capacity_tokens_per_s == pytest.approx(5 * real.groups[0].capacity_tokens_per_s)
    assert b.capacity_tokens_per_s == pytest.approx(2 * real.groups[1].capacity_tokens_per_s)
    with pytest.raises(ValueError, match="attach"):
        fleet_from_plan(plan_from_dict(_plan()), mode="attach")
    att = fleet_from_plan(plan_from_dict(_plan()), mode="attach",
                          attach={"a": ["http://127.0.0.1:1"], "b": ["http://127.0.0.1:2", "http://127.0.0.1:3"]})
    assert [g.replicas for g in att.groups] == [1, 2, 0]
    with pytest.raises(ValueError, match="mode"):
        fleet_from_plan(plan_from_dict(_plan()), mode="cloud")


def test_response_to_result_and_run_config_validation() -> None:
    resp = {"output_ids": [5, 6], "meta_info": {
        "id": "r", "finish_reason": {"type": "stop", "matched": 6}, "prompt_tokens": 3, "cached_tokens": 1,
        "weight_version": "4", "e2e_latency": 0.1,
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
        "output_top_logprobs": [[[-0.1, 5, None], [-2.0, 9, None]], [[-0.2, 6, None]]],
        "output_token_sampling_mask": [[5, 9], [6]], "output_token_sampling_logprobs": [[-0.05, -3.0], [0.0]],
        "output_token_weight_versions": ["3", "4"]}}
    r = result_from_response(resp)
    assert r.output_ids == [5, 6] and r.finish_reason["type"] == "stop" and r.weight_version == "4"
    assert [t.weight_version for t in r.tokens] == ["3", "4"]
    assert r.tokens[0].top_logprobs == [(-0.1, 5), (-2.0, 9)] and r.tokens[0].mask_ids == [5, 9]
    assert r.tokens[0].mask_logprobs == [-0.05, -3.0]
    with pytest.raises(ValueError, match="mode"):
        RunConfig(out_dir="x", init_checkpoint="c", mode="fast")
    with pytest.raises(ValueError, match="init_checkpoint"):
        RunConfig(out_dir="x")
    with pytest.raises(ValueError, match="updates"):
        RunConfig(out_dir="x", init_checkpoint="c", updates=0)


def test_routed_experts_from_turns_to_the_batch() -> None:
    """Each response's record covers positions [P - n, P), P = tokens - 1; the first record of a position wins;
    the batch puts input token t's experts at (b, t) (the forward whose output trains row (b, t))."""
    import numpy as np
    from mixfleet.runner.rollout.agent import _Recorder

    rec = _Recorder()
    rec.add_context([1, 2, 3])                                     # prompt: positions 0..2
    rec.tokens += [4, 5]                                           # two sampled tokens (bookkeeping only here)
    first = np.arange(4 * 2 * 1).reshape(4, 2, 1)                  # positions 0..3 (4 = the last, never forwarded)
    rec.add_routing(first)
    rec.tokens += [6, 7, 8]                                        # tool output, then one more reply
    second = 100 + np.arange(7 * 2 * 1).reshape(7, 2, 1)            # positions 0..6: 0..3 already recorded
    rec.add_routing(second)
    out = rec.routed_experts()
    assert out.shape == (8, 2, 1)
    assert out[:4].tolist() == first.tolist() and out[4:7].tolist() == second[4:7].tolist()
    assert (out[7] == -1).all()                                    # the last token: no record
    with pytest.raises(ValueError, match="expected"):
        rec.add_routing(np.zeros((9, 2, 1)))                        # more rows than forwarded positions

    a, b, _ = _items()
    a.episode.routed_experts = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2) % 8
    batch = build_batch([a, b], trained_version=3, group_names=("A", "B"))
    rex = batch.tensors["routed_experts"]
    assert rex.shape == (2 * 6, 2, 2) and rex.dtype == torch.int64
    assert rex[:6].tolist() == a.episode.routed_experts.tolist() and (rex[6:] == -1).all()
    b.episode.routed_experts = np.zeros((3, 2, 2), dtype=np.int32)  # 3 positions for a 4-token episode
    with pytest.raises(ValueError, match="3 positions"):
        build_batch([a, b], trained_version=3, group_names=("A", "B"))
    b.episode.routed_experts = None
