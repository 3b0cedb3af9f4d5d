"""Batched sampling with the records RL needs: full-vocabulary log-probs, top-K, and the kept set.

For each row of logits (one running request): log-probs `log_softmax(logits / T)` over the FULL
vocabulary (T = 1 for greedy rows, T < 1e-6); the kept set in descending probability: keep while
rank < top_k and the exclusive cumulative probability <= top_p and p >= min_p * p_max (and p > 0;
the most likely token always); the sample is drawn from the kept set renormalized (greedy: the
top token), by inverse CDF with one uniform number from the request's own seeded RNG, so a
request's samples do not depend on what else is in the batch. Pure tensor math + Python floats.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class RowParams:
    temperature: float
    top_p: float
    top_k: int                       # -1: all
    min_p: float
    top_logprobs_num: int            # K of the top-K record (0: none)
    want_mask: bool                  # record the kept set
    mask_cap: int                    # at most this many ids in the kept set


@dataclass(frozen=True)
class RowSample:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[float, int]]
    mask_ids: list[int] | None
    mask_logprobs: list[float] | None


def kept_mask(sorted_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Bool [B, V] over probabilities sorted descending: which ranks the sampler keeps.

    top_k [B] (rank limit, already V for "all" and 1 for greedy), top_p [B], min_p [B].
    """
    v = sorted_p.shape[-1]
    rank = torch.arange(v, device=sorted_p.device)[None, :]
    excl = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep = rank < top_k[:, None]
    keep &= (excl <= top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep &= sorted_p > 0
    keep[:, 0] = True
    return keep


def sample_batch(logits: torch.Tensor, rows: list[RowParams], rngs: list[random.Random]) -> list[RowSample]:
    """Sample one token per row of fp32 logits [B, V] and build each row's records."""
    b, v = logits.shape
    dev = logits.device
    temps = [r.temperature for r in rows]
    greedy = [t < GREEDY_TEMPERATURE for t in temps]
    t_eff = torch.tensor([1.0 if g else t for g, t in zip(greedy, temps, strict=True)], device=dev)
    logp = torch.log_softmax(logits / t_eff[:, None], dim=-1)
    probs = logp.exp()
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    limits = [1 if g else (v if r.top_k < 0 else min(r.top_k, v)) for g, r in zip(greedy, rows, strict=True)]
    top_k = torch.tensor(limits, device=dev)
    top_k = torch.minimum(top_k, torch.tensor([max(r.mask_cap, 1) if r.want_mask else v for r in rows], device=dev))
    keep = kept_mask(sorted_p, top_k, torch.tensor([r.top_p for r in rows], device=dev),
                     torch.tensor([r.min_p for r in rows], device=dev))
    kept_p = torch.where(keep, sorted_p, torch.zeros((), device=dev))
    cdf = torch.cumsum(kept_p, dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor([0.0 if g else rng.random() for g, rng in zip(greedy, rngs, strict=True)], device=dev,
                     dtype=cdf.dtype)
    n_kept = keep.sum(dim=-1)
    idx = (cdf < u[:, None] * total).sum(dim=-1)
    idx = torch.minimum(idx, n_kept - 1)
    tokens = order.gather(1, idx[:, None])[:, 0]
    tok_lp = logp.gather(1, tokens[:, None])[:, 0]

    k_max = max(r.top_logprobs_num for r in rows)
    top_vals = top_ids = None
    if k_max > 0:
        tv, ti = torch.topk(logp, min(k_max, v), dim=-1)
        top_vals, top_ids = tv.tolist(), ti.tolist()
    need_mask = [i for i, r in enumerate(rows) if r.want_mask]
    mask_lp = None
    if need_mask:
        sorted_lp = logp.gather(1, order)
        norm = torch.logsumexp(torch.where(keep, sorted_lp, torch.full((), float("-inf"), device=dev)), dim=-1)
        mask_lp = sorted_lp - norm[:, None]

    tokens_l, lp_l, n_l = tokens.tolist(), tok_lp.tolist(), n_kept.tolist()
    out = []
    for i, r in enumerate(rows):
        top = []
        if r.top_logprobs_num > 0:
            k = min(r.top_logprobs_num, v)
            top = list(zip(top_vals[i][:k], top_ids[i][:k], strict=True))
        m_ids = m_lp = None
        if r.want_mask:
            n = n_l[i]
            m_ids = order[i, :n].tolist()
            m_lp = mask_lp[i, :n].tolist()
        out.append(RowSample(tokens_l[i], lp_l[i], top, m_ids, m_lp))
    return out
