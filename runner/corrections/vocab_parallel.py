"""The corrected policy loss when the logits are sharded over the vocabulary (tensor parallelism).

Megatron-style trainers keep the output layer split over the vocabulary across tensor-parallel
ranks, so each rank holds logits[:, vocab_start : vocab_start + V_local]. This variant returns the
same loss and metrics as `mixfleet.runner.corrections.policy_loss` on the full logits, on every rank,
and each rank's gradient for its own shard, without ever gathering [T, V]:

- forward (chunked over rows): the per-row max and rescaled exp-sums are all-reduced (MAX, SUM)
  into the full-vocabulary logsumexp and entropy; the tempered logits at the needed ids (sampled
  token, top-K head, kept set) are gathered where they live and all-reduced (SUM; other ranks add 0);
- everything after that (weights, centering, token-mean, metrics) is the single-process code on
  replicated [T, 1 + K + S] tensors;
- backward: no communication. Each rank's shard gradient is its local softmax term plus the scatter
  of its own ids; the replicated loss is not summed over ranks, so the gradient is not multiplied by
  the tensor-parallel size.

The batch and config are the single-process ones and must be identical on every rank of `group`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from mixfleet.costmodel.errors import SpecError
from mixfleet.runner.corrections.chunked import gather_tempered_logits
from mixfleet.runner.corrections.loss import (
    CorrectionBatch,
    CorrectionConfig,
    _check_values,
    _gather_ids,
    _loss_from_gathered,
)


def vocab_parallel_policy_loss(
    logits_shard: torch.Tensor,
    batch: CorrectionBatch,
    config: CorrectionConfig,
    *,
    group: Any,
    vocab_start: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss` for vocabulary-sharded logits [T, V_local] starting at column `vocab_start`.

    `group` is the tensor-parallel process group (None: the default group). Collective: every rank
    of the group must call it with the same batch and config. `config.implementation` is ignored
    (always the chunked kernel).
    """
    if logits_shard.dim() != 2 or logits_shard.shape[0] != batch.num_tokens:
        raise SpecError("vocab_parallel_policy_loss", "logits_shard", tuple(logits_shard.shape),
                        f"shape ({batch.num_tokens}, V_local)")
    if vocab_start < 0:
        raise SpecError("vocab_parallel_policy_loss", "vocab_start", vocab_start, "an integer >= 0")
    group = group if group is not None else dist.group.WORLD
    vocab_size = torch.tensor([logits_shard.shape[1]], dtype=torch.int64, device=logits_shard.device)
    dist.all_reduce(vocab_size, op=dist.ReduceOp.SUM, group=group)
    mask = batch.loss_mask.bool() if batch.loss_mask.dtype == torch.bool else batch.loss_mask > 0
    _check_values(batch, mask, int(vocab_size.item()), config)
    labels = torch.where(mask, batch.labels.to(torch.int64), torch.zeros((), dtype=torch.int64))
    ids, k_head, _ = _gather_ids(batch, labels.to(logits_shard.device))
    z_ids, lse, entropy = gather_tempered_logits(
        logits_shard, ids, config.temperature, config.chunk_size, group=group, vocab_start=vocab_start
    )
    return _loss_from_gathered(z_ids, lse, entropy, batch, config, mask, k_head)
