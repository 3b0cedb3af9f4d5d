"""The off-policy corrections, for any trainer: the policy loss (GRPO, MIS, TIS, score centering and
their combinations) with the sampler's top-K record or a replayed top-p set (loss.py), its chunked
custom-autograd kernel that never holds [T, V] fp32 log-probs (chunked.py) and its fused form that
takes the output layer's input and weight instead of logits (`policy_loss_from_hidden`: no [T, V] at
all), and vocabulary-parallel variants of both for tensor-parallel trainers (vocab_parallel.py).
The math: docs/corrections.md.
"""

from mixfleet.runner.corrections.loss import (
    LOG_RATIO_CLAMP,
    MAX_KEPT_IDS,
    METHODS,
    CorrectionBatch,
    CorrectionConfig,
    compute_dtype,
    grpo_advantages,
    policy_loss,
    policy_loss_from_hidden,
    token_logprobs,
)

__all__ = [
    "LOG_RATIO_CLAMP",
    "MAX_KEPT_IDS",
    "METHODS",
    "CorrectionBatch",
    "CorrectionConfig",
    "compute_dtype",
    "grpo_advantages",
    "policy_loss",
    "policy_loss_from_hidden",
    "token_logprobs",
]
