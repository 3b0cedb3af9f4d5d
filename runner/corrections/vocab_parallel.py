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

`vocab_parallel_policy_loss_from_hidden` takes the output layer's input and this rank's weight shard
instead of logits (the fused kernel: no [T, V_local] logits either); the hidden states' gradient is
then all-reduced over the group, since every shard's logits depend on them.

The batch and config are the single-process ones and must be identical on every rank of `group`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from mixfleet.costmodel.errors import SpecError
from mixfleet.runner.corrections.chunked import fused_gather_tempered_logits, gather_tempered_logits
from mixfleet.runner.corrections.loss import (
    CorrectionBatch,
    CorrectionConfig,
    _check_output_layer,
    _loss_from_gathered,
    _prepare,
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
    group, mask, ids, k_head = _prepare_shard("vocab_parallel_policy_loss", logits_shard.shape[1],
                                              logits_shard.device, batch, config, group, vocab_start)
    z_ids, lse, entropy = gather_tempered_logits(
        logits_shard, ids, config.temperature, config.chunk_size, group=group, vocab_start=vocab_start
    )
    return _loss_from_gathered(z_ids, lse, entropy, batch, config, mask, k_head)


def vocab_parallel_policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    batch: CorrectionBatch,
    config: CorrectionConfig,
    *,
    group: Any,
    vocab_start: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss_from_hidden` with the output layer's weight sharded along the vocabulary.

    `hidden` [T, H] is replicated on every rank of `group` (as the input of Megatron's
    ColumnParallelLinear); `weight_shard` [V_local, H] holds the vocabulary rows
    [vocab_start, vocab_start + V_local). Same loss and metrics as the single-process loss on every
    rank; the backward returns this rank's weight-shard gradient and the full gradient of `hidden`
    (all-reduced over the group, the one communication of the backward). Pass `hidden` itself, not
    through a region that all-reduces its gradient again (e.g. Megatron's copy_to_tensor_model_parallel_region).
    Collective, like `vocab_parallel_policy_loss`; `config.implementation` is ignored (always fused).
    """
    where = "vocab_parallel_policy_loss_from_hidden"
    _check_output_layer(where, hidden, weight_shard, batch)
    group, mask, ids, k_head = _prepare_shard(where, weight_shard.shape[0], hidden.device, batch, config, group,
                                              vocab_start)
    z_ids, lse, entropy = fused_gather_tempered_logits(
        hidden, weight_shard, ids, config.temperature, config.chunk_size, group=group, vocab_start=vocab_start
    )
    return _loss_from_gathered(z_ids, lse, entropy, batch, config, mask, k_head)


def _prepare_shard(
    where: str, vocab_local: int, device: torch.device, batch: CorrectionBatch, config: CorrectionConfig,
    group: Any, vocab_start: int,
) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
    """The group (None: WORLD), then `_prepare` against the full vocabulary (the shards' sizes summed)."""
    if vocab_start < 0:
        raise SpecError(where, "vocab_start", vocab_start, "an integer >= 0")
    group = group if group is not None else dist.group.WORLD
    vocab_size = torch.tensor([vocab_local], dtype=torch.int64, device=device)
    dist.all_reduce(vocab_size, op=dist.ReduceOp.SUM, group=group)
    mask, ids, k_head = _prepare(batch, config, int(vocab_size.item()), device)
    return group, mask, ids, k_head
