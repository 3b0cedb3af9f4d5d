"""The numerical checks of the off-policy corrections (docs/corrections.md), in float64, tiny vocabulary.

1. zero expected update under q for sc, sc_mis, sc_tis (K = V, and K < V with a tail exactly rho p);
   the closed-form drifts of grpo, mis, tis;
2. the autograd gradient equals -A [w(a) s_a - mu_w] / T for every sampled token a;
3. top-p mask replay: exactly zero gradient outside the kept set, zero expected update under q~,
   fallback rows;
4. p == q: every method equals grpo bit for bit;
6. a Monte-Carlo version of check 1.
(Check 5, chunked == naive, is test_corrections_chunked.py.)
"""

from __future__ import annotations

import pytest
import torch
from mixfleet.runner.corrections import (
    LOG_RATIO_CLAMP,
    METHODS,
    CorrectionBatch,
    CorrectionConfig,
    policy_loss,
    token_logprobs,
)
from test_corrections_support import F64, head_and_proportional_tail, per_label_grads, softmax_pair

TEMP = 0.7
ADV = 1.3
V = 10
CENTERED = ("sc", "sc_mis", "sc_tis")


def weights_all(p: torch.Tensor, q: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    """w(v) for every v, from the clamped log-ratio (independent of the implementation)."""
    r = torch.exp((torch.log(p) - torch.log(q)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if cfg.weight_kind == "mis":
        return r * ((r >= cfg.band[0]) & (r <= cfg.band[1])).to(F64)
    if cfg.weight_kind == "tis":
        return r.clamp(max=cfg.tis_cap)
    return torch.ones_like(r)


def closed_form_grads(p: torch.Tensor, q_true: torch.Tensor, q_center: torch.Tensor, cfg: CorrectionConfig,
                      support: torch.Tensor) -> torch.Tensor:
    """d loss(a) / d logits = -A [w(a) s_a - mu_w] / T for each a in `support` ([|support|, V]).

    w(a) uses the true q(a); mu_w = sum_v q_c(v) w_c(v) s_v uses the distribution the centering
    assumes (the true q, or the head + rho p tail model). No centering for grpo / mis / tis.
    """
    eye = torch.eye(len(p), dtype=F64)
    w_a = weights_all(p, q_true, cfg)[support]
    s = eye[support] - p
    if cfg.centered:
        qw = q_center * weights_all(p, q_center, cfg)
        mu = qw - qw.sum() * p
    else:
        mu = torch.zeros_like(p)
    return -ADV * (w_a.unsqueeze(1) * s - mu) / TEMP


def setup(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, p, q, head_ids) for: 'full' (K = V), 'tail' (K < V, tail exactly rho p), 'tail_out'
    (same with 1/rho outside the MIS band), 'skewed' (K < V, tail NOT proportional to p)."""
    logits, p = softmax_pair(V, TEMP, seed, spread=1.5)
    g = torch.Generator().manual_seed(seed + 100)
    if kind == "full":
        q = torch.softmax(torch.log(p) + 0.9 * torch.randn(V, generator=g, dtype=F64), dim=0)
        return logits, p, q, torch.arange(V)
    head = torch.argsort(p, descending=True)[:4]
    if kind in ("tail", "tail_out"):
        rho = 1.25 if kind == "tail" else 0.1  # 1/rho inside / outside the MIS band [0.5, 2]
        q = head_and_proportional_tail(p, head, seed, rho)
        return logits, p, q, head
    q = torch.softmax(torch.log(p) + 0.9 * torch.randn(V, generator=g, dtype=F64), dim=0)
    return logits, p, q, head


def tail_model(p: torch.Tensor, q: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """q on the head, rho * p outside it: the distribution the top-K centering assumes."""
    in_head = torch.zeros(len(p), dtype=torch.bool)
    in_head[head] = True
    rho = (1 - q[head].sum()) / (1 - p[head].sum())
    return torch.where(in_head, q, rho * p)


@pytest.mark.parametrize("kind", ["full", "tail", "tail_out"])
@pytest.mark.parametrize("method", METHODS)
def test_expected_update_under_q(method: str, kind: str) -> None:
    logits, p, q, head = setup(kind)
    cfg = CorrectionConfig(method=method, temperature=TEMP, implementation="naive")
    grads = per_label_grads(logits, q, cfg, ADV, head_ids=head)
    expected = (q.unsqueeze(1) * grads).sum(dim=0)
    if method in CENTERED:
        assert expected.abs().max() < 1e-10
        return
    w = weights_all(p, q, cfg)
    m = q * w if cfg.weight_kind != "none" else q  # mis: p 1_B; tis: min(p, C q); grpo: q
    drift = -ADV * (m - m.sum() * p) / TEMP
    assert drift.abs().max() > 1e-3  # the uncorrected losses really drift
    torch.testing.assert_close(expected, drift, rtol=0, atol=1e-12)
    if method == "grpo":
        torch.testing.assert_close(expected, -ADV * (q - p) / TEMP, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["full", "tail", "tail_out", "skewed"])
@pytest.mark.parametrize("method", METHODS)
def test_gradient_closed_form(method: str, kind: str) -> None:
    logits, p, q, head = setup(kind, seed=3)
    cfg = CorrectionConfig(method=method, temperature=TEMP, implementation="naive", tis_cap=1.5)
    grads = per_label_grads(logits, q, cfg, ADV, head_ids=head)
    q_center = q if kind == "full" else tail_model(p, q, head)
    if kind in ("tail", "tail_out"):
        torch.testing.assert_close(q_center, q, rtol=0, atol=1e-15)
    expected = closed_form_grads(p, q, q_center, cfg, torch.arange(V))
    torch.testing.assert_close(grads, expected, rtol=0, atol=1e-12)


def replay_setup(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, kept ids S, q~ over the vocabulary (0 outside S), p~ over the vocabulary)."""
    logits, p = softmax_pair(V, TEMP, seed, spread=1.5)
    g = torch.Generator().manual_seed(seed)
    kept = torch.tensor([1, 3, 4, 6, 7, 9])
    q_t = torch.zeros(V, dtype=F64)
    q_t[kept] = torch.softmax(torch.log(p[kept]) + torch.randn(len(kept), generator=g, dtype=F64), dim=0)
    p_t = torch.zeros(V, dtype=F64)
    p_t[kept] = p[kept] / p[kept].sum()
    return logits, kept, q_t, p_t


@pytest.mark.parametrize("method", METHODS)
def test_top_p_replay(method: str) -> None:
    logits, kept, q_t, p_t = replay_setup()
    cfg = CorrectionConfig(method=method, temperature=TEMP, implementation="naive", top_p_replay=True, tis_cap=1.2)
    grads = per_label_grads(logits, q_t, cfg, ADV, kept=(kept, q_t))
    outside = torch.ones(V, dtype=torch.bool)
    outside[kept] = False
    assert torch.all(grads[:, outside] == 0)  # exactly zero, not merely small
    # closed form with p~, q~ (s~_a = e_a - p~); exact centering over S
    eye = torch.eye(V, dtype=F64)
    w = torch.zeros(V, dtype=F64)
    w[kept] = weights_all(p_t[kept], q_t[kept], cfg)
    s = eye[kept] - p_t
    mu = (q_t * w - (q_t * w).sum() * p_t) if cfg.centered else torch.zeros(V, dtype=F64)
    torch.testing.assert_close(grads, -ADV * (w[kept].unsqueeze(1) * s - mu) / TEMP, rtol=0, atol=1e-12)
    expected = (q_t[kept].unsqueeze(1) * grads).sum(dim=0)
    if method in CENTERED:
        assert expected.abs().max() < 1e-10
    else:
        assert expected.abs().max() > 1e-3


def test_replay_fallback_rows() -> None:
    """A row whose kept set is empty or lacks the label uses full-vocabulary log-probs and is counted."""
    logits, kept, q_t, p_t = replay_setup()
    q_full = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(1), dtype=F64), dim=0)
    rows = logits.expand(3, V).clone().requires_grad_(True)
    pad = torch.full((len(kept),), -1)
    kept_ids = torch.stack([kept, kept, pad])
    kept_lp = torch.log(q_t[kept]).expand(3, -1).clone()
    kept_lp[2] = -torch.inf
    labels = torch.tensor([3, 0, 5])  # row 0 replayed, row 1 label not kept, row 2 empty kept set
    head = torch.argsort(q_full, descending=True)[:4].expand(3, -1)
    common = dict(labels=labels, advantages=torch.full((3,), ADV, dtype=F64), loss_mask=torch.ones(3, dtype=torch.bool),
                  topk_ids=head, topk_logprobs=torch.log(q_full)[head])
    logq = torch.stack([torch.log(q_t[3]), torch.log(q_full[0]), torch.log(q_full[5])])
    cfg = CorrectionConfig(method="sc", temperature=TEMP, implementation="naive", top_p_replay=True)
    loss, metrics = policy_loss(rows, CorrectionBatch(**common, sampler_logprobs=logq, kept_ids=kept_ids,
                                                      kept_logprobs=kept_lp), cfg)
    (grad,) = torch.autograd.grad(loss, rows)
    assert metrics["fallback_rows"] == 2.0
    assert metrics["kept_size"] == len(kept)
    # the fallback rows equal the plain top-K computation of the same rows
    plain = CorrectionConfig(method="sc", temperature=TEMP, implementation="naive")
    rows2 = logits.expand(3, V).clone().requires_grad_(True)
    loss2, _ = policy_loss(rows2, CorrectionBatch(**common, sampler_logprobs=logq), plain)
    (grad2,) = torch.autograd.grad(loss2, rows2)
    torch.testing.assert_close(grad[1:], grad2[1:], rtol=0, atol=1e-15)
    not_kept = torch.tensor([v for v in range(V) if v not in kept.tolist()])
    assert grad[1:, not_kept].abs().min() > 0  # the fallback rows' gradients reach the non-kept logits
    assert torch.all(grad[0, not_kept] == 0)


def p_equals_q_batch(logits: torch.Tensor, cfg: CorrectionConfig, k: int, replay: bool) -> CorrectionBatch:
    """Sampler records computed with the loss's own arithmetic from the trainer's logits (p == q)."""
    t, vocab = logits.shape
    g = torch.Generator().manual_seed(11)
    labels = torch.randint(0, vocab, (t,), generator=g)
    mask = torch.rand(t, generator=g) > 0.25
    labels = torch.where(mask, labels, torch.full_like(labels, -100))  # masked tokens may carry any label
    safe = labels.clamp(min=0)
    kw: dict = {}
    if k:
        topk = torch.argsort(logits, dim=1, descending=True)[:, :k]
        kw.update(topk_ids=topk, topk_logprobs=token_logprobs(logits, topk, cfg))
    if replay:
        order = torch.argsort(logits, dim=1, descending=True)
        kept = order[:, :5].clone()
        kept[:, 4] = torch.where(mask, safe, kept[:, 4])  # force-keep the sampled token ...
        kept[:, 3] = -1                                  # ... with a padded slot
        kept[kept[:, 4] == kept[:, 0], 4] = -1           # no duplicate ids
        z = logits / cfg.temperature
        zs = torch.where(kept >= 0, z.gather(1, kept.clamp(min=0)), torch.full((), -torch.inf, dtype=F64))
        lp = zs - torch.logsumexp(zs, dim=1, keepdim=True)
        kw.update(kept_ids=kept, kept_logprobs=lp)
        pos = (kept == safe.unsqueeze(1)).to(torch.int8).argmax(dim=1, keepdim=True)
        sampler = lp.gather(1, pos).squeeze(1)
    else:
        sampler = token_logprobs(logits, safe, cfg)
    return CorrectionBatch(labels=labels, advantages=torch.randn(t, generator=g, dtype=F64), loss_mask=mask,
                           sampler_logprobs=sampler, group_ids=torch.randint(0, 3, (t,), generator=g), **kw)


@pytest.mark.parametrize("implementation", ["naive", "chunked"])
@pytest.mark.parametrize("k,replay", [(4, False), (12, False), (4, True)])
def test_p_equals_q_is_grpo_bit_for_bit(implementation: str, k: int, replay: bool) -> None:
    logits = torch.randn(16, 12, generator=torch.Generator().manual_seed(2), dtype=F64) * 2
    results = {}
    for method in METHODS:
        cfg = CorrectionConfig(method=method, temperature=TEMP, implementation=implementation, chunk_size=5,
                               top_p_replay=replay)
        batch = p_equals_q_batch(logits, cfg, k, replay)
        x = logits.clone().requires_grad_(True)
        loss, _ = policy_loss(x, batch, cfg)
        (grad,) = torch.autograd.grad(loss, x)
        results[method] = (loss, grad)
    base_loss, base_grad = results["grpo"]
    assert base_grad.abs().max() > 0
    for method in METHODS:
        assert torch.equal(results[method][0], base_loss), method
        assert torch.equal(results[method][1], base_grad), method


@pytest.mark.parametrize("method", ["grpo", "sc_mis", "sc_tis"])
def test_monte_carlo_expected_update(method: str) -> None:
    """Sample a ~ q (seeded); the sample mean of the per-token gradients is within 5 standard errors
    of the exact expectation (0 for the centered losses, -A (q - p) / T for grpo)."""
    logits, p, q, head = setup("tail", seed=7)
    n = 20000
    labels = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(9))
    rows = logits.expand(n, V).clone().requires_grad_(True)
    batch = CorrectionBatch(labels=labels, advantages=torch.full((n,), ADV, dtype=F64),
                            loss_mask=torch.ones(n, dtype=torch.bool), sampler_logprobs=torch.log(q)[labels],
                            topk_ids=head.expand(n, -1), topk_logprobs=torch.log(q)[head].expand(n, -1))
    cfg = CorrectionConfig(method=method, temperature=TEMP)
    loss, _ = policy_loss(rows, batch, cfg)
    (grad,) = torch.autograd.grad(loss, rows)
    per_token = grad * n
    mean, stderr = per_token.mean(dim=0), per_token.std(dim=0) / n**0.5
    exact = torch.zeros(V, dtype=F64) if method != "grpo" else -ADV * (q - p) / TEMP
    assert torch.all((mean - exact).abs() <= 5 * stderr + 1e-12)
    assert stderr.max() < 0.02  # tight enough that grpo's drift (below) could not pass as zero
    if method == "grpo":
        assert exact.abs().max() > 10 * stderr.max()


def test_masked_weight_keeps_centering_and_denominator() -> None:
    """A token outside the MIS band (w(a) = 0) still pulls by +A mu_w, and the mean divides by all
    trained tokens; loss-masked tokens contribute nothing."""
    logits, p, q, head = setup("full", seed=3)
    cfg = CorrectionConfig(method="sc_mis", temperature=TEMP, implementation="naive")
    r = p / q
    out = int(torch.nonzero((r < 0.5) | (r > 2.0))[0])
    inb = int(torch.nonzero((r >= 0.5) & (r <= 2.0))[0])
    rows = logits.expand(3, V).clone().requires_grad_(True)
    batch = CorrectionBatch(labels=torch.tensor([out, inb, inb]), advantages=torch.full((3,), ADV, dtype=F64),
                            loss_mask=torch.tensor([True, True, False]),
                            sampler_logprobs=torch.log(q)[torch.tensor([out, inb, inb])],
                            topk_ids=head.expand(3, -1), topk_logprobs=torch.log(q)[head].expand(3, -1))
    loss, metrics = policy_loss(rows, batch, cfg)
    (grad,) = torch.autograd.grad(loss, rows)
    expected = closed_form_grads(p, q, q, cfg, torch.tensor([out, inb])) / 2
    torch.testing.assert_close(grad[:2], expected, rtol=0, atol=1e-12)
    assert expected[0].abs().max() > 1e-3
    assert torch.all(grad[2] == 0)
    assert metrics["tokens"] == 2.0 and metrics["out_band_share"] == 0.5


def test_ppo_clip_is_inert_on_one_step_and_sequence_weights() -> None:
    logits, p, q, head = setup("full", seed=4)
    labels = torch.tensor([1, 2, 3, 4])
    common = dict(labels=labels, advantages=torch.tensor([1.0, -0.5, 2.0, 0.3], dtype=F64),
                  loss_mask=torch.ones(4, dtype=torch.bool), sampler_logprobs=torch.log(q)[labels])
    x = logits.expand(4, V).clone().requires_grad_(True)
    plain = policy_loss(x, CorrectionBatch(**common), CorrectionConfig(method="mis", temperature=TEMP))[0]
    clipped = policy_loss(x, CorrectionBatch(**common),
                          CorrectionConfig(method="mis", temperature=TEMP, ppo_clip_eps=0.2))[0]
    g1, g2 = torch.autograd.grad(plain, x)[0], torch.autograd.grad(clipped, x)[0]
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-15)
    # sequence-level MIS: every token of a sequence gets the band-masked geometric-mean ratio
    seq = torch.tensor([0, 0, 1, 1])
    cfg = CorrectionConfig(method="mis", temperature=TEMP, weight_level="sequence", band=(0.5, 1.5))
    loss = policy_loss(x, CorrectionBatch(**common, sequence_ids=seq), cfg)[0]
    log_r = torch.log(p[labels]) - torch.log(q[labels])
    geo = torch.exp(torch.stack([log_r[:2].mean(), log_r[2:].mean()]))[seq]
    w = geo * ((geo >= 0.5) & (geo <= 1.5)).to(F64)
    assert torch.equal(w > 0, torch.tensor([True, True, False, False]))  # the second sequence is masked
    expected = (-common["advantages"] * w * torch.log(p[labels])).mean()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
