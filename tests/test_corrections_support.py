"""Shared builders for the corrections tests (no tests here): tiny float64 problems with known p and q.

Everything is seeded. `per_label_grads` evaluates the loss for every possible sampled token a at
one context at once (one row per a, all rows sharing the same logits), so expectations over a ~ q
are exact sums rather than samples.
"""

from __future__ import annotations

import torch
from mixfleet.runner.corrections import CorrectionBatch, CorrectionConfig, policy_loss

F64 = torch.float64


def softmax_pair(vocab: int, temperature: float, seed: int, spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer logits [V] (raw, before temperature) and p = softmax(logits / temperature)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=F64) * spread
    return logits, torch.softmax(logits / temperature, dim=0)


def head_and_proportional_tail(
    p: torch.Tensor, head_ids: torch.Tensor, seed: int, rho: float
) -> torch.Tensor:
    """A q whose head H is arbitrary and whose tail is exactly rho * p (so Q_H = 1 - rho (1 - P_H))."""
    head_mass = 1.0 - rho * (1.0 - float(p[head_ids].sum()))
    assert 0.0 < head_mass < 1.0
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros_like(p)
    raw = torch.rand(len(head_ids), generator=g, dtype=F64) + 0.2
    q[head_ids] = raw / raw.sum() * head_mass
    in_head = torch.zeros(len(p), dtype=torch.bool)
    in_head[head_ids] = True
    q[~in_head] = rho * p[~in_head]
    return q


def per_label_grads(
    logits: torch.Tensor, q: torch.Tensor, config: CorrectionConfig, advantage: float,
    head_ids: torch.Tensor | None = None, kept: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The gradient of each label's own per-token loss w.r.t. the logits, [V', V].

    Row i has label labels[i] (every id of the vocabulary, or of the kept set), the recorded log q of
    it, the top-K head `head_ids` with its log q, or the kept set (ids, log q~).
    """
    vocab = logits.shape[0]
    labels = torch.arange(vocab) if kept is None else kept[0]
    n = len(labels)
    rows = logits.detach().expand(n, vocab).clone().requires_grad_(True)
    logq = torch.log(q)
    batch = CorrectionBatch(
        labels=labels, advantages=torch.full((n,), advantage, dtype=F64), loss_mask=torch.ones(n, dtype=torch.bool),
        sampler_logprobs=logq[labels],
        topk_ids=None if head_ids is None else head_ids.expand(n, -1).clone(),
        topk_logprobs=None if head_ids is None else logq[head_ids].expand(n, -1).clone(),
        kept_ids=None if kept is None else kept[0].expand(n, -1).clone(),
        kept_logprobs=None if kept is None else torch.log(kept[1][kept[0]]).expand(n, -1).clone(),
    )
    loss, _ = policy_loss(rows, batch, config)
    (grad,) = torch.autograd.grad(loss, rows)
    return grad * n  # the loss is a token-mean over n rows: undo the 1/n
