"""Off-policy corrections for RL on mixed sampler fleets: the trainer's per-token policy loss.

Public entry point, callable from any torch trainer (ours, verl, slime, a plain loop):

    loss, metrics = policy_loss(logits, batch, config)

`logits` [T, V] (any float dtype; bf16 is computed in fp32 chunk by chunk), `batch` a
`CorrectionBatch` of per-token tensors, `config` a `CorrectionConfig`. Pure torch: no process
groups, no I/O (the vocabulary-parallel variant is `corrections_vocab_parallel`).

The math, per token position with context h (derived in full in docs/corrections.md)
------------------------------------------------------------------------------------
z = logits / temperature; p = softmax(z) is the trainer policy, q the distribution the sampler
really sampled from (after its temperature and top-p), a the sampled token, A the token's
advantage (detached). The score of v w.r.t. z is s_v = d log p(v) / dz = e_v - p. The importance
ratio r(v) = p(v) / q(v) is always exp(clamp(log p(v) - log q(v), -20, 20)) with p detached.

Token weights w (never differentiated): none (w = 1), MIS (w = r on the band lo <= r <= hi, else 0;
default band [0.5, 2]) or TIS (w = min(r, C)).

Surrogate losses (minimized; reduced by a token-mean over the original loss mask, or with
`loss_agg="seq_mean_token_mean"` by a mean over trajectories of each one's token-mean):
    grpo:  -A log p(a)                         expected update under q: -A (q - p), a drift to q
    mis:   -A w(a) log p(a)                    expected update: -A (p_B - P_B p), B the band set
    tis:   -A w(a) log p(a)                    expected update: -A (m - M p), m = min(p, C q)
    sc / sc_mis / sc_tis:
           -A [ w(a) log p(a) - sum_v sg(q(v) w(v)) log p(v) ]          (w = 1 for sc)
The centered gradient is -A [w(a) s_a - mu_w] with mu_w = sum_v q(v) w(v) s_v = E_{a~q}[w(a) s_a],
so its expectation under a ~ q is exactly zero for any w: the centering is applied to the weighted
term. A token whose own weight is 0 keeps its centering term and its place in the denominator.

What q is known on. (1) Full sampling with a top-K record H (log q normalized over the full
vocabulary): outside H we model q = rho p with rho = (1 - Q_H) / (1 - P_H), Q_H = sum_H q,
P_H = sum_H sg(p), each tail mass floored at 1e-6. Because sum_v p(v) s_v = 0 the tail's
contribution alpha * sum_{v not in H} p(v) s_v equals -alpha * sum_{v in H} p(v) s_v, so the
centering needs only the head:
    centering = sum_{v in H} sg(c(v) - alpha p(v)) log p(v)
with (c, alpha) = (q, rho) for sc, (p 1[lo <= r <= hi], 1[1/hi <= rho <= 1/lo]) for MIS (the tail
ratio is 1/rho), (min(p, C q), min(1, C rho)) for TIS. The sampled token's own weight always uses
its exact recorded log q(a). (2) Top-p sampling with mask replay: the sampler recorded its kept set
S and q~ renormalized over S; we use log p~(v) = z_v - logsumexp_{u in S} z_u and p~, q~ in every
formula, summing over S: the centering is exact (no tail), and logits outside S get exactly zero
gradient. We subtract alpha(rho = 1) p~ over S there too: sum_S p~ s~ = 0, so the gradient is
unchanged, and the centering term is exactly 0 when p == q. A row whose S is empty or lacks the
sampled token falls back to full-vocabulary log-probs (counted in `fallback_rows`); its weight uses
`sampler_logprobs` and its centering uses the top-K head when recorded, otherwise an empty head
(the tail model with H empty says q is proportional to p, whose centering gradient is zero).

With p == q (sampler log-probs computed by the same function) every method reduces to grpo bit for
bit: r = 1 exactly, w = 1 and every centering coefficient c - alpha p is exactly 0.

SC is a REINFORCE-style estimator: it is refused together with PPO clipping or sequence-level
weights (those are offered only for grpo / mis / tis).

Memory: `implementation="chunked"` (default) never materializes [T, V] float32 (see
`corrections_chunked`); `"naive"` is the plain reference used by the tests and the benchmark.
`policy_loss_from_hidden(hidden, weight, batch, config)` fuses the output layer into that kernel,
so not even the [T, V] logits or their gradient exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import LOSS_AGGS
from mixfleet.runner.corrections.chunked import (
    DEFAULT_CHUNK_ROWS,
    compute_dtype,
    fused_gather_tempered_logits,
    gather_tempered_logits,
    gather_tempered_logits_naive,
)

METHODS = ("grpo", "mis", "tis", "sc", "sc_mis", "sc_tis")
IMPLEMENTATIONS = ("chunked", "naive")
WEIGHT_LEVELS = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0          # |log r| is clamped to this before exp
TAIL_MASS_FLOOR = 1e-6          # floor on 1 - Q_H and 1 - P_H
DIAGNOSTIC_BAND = (0.2, 5.0)    # the seed's extreme-ratio band, reported per sampler group
MAX_KEPT_IDS = 512              # cap on the recorded top-p kept set per position

_WEIGHT_KIND = {"grpo": "none", "sc": "none", "mis": "mis", "sc_mis": "mis", "tis": "tis", "sc_tis": "tis"}


@dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """How the policy loss corrects for the sampler/trainer mismatch. Validated on construction."""

    method: str = "sc_mis"                   # one of METHODS
    band: tuple[float, float] = (0.5, 2.0)   # MIS band [lo, hi] on r = p/q (dimensionless), lo <= 1 <= hi
    tis_cap: float = 2.0                     # TIS cap C on r (dimensionless), >= 1
    temperature: float = 1.0                 # sampling temperature; logits are divided by it first
    chunk_size: int = DEFAULT_CHUNK_ROWS     # token rows per chunk of the memory-bounded kernel
    implementation: str = "chunked"          # "chunked" (O(chunk x V) memory) or "naive" (reference)
    top_p_replay: bool = False               # renormalize over the recorded kept set (batch.kept_*)
    ppo_clip_eps: float | None = None        # PPO ratio clip epsilon in (0, 1); grpo/mis/tis only
    weight_level: str = "token"              # "token", or "sequence" (geometric-mean ratio; mis/tis only)
    loss_agg: str = "token_mean"             # how per-token losses become one: see LOSS_AGGS and the module doc

    def __post_init__(self) -> None:
        where = "CorrectionConfig"
        if self.method not in METHODS:
            raise SpecError(where, "method", self.method, METHODS)
        band = tuple(self.band)
        if len(band) != 2 or not (0.0 < float(band[0]) <= 1.0 <= float(band[1])):
            raise SpecError(where, "band", self.band, "a pair (lo, hi) with 0 < lo <= 1 <= hi")
        object.__setattr__(self, "band", (float(band[0]), float(band[1])))
        if not self.tis_cap >= 1.0:
            raise SpecError(where, "tis_cap", self.tis_cap, "a number >= 1")
        if not self.temperature > 0.0:
            raise SpecError(where, "temperature", self.temperature, "a number > 0")
        if not (isinstance(self.chunk_size, int) and self.chunk_size >= 1):
            raise SpecError(where, "chunk_size", self.chunk_size, "an integer >= 1 (rows per chunk)")
        if self.implementation not in IMPLEMENTATIONS:
            raise SpecError(where, "implementation", self.implementation, IMPLEMENTATIONS)
        if self.weight_level not in WEIGHT_LEVELS:
            raise SpecError(where, "weight_level", self.weight_level, WEIGHT_LEVELS)
        if self.loss_agg not in LOSS_AGGS:
            raise SpecError(where, "loss_agg", self.loss_agg, LOSS_AGGS)
        if self.ppo_clip_eps is not None and not (0.0 < self.ppo_clip_eps < 1.0):
            raise SpecError(where, "ppo_clip_eps", self.ppo_clip_eps, "None or a number in (0, 1)")
        centered = self.method.startswith("sc")
        if centered and self.ppo_clip_eps is not None:
            raise SpecError(where, "ppo_clip_eps", self.ppo_clip_eps,
                            f"None with method {self.method!r}: score centering is a REINFORCE-style estimator "
                            "and does not compose with PPO clipping (use grpo, mis or tis to clip)")
        if centered and self.weight_level != "token":
            raise SpecError(where, "weight_level", self.weight_level,
                            f"'token' with method {self.method!r}: score centering needs per-token weights "
                            "(sequence-level weights are offered for mis and tis)")
        if self.weight_level == "sequence" and _WEIGHT_KIND[self.method] == "none":
            raise SpecError(where, "weight_level", self.weight_level,
                            f"'token' with method {self.method!r}, which has no weights (sequence: mis, tis)")

    @property
    def weight_kind(self) -> str:
        """'none', 'mis' or 'tis': the importance weight this method applies."""
        return _WEIGHT_KIND[self.method]

    @property
    def centered(self) -> bool:
        return self.method.startswith("sc")

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> CorrectionConfig:
        """Build from a TOML table (e.g. `[corrections]`); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        for key in table:
            if key not in known:
                raise SpecError("CorrectionConfig", key, table[key], sorted(known))
        values = dict(table)
        if "band" in values:
            values["band"] = tuple(values["band"])
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class CorrectionBatch:
    """Per-token tensors for `policy_loss` (T token positions, already shifted so labels[t] follows row t).

    Shapes are checked on construction; values (label range, kept sets) in `policy_loss`.
    """

    labels: torch.Tensor                        # [T] int, the sampled token a (any value where loss_mask is 0)
    advantages: torch.Tensor                    # [T] float, A per token (detached)
    loss_mask: torch.Tensor                     # [T] bool or 0/1 float: tokens that are trained on
    sampler_logprobs: torch.Tensor              # [T] float, log q(a) as the sampler sampled it
    topk_ids: torch.Tensor | None = None        # [T, K] int, the sampler's K most likely ids (-1 pads)
    topk_logprobs: torch.Tensor | None = None   # [T, K] float, their log q over the full vocabulary
    kept_ids: torch.Tensor | None = None        # [T, S] int, top-p kept set (-1 pads), S <= MAX_KEPT_IDS
    kept_logprobs: torch.Tensor | None = None   # [T, S] float, log q~ renormalized over the kept set (-inf pads)
    group_ids: torch.Tensor | None = None       # [T] int, sampler group that produced the token (metrics)
    sequence_ids: torch.Tensor | None = None    # [T] int, sequence of each token (weight_level="sequence")
    old_logprobs: torch.Tensor | None = None    # [T] float, log p_old(a) for PPO clipping (default: sg(log p))

    def __post_init__(self) -> None:
        where = "CorrectionBatch"
        if self.labels.dim() != 1:
            raise SpecError(where, "labels", tuple(self.labels.shape), "a 1-D tensor [T]")
        if self.labels.dtype.is_floating_point:
            raise SpecError(where, "labels", self.labels.dtype, "an integer tensor")
        n = self.labels.shape[0]
        for name in ("advantages", "loss_mask", "sampler_logprobs", "group_ids", "sequence_ids", "old_logprobs"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise SpecError(where, name, tuple(t.shape), f"shape ({n},), like labels")
        for ids_name, lp_name in (("topk_ids", "topk_logprobs"), ("kept_ids", "kept_logprobs")):
            ids, lp = getattr(self, ids_name), getattr(self, lp_name)
            if (ids is None) != (lp is None):
                raise SpecError(where, lp_name if lp is None else ids_name, None,
                                f"given together with {ids_name if lp is None else lp_name}")
            if ids is None:
                continue
            if ids.dim() != 2 or ids.shape[0] != n or ids.dtype.is_floating_point:
                raise SpecError(where, ids_name, tuple(ids.shape), f"an integer tensor of shape ({n}, K)")
            if tuple(lp.shape) != tuple(ids.shape):
                raise SpecError(where, lp_name, tuple(lp.shape), f"shape {tuple(ids.shape)}, like {ids_name}")
        if self.kept_ids is not None and self.kept_ids.shape[1] > MAX_KEPT_IDS:
            raise SpecError(where, "kept_ids", tuple(self.kept_ids.shape), f"at most {MAX_KEPT_IDS} ids per row")

    @property
    def num_tokens(self) -> int:
        return int(self.labels.shape[0])


def grpo_advantages(
    rewards: torch.Tensor, prompt_ids: torch.Tensor, *, normalize_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages per sample: reward minus the mean reward of its prompt group.

    With `normalize_std`, divided by (group std + eps), the std being the unbiased (n - 1) one and 0
    for a group of one sample. Detached. `rewards` [N] float, `prompt_ids` [N] int (any labels).
    """
    if rewards.dim() != 1 or tuple(prompt_ids.shape) != tuple(rewards.shape):
        raise SpecError("grpo_advantages", "prompt_ids", tuple(prompt_ids.shape),
                        f"a 1-D tensor shaped like rewards {tuple(rewards.shape)}")
    rewards = rewards.detach().to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    _, group = torch.unique(prompt_ids, return_inverse=True)
    n_groups = int(group.max().item()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    count.index_add_(0, group, torch.ones_like(rewards))
    total = torch.zeros_like(count).index_add_(0, group, rewards)
    centered = rewards - (total / count)[group]
    if not normalize_std:
        return centered
    sq = torch.zeros_like(count).index_add_(0, group, centered * centered)
    std = torch.where(count > 1, torch.sqrt(sq / (count - 1).clamp(min=1)), torch.zeros_like(count))
    return centered / (std[group] + eps)


def _weights(log_ratio: torch.Tensor, kind: str, config: CorrectionConfig) -> torch.Tensor:
    """Importance weights from clamped, detached log-ratios: none (1), MIS (band mask), TIS (cap)."""
    r = torch.exp(log_ratio)
    if kind == "mis":
        lo, hi = config.band
        return r * ((r >= lo) & (r <= hi)).to(r.dtype)
    if kind == "tis":
        return r.clamp(max=config.tis_cap)
    return torch.ones_like(r)


def _centering_coefficients(
    logp: torch.Tensor, logq: torch.Tensor, valid: torch.Tensor, kind: str, config: CorrectionConfig,
    exact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Detached k(v) = c(v) - alpha p(v) on a known set (top-K head, or kept set when `exact`).

    Returns (k [T, M], P [T], Q [T], rho [T]). For the kept set there is no tail: rho is 1.
    """
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = logp.detach()
    p = torch.where(valid, torch.exp(logp), zero)
    q = torch.where(valid, torch.exp(logq), zero)
    big_p, big_q = p.sum(dim=-1), q.sum(dim=-1)
    if exact:
        rho = torch.ones_like(big_p)
    else:
        rho = (1.0 - big_q).clamp(min=TAIL_MASS_FLOOR) / (1.0 - big_p).clamp(min=TAIL_MASS_FLOOR)
    if kind == "mis":
        lo, hi = config.band
        r = torch.exp(torch.where(valid, logp - logq, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        c = p * ((r >= lo) & (r <= hi)).to(p.dtype)
        alpha = ((rho >= 1.0 / hi) & (rho <= 1.0 / lo)).to(p.dtype)
    elif kind == "tis":
        c = torch.minimum(p, config.tis_cap * q)
        alpha = (config.tis_cap * rho).clamp(max=1.0)
    else:
        c = q
        alpha = rho
    k = torch.where(valid, c - alpha.unsqueeze(1) * p, zero)
    return k, big_p, big_q, rho


def _check_values(batch: CorrectionBatch, mask: torch.Tensor, vocab_size: int, config: CorrectionConfig) -> None:
    """The value checks that need the vocabulary size (one host sync)."""
    labels = torch.where(mask, batch.labels, torch.zeros_like(batch.labels))
    checks = [labels.min() if labels.numel() else torch.tensor(0), labels.max() if labels.numel() else torch.tensor(0)]
    names = ["labels", "labels"]
    for name in ("topk_ids", "kept_ids"):
        ids = getattr(batch, name)
        if ids is not None and ids.numel():
            checks += [ids.min(), ids.max()]
            names += [name, name]
    values = torch.stack([c.to(torch.int64).cpu() for c in checks]).tolist()
    for i in range(0, len(values), 2):
        lo_allowed = 0 if names[i] == "labels" else -1
        if values[i] < lo_allowed or values[i + 1] >= vocab_size:
            raise SpecError("CorrectionBatch", names[i], (values[i], values[i + 1]),
                            f"ids in [{lo_allowed}, {vocab_size - 1}] (vocabulary size {vocab_size})")
    if config.top_p_replay and batch.kept_ids is None:
        raise SpecError("CorrectionBatch", "kept_ids", None, "the recorded kept sets when config.top_p_replay is True")
    if not config.top_p_replay and batch.kept_ids is not None:
        raise SpecError("CorrectionConfig", "top_p_replay", False, "True when the batch carries kept_ids/kept_logprobs")
    if config.centered and batch.topk_ids is None and batch.kept_ids is None:
        raise SpecError("CorrectionBatch", "topk_ids", None,
                        f"the sampler's top-K ids and log-probs (or top-p kept sets) for method {config.method!r}")
    if config.weight_level == "sequence" and batch.sequence_ids is None:
        raise SpecError("CorrectionBatch", "sequence_ids", None, "per-token sequence ids for weight_level='sequence'")
    if config.loss_agg == "seq_mean_token_mean" and batch.sequence_ids is None:
        raise SpecError("CorrectionBatch", "sequence_ids", None,
                        "per-token sequence ids for loss_agg='seq_mean_token_mean'")


def _gather_ids(batch: CorrectionBatch, labels: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """[T, 1 + K + S] ids: the sampled token, the top-K head, the kept set."""
    parts = [labels.unsqueeze(1)]
    k = s = 0
    if batch.topk_ids is not None:
        parts.append(batch.topk_ids.to(torch.int64))
        k = batch.topk_ids.shape[1]
    if batch.kept_ids is not None:
        parts.append(batch.kept_ids.to(torch.int64))
        s = batch.kept_ids.shape[1]
    return torch.cat(parts, dim=1), k, s


def _loss_from_gathered(
    z_ids: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, batch: CorrectionBatch,
    config: CorrectionConfig, mask: torch.Tensor, k_head: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Everything after the vocabulary-sized work: weights, centering, token-mean, metrics."""
    cd = z_ids.dtype
    dev = z_ids.device
    zero = torch.zeros((), dtype=cd, device=dev)
    kind = config.weight_kind
    adv = batch.advantages.detach().to(cd)
    logq_sampled = batch.sampler_logprobs.detach().to(cd)

    logp_a = z_ids[:, 0] - lse
    logq_a = logq_sampled
    fallback = torch.zeros_like(mask)
    use_head = torch.zeros_like(mask)
    head = kept = None
    if batch.topk_ids is not None:
        h_valid = batch.topk_ids >= 0
        logp_h = z_ids[:, 1:1 + k_head] - lse.unsqueeze(1)
        neg_inf = torch.full((), -torch.inf, dtype=cd, device=dev)
        logq_h = torch.where(h_valid, batch.topk_logprobs.detach().to(cd), neg_inf)
        head = (logp_h, logq_h, h_valid)
        use_head = torch.ones_like(mask)
    if batch.kept_ids is not None:
        s_valid = batch.kept_ids >= 0
        labels = batch.labels.to(torch.int64)
        match = (batch.kept_ids.to(torch.int64) == labels.unsqueeze(1)) & s_valid
        replay = match.any(dim=1)
        fallback = ~replay
        s_use = s_valid & replay.unsqueeze(1)
        z_s = z_ids[:, 1 + k_head:]
        neg_inf = torch.full((), -torch.inf, dtype=cd, device=dev)
        # non-kept entries are -inf before exp; fallback rows get a finite dummy row (their result is unused)
        z_s = torch.where(s_use, z_s, torch.where(replay.unsqueeze(1), neg_inf, zero))
        lse_s = torch.logsumexp(z_s, dim=1)
        logp_s = torch.where(s_use, z_s - lse_s.unsqueeze(1), zero)
        logq_s = torch.where(s_use, batch.kept_logprobs.detach().to(cd), neg_inf)
        pos_a = match.to(torch.int8).argmax(dim=1, keepdim=True)
        logp_a = torch.where(replay, logp_s.gather(1, pos_a).squeeze(1), logp_a)
        logq_a = torch.where(replay, logq_s.gather(1, pos_a).squeeze(1), logq_a)
        kept = (logp_s, logq_s, s_use, replay)
        use_head = use_head & fallback

    # importance weights of the sampled tokens (detached, from clamped log-ratios)
    log_ratio = (logp_a.detach() - logq_a).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if config.weight_level == "sequence":
        seq = torch.unique(batch.sequence_ids, return_inverse=True)[1]
        n_seq = int(seq.max().item()) + 1 if seq.numel() else 0
        m = mask.to(cd)
        num = torch.zeros(n_seq, dtype=cd, device=dev).index_add_(0, seq, log_ratio * m)
        den = torch.zeros(n_seq, dtype=cd, device=dev).index_add_(0, seq, m)
        w_a = _weights((num / den.clamp(min=1.0))[seq], kind, config)
    else:
        w_a = _weights(log_ratio, kind, config)

    if config.ppo_clip_eps is not None:
        old = logp_a.detach() if batch.old_logprobs is None else batch.old_logprobs.detach().to(cd)
        ratio = torch.exp(logp_a - old)
        eps = config.ppo_clip_eps
        per_token = -w_a * torch.minimum(ratio * adv, ratio.clamp(1.0 - eps, 1.0 + eps) * adv)
    else:
        per_token = -(adv * w_a) * logp_a

    big_p = big_q = rho = None
    if config.centered:
        centering = torch.zeros_like(logp_a)
        if head is not None:
            k_h, big_p, big_q, rho = _centering_coefficients(*head, kind, config, exact=False)
            centering = torch.where(use_head, (k_h * torch.where(head[2], head[0], zero)).sum(dim=1), centering)
        if kept is not None:
            logp_s, logq_s, s_use, replay = kept
            k_s = _centering_coefficients(logp_s, logq_s, s_use, kind, config, exact=True)[0]
            centering = torch.where(replay, (k_s * logp_s).sum(dim=1), centering)
        per_token = per_token + adv * centering
    elif head is not None:
        with torch.no_grad():
            _, big_p, big_q, rho = _centering_coefficients(*head, kind, config, exact=False)

    loss = torch.where(mask, per_token * _aggregation_weights(batch, mask, config, cd), zero).sum()

    with torch.no_grad():
        kept_size = None if kept is None else kept[2].sum(dim=1).to(cd)
        parts = _metric_parts(logp_a.detach(), logq_a, log_ratio, w_a, kind, config, entropy.to(cd), adv,
                              fallback, use_head, big_p, big_q, rho, kept_size, None if kept is None else kept[3])
        metrics = _reduce_metrics(parts, mask, batch.group_ids)
        metrics["loss"] = loss.detach()
    keys = list(metrics)
    values = torch.stack([metrics[k].to(torch.float64).reshape(()) for k in keys]).cpu().tolist()
    return loss, dict(zip(keys, values, strict=True))


def _aggregation_weights(batch: CorrectionBatch, mask: torch.Tensor, config: CorrectionConfig,
                         cd: torch.dtype) -> torch.Tensor:
    """Per-token weights (detached, summing to 1 over the loss mask) that turn per-token losses into the loss.

    token_mean: 1 / N for each of the N trained tokens, so a trajectory weighs in proportion to its length.
    seq_mean_token_mean: 1 / (S n_i) for the n_i trained tokens of each of the S trajectories that have any, so
    every trajectory weighs the same (GRPO's own 1/G sum_i 1/|o_i| sum_t). With sequence-level rewards where failures
    run longer than successes (a turn cap, a repeated tool error), token_mean lets the failures' tokens outweigh
    the successes' in every prompt-group although their advantages sum to zero (docs/corrections.md)."""
    m = mask.to(cd)
    if config.loss_agg == "token_mean":
        return m / m.sum().clamp(min=1.0)
    seq = torch.unique(batch.sequence_ids, return_inverse=True)[1]
    n_seq = int(seq.max().item()) + 1 if seq.numel() else 0
    per_seq = torch.zeros(n_seq, dtype=cd, device=m.device).index_add_(0, seq, m)
    trained = (per_seq > 0).sum().to(cd).clamp(min=1.0)
    return m / (per_seq[seq].clamp(min=1.0) * trained)


def _metric_parts(
    logp_a: torch.Tensor, logq_a: torch.Tensor, log_ratio: torch.Tensor, w_a: torch.Tensor, kind: str,
    config: CorrectionConfig, entropy: torch.Tensor, adv: torch.Tensor, fallback: torch.Tensor,
    use_head: torch.Tensor, big_p: torch.Tensor | None, big_q: torch.Tensor | None, rho: torch.Tensor | None,
    kept_size: torch.Tensor | None, replay: torch.Tensor | None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per-token metric values with an optional per-token validity (beyond the loss mask)."""
    r = torch.exp(log_ratio)
    lo, hi = config.band
    dlo, dhi = DIAGNOSTIC_BAND
    ess_w = r if kind == "none" else w_a
    parts: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        "k1": (logq_a - logp_a, None),
        "k3": (torch.expm1(log_ratio) - log_ratio, None),
        "abs_dlogp": ((logp_a - logq_a).abs(), None),
        "out_band_share": (((r < lo) | (r > hi)).to(r.dtype), None),
        "out_diag_low_share": ((r < dlo).to(r.dtype), None),
        "out_diag_high_share": ((r > dhi).to(r.dtype), None),
        "weight_mean": (w_a, None),
        "entropy": (entropy, None),
        "adv_mean": (adv, None),
        "adv_abs_mean": (adv.abs(), None),
        "_ess_w": (ess_w, None),
        "_fallback": (fallback.to(r.dtype), None),
    }
    if big_p is not None:
        parts["head_mass_p"] = (big_p, use_head)
        parts["head_mass_q"] = (big_q, use_head)
        parts["rho"] = (rho, use_head)
    if kept_size is not None:
        parts["kept_size"] = (kept_size, replay)
    return parts


def _reduce_metrics(
    parts: dict[str, tuple[torch.Tensor, torch.Tensor | None]], mask: torch.Tensor, group_ids: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Token-means over the loss mask, overall and per group id ('group/<id>/<name>')."""
    out: dict[str, torch.Tensor] = {}
    selections: list[tuple[str, torch.Tensor]] = [("", mask)]
    if group_ids is not None:
        for g in torch.unique(group_ids[mask]).tolist():
            selections.append((f"group/{int(g)}/", mask & (group_ids == g)))
    for prefix, sel in selections:
        n = sel.sum().to(torch.float64)
        out[prefix + "tokens"] = n
        for name, (values, valid) in parts.items():
            s = sel if valid is None else sel & valid
            v = torch.where(s, values, torch.zeros((), dtype=values.dtype, device=values.device)).to(torch.float64)
            count = s.sum().to(torch.float64)
            if name == "_ess_w":
                total, total_sq = v.sum(), (v * v).sum()
                out[prefix + "ess"] = torch.where(total_sq > 0, total * total / (count * total_sq).clamp(min=1e-300),
                                                  torch.zeros((), dtype=torch.float64, device=v.device))
            elif name == "_fallback":
                out[prefix + "fallback_rows"] = v.sum()
            else:
                out[prefix + name] = v.sum() / count.clamp(min=1.0)
    return out


def policy_loss(
    logits: torch.Tensor, batch: CorrectionBatch, config: CorrectionConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The corrected policy-gradient loss (a scalar to minimize) and its metrics.

    `logits` [T, V]: the trainer's raw logits at the positions predicting `batch.labels` (any float
    dtype; not yet divided by the temperature). Returns the token-mean loss over `batch.loss_mask`
    and a dict of floats: k1, k3, abs_dlogp, out_band_share, out_diag_low_share, out_diag_high_share,
    ess, weight_mean, entropy, adv_mean, adv_abs_mean, fallback_rows, tokens, loss, and when recorded
    head_mass_p, head_mass_q, rho (top-K rows) and kept_size (replayed rows); each also as
    'group/<id>/<name>' when `batch.group_ids` is given.
    """
    if logits.dim() != 2 or logits.shape[0] != batch.num_tokens:
        raise SpecError("policy_loss", "logits", tuple(logits.shape), f"shape ({batch.num_tokens}, V)")
    if not logits.dtype.is_floating_point:
        raise SpecError("policy_loss", "logits", logits.dtype, "a floating-point tensor")
    mask, ids, k_head = _prepare(batch, config, logits.shape[1], logits.device)
    if config.implementation == "naive":
        z_ids, lse, entropy = gather_tempered_logits_naive(logits, ids, config.temperature)
    else:
        z_ids, lse, entropy = gather_tempered_logits(logits, ids, config.temperature, config.chunk_size)
    return _loss_from_gathered(z_ids, lse, entropy, batch, config, mask, k_head)


def policy_loss_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, batch: CorrectionBatch, config: CorrectionConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss(hidden @ weight.T, batch, config)` with the output layer fused into the loss.

    `hidden` [T, H]: the model's final hidden states (after its final norm) at the positions
    predicting `batch.labels`; `weight` [V, H]: the output layer's weight (no bias), same float
    dtype. With the default `implementation="chunked"` neither the [T, V] logits nor their gradient
    ever exist: chunks of `config.chunk_size` rows go through the output layer, are reduced to the few
    numbers the loss needs and dropped, and are recomputed in the backward pass, which returns the
    gradients of `hidden` and `weight` (the weight's accumulated over the chunks in fp32, rounded
    once). `"naive"` builds the logits and runs the naive `policy_loss` (the tests' reference).
    Same loss and metrics as `policy_loss` (to the rounding of the matrix products).
    """
    _check_output_layer("policy_loss_from_hidden", hidden, weight, batch)
    if config.implementation == "naive":
        return policy_loss(hidden @ weight.T, batch, config)
    mask, ids, k_head = _prepare(batch, config, weight.shape[0], hidden.device)
    z_ids, lse, entropy = fused_gather_tempered_logits(hidden, weight, ids, config.temperature, config.chunk_size)
    return _loss_from_gathered(z_ids, lse, entropy, batch, config, mask, k_head)


def _check_output_layer(where: str, hidden: torch.Tensor, weight: torch.Tensor, batch: CorrectionBatch) -> None:
    if hidden.dim() != 2 or hidden.shape[0] != batch.num_tokens:
        raise SpecError(where, "hidden", tuple(hidden.shape), f"shape ({batch.num_tokens}, H)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise SpecError(where, "weight", tuple(weight.shape), f"shape (V, {hidden.shape[1]}), the output layer's")
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise SpecError(where, "weight", weight.dtype, f"the floating-point dtype of hidden ({hidden.dtype})")
    if weight.device != hidden.device:
        raise SpecError(where, "weight", str(weight.device), f"the device of hidden ({hidden.device})")


def _prepare(
    batch: CorrectionBatch, config: CorrectionConfig, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The value checks, then (loss mask as bool, the [T, 1 + K + S] ids to gather, K)."""
    mask = batch.loss_mask.bool() if batch.loss_mask.dtype == torch.bool else batch.loss_mask > 0
    _check_values(batch, mask, vocab_size, config)
    labels = torch.where(mask, batch.labels.to(torch.int64), torch.zeros((), dtype=torch.int64, device=device))
    ids, k_head, _ = _gather_ids(batch, labels)
    return mask, ids, k_head


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, config: CorrectionConfig) -> torch.Tensor:
    """log p(ids) over the full vocabulary with the config's temperature and implementation.

    `ids` [T] or [T, M] (-1 pads give -inf). No gradient. Handy to compute the sampler's side of a
    test, or log-probs for a reference policy, through exactly the loss's own arithmetic.
    """
    squeeze = ids.dim() == 1
    ids2 = (ids.unsqueeze(1) if squeeze else ids).to(torch.int64)
    with torch.no_grad():
        if config.implementation == "naive":
            z_ids, lse, _ = gather_tempered_logits_naive(logits, ids2, config.temperature)
        else:
            z_ids, lse, _ = gather_tempered_logits(logits, ids2, config.temperature, config.chunk_size)
        out = torch.where(ids2 >= 0, z_ids - lse.unsqueeze(1), torch.full((), -torch.inf, dtype=z_ids.dtype))
    return out.squeeze(1) if squeeze else out


__all__ = [
    "CorrectionBatch",
    "CorrectionConfig",
    "METHODS",
    "compute_dtype",
    "grpo_advantages",
    "policy_loss",
    "policy_loss_from_hidden",
    "token_logprobs",
]
