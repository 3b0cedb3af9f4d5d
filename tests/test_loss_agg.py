"""How per-token losses become the loss (`CorrectionConfig.loss_agg`), in float64.

With sequence-level rewards whose failures run longer than their successes, a token-mean lets the failures'
tokens outweigh the successes' in a prompt-group whose advantages sum to zero; `seq_mean_token_mean` (GRPO's
own 1/G sum_i 1/|o_i| sum_t) weighs every trajectory the same. Both are checked against their definitions.
"""

from __future__ import annotations

import pytest
import torch
from mixfleet.costmodel.errors import SpecError
from mixfleet.runner.corrections import CorrectionBatch, CorrectionConfig, policy_loss, policy_loss_from_hidden

V = 11


def _group(lengths: list[int], advantages: list[float], seed: int = 0) -> tuple[torch.Tensor, CorrectionBatch]:
    """A batch of len(lengths) trajectories; every token's logits are the same row, its label token 3."""
    torch.manual_seed(seed)
    row = torch.randn(V, dtype=torch.float64)
    t = sum(lengths)
    logits = row.expand(t, V).clone().requires_grad_(True)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    adv = torch.cat([torch.full((n,), a, dtype=torch.float64) for n, a in zip(lengths, advantages, strict=True)])
    labels = torch.full((t,), 3)
    with torch.no_grad():
        logq_all = torch.log_softmax(logits, -1)
        top_lp, top_ids = logq_all.topk(4, dim=-1)            # the sampler's top-K record (SC needs it)
    return logits, CorrectionBatch(labels=labels, advantages=adv, loss_mask=torch.ones(t, dtype=torch.bool),
                                   sampler_logprobs=logq_all[:, 3], topk_ids=top_ids, topk_logprobs=top_lp,
                                   sequence_ids=seq)


def _shared_grad(method: str, agg: str, lengths: list[int], advantages: list[float]) -> torch.Tensor:
    logits, batch = _group(lengths, advantages)
    loss, _ = policy_loss(logits, batch, CorrectionConfig(method=method, loss_agg=agg, implementation="naive"))
    (g,) = torch.autograd.grad(loss, [logits])
    return g.sum(0)                     # the gradient on a logit row every token shares (a "format" direction)


@pytest.mark.parametrize("method", ["grpo", "sc_mis"])
def test_seq_mean_balances_a_zero_sum_group_whatever_the_lengths(method: str) -> None:
    # one short success (+0.75) and three long failures (-0.25 each): the advantages sum to zero
    lengths, adv = [10, 40, 40, 40], [0.75, -0.25, -0.25, -0.25]
    balanced = _shared_grad(method, "seq_mean_token_mean", lengths, adv)
    assert balanced.abs().max() < 1e-12
    skewed = _shared_grad(method, "token_mean", lengths, adv)
    assert skewed.abs().max() > 1e-2          # token-mean: the long failures win the shared direction


def test_seq_mean_is_the_mean_of_per_trajectory_token_means() -> None:
    lengths, adv = [3, 7, 5], [1.0, -0.5, 0.25]
    logits, batch = _group(lengths, adv, seed=1)
    cfg = CorrectionConfig(method="grpo", loss_agg="seq_mean_token_mean", implementation="naive")
    loss, _ = policy_loss(logits, batch, cfg)
    logp = torch.log_softmax(logits, -1)[:, 3]
    per_token = -batch.advantages * logp
    expect = torch.stack([per_token[batch.sequence_ids == i].mean() for i in range(3)]).mean()
    assert torch.allclose(loss, expect, atol=1e-14)
    token, _ = policy_loss(logits, batch, CorrectionConfig(method="grpo", implementation="naive"))
    assert torch.allclose(token, per_token.mean(), atol=1e-14)


def test_masked_tokens_and_empty_trajectories_do_not_count() -> None:
    lengths, adv = [4, 6, 2], [1.0, -1.0, 5.0]
    logits, batch = _group(lengths, adv, seed=2)
    mask = torch.ones(12, dtype=torch.bool)
    mask[:2] = False                          # half of trajectory 0
    mask[10:] = False                         # all of trajectory 2: it has no trained token
    batch = CorrectionBatch(labels=batch.labels, advantages=batch.advantages, loss_mask=mask,
                            sampler_logprobs=batch.sampler_logprobs, topk_ids=batch.topk_ids,
                            topk_logprobs=batch.topk_logprobs, sequence_ids=batch.sequence_ids)
    cfg = CorrectionConfig(method="grpo", loss_agg="seq_mean_token_mean", implementation="naive")
    loss, _ = policy_loss(logits, batch, cfg)
    per_token = -batch.advantages * torch.log_softmax(logits, -1)[:, 3]
    expect = (per_token[2:4].mean() + per_token[4:10].mean()) / 2
    assert torch.allclose(loss, expect, atol=1e-14)


def test_fused_and_chunked_paths_aggregate_alike() -> None:
    torch.manual_seed(3)
    t, h = 30, 8
    hidden = torch.randn(t, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, h, dtype=torch.float64, requires_grad=True)
    seq = torch.tensor([0] * 5 + [1] * 15 + [2] * 10)
    labels = torch.randint(0, V, (t,))
    with torch.no_grad():
        logq = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels[:, None])[:, 0] - 0.01
        top_lp, top_ids = (torch.log_softmax(hidden @ weight.T, -1) - 0.01).topk(4, dim=-1)
    batch = CorrectionBatch(labels=labels, advantages=torch.randn(t, dtype=torch.float64),
                            loss_mask=torch.ones(t, dtype=torch.bool), sampler_logprobs=logq, topk_ids=top_ids,
                            topk_logprobs=top_lp, sequence_ids=seq)
    cfg = dict(method="sc_mis", loss_agg="seq_mean_token_mean")
    fused, _ = policy_loss_from_hidden(hidden, weight, batch, CorrectionConfig(**cfg))
    g_fused = torch.autograd.grad(fused, [hidden, weight])
    naive, _ = policy_loss(hidden @ weight.T, batch, CorrectionConfig(**cfg, implementation="naive"))
    g_naive = torch.autograd.grad(naive, [hidden, weight])
    assert torch.allclose(fused, naive, atol=1e-12)
    for a, b in zip(g_fused, g_naive, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(SpecError, match="loss_agg"):
        CorrectionConfig(loss_agg="sum")
    logits, batch = _group([2, 2], [1.0, -1.0])
    no_seq = CorrectionBatch(labels=batch.labels, advantages=batch.advantages, loss_mask=batch.loss_mask,
                             sampler_logprobs=batch.sampler_logprobs)
    with pytest.raises(SpecError, match="sequence_ids"):
        policy_loss(logits, no_seq, CorrectionConfig(method="grpo", loss_agg="seq_mean_token_mean"))
