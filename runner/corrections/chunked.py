"""Memory-bounded logits gather for the off-policy loss: never holds [T, V] float32 log-probs.

The loss of `mixfleet.runner.corrections` needs, per token row, only a few numbers from the
vocabulary-sized softmax: the tempered logit z = logits / temperature at a small set of ids (the
sampled token, the sampler's top-K head, the recorded top-p kept set), the row's log-partition
lse = logsumexp_v z_v, and the entropy (a metric). `gather_tempered_logits` computes exactly these
with a custom autograd function that walks the rows in chunks, in float32 (float64 when the logits
are float64), and recomputes the softmax chunk by chunk in the backward pass:

    d loss / d logits[t, v] = ( g_lse[t] * p_t(v) + sum_{j : ids[t, j] = v} g_ids[t, j] ) / temperature

where g_ids, g_lse are the gradients arriving at the gathered logits and at lse. Peak working memory
is O(chunk_rows x V) plus the gradient buffer in the logits' own dtype (which any implementation
returns).

Vocabulary parallelism: when `group` is a torch.distributed process group, `logits` is this rank's
shard of the vocabulary, columns [vocab_start, vocab_start + V_local). The forward all-reduces
the per-row max / rescaled sums and the gathered logits (each id lives on exactly one rank, the
others contribute 0), so every rank returns the same full-vocabulary values. The backward does no
communication: the loss built on the replicated outputs is identical on every rank, so each rank's
gradient for its own columns is exactly its local term above; nothing is summed over ranks and the
gradient is not multiplied by the tensor-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

DEFAULT_CHUNK_ROWS = 512   # rows per chunk: 512 x 151,936 x 4 B = 311 MB per fp32 buffer


def compute_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (the exact tests); every other dtype (bf16, fp16, fp32) computes in fp32."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[t, v] * b[t, v] without materializing the product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


class _ChunkedGather(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        ids: torch.Tensor,
        temperature: float,
        chunk_rows: int,
        group: Any,
        vocab_start: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, vocab_local = logits.shape
        cd = compute_dtype(logits.dtype)
        local = ids - vocab_start
        here = (ids >= 0) & (local >= 0) & (local < vocab_local)
        local_idx = torch.where(here, local, torch.zeros_like(local))

        z_ids = torch.zeros(ids.shape, dtype=cd, device=logits.device)
        row_max = torch.empty(rows, dtype=cd, device=logits.device)
        row_sum = torch.empty(rows, dtype=cd, device=logits.device)
        row_pz = torch.empty(rows, dtype=cd, device=logits.device)
        with torch.no_grad():
            for r0 in range(0, rows, chunk_rows):
                r1 = min(r0 + chunk_rows, rows)
                z = logits[r0:r1].to(cd, copy=True)                # chunk x V buffer 1
                if temperature != 1.0:
                    z.div_(temperature)
                mx = z.amax(dim=-1)
                e = torch.sub(z, mx.unsqueeze(1)).exp_()            # chunk x V buffer 2
                row_max[r0:r1] = mx
                row_sum[r0:r1] = e.sum(dim=-1)
                row_pz[r0:r1] = _row_dot(e, z)
                z_ids[r0:r1] = z.gather(1, local_idx[r0:r1])
                del z, e
            z_ids = torch.where(here, z_ids, torch.zeros_like(z_ids))
            if group is not None:
                glob_max = row_max.clone()
                dist.all_reduce(glob_max, op=dist.ReduceOp.MAX, group=group)
                scale = torch.exp(row_max - glob_max)
                sums = torch.stack([row_sum * scale, row_pz * scale])
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(z_ids, op=dist.ReduceOp.SUM, group=group)
                row_max, row_sum, row_pz = glob_max, sums[0], sums[1]
            lse = row_max + torch.log(row_sum)
            entropy = lse - row_pz / row_sum

        ctx.save_for_backward(logits, local_idx, here, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(entropy)
        return z_ids, lse, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_ids: torch.Tensor, g_lse: torch.Tensor, _g_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        logits, local_idx, here, lse = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        cd = lse.dtype
        g_ids = torch.where(here, g_ids.to(cd), torch.zeros((), dtype=cd, device=g_ids.device))
        g_lse = g_lse.to(cd)
        grad = torch.empty_like(logits)
        for r0 in range(0, logits.shape[0], chunk_rows):
            r1 = min(r0 + chunk_rows, logits.shape[0])
            # work in the gradient buffer itself when it has the compute dtype, else in one chunk x V buffer
            if grad.dtype == cd:
                gz = grad[r0:r1]
            else:
                gz = torch.empty((r1 - r0, grad.shape[1]), dtype=cd, device=grad.device)
            gz.copy_(logits[r0:r1])
            if temperature != 1.0:
                gz.div_(temperature)
            gz.sub_(lse[r0:r1].unsqueeze(1)).exp_().mul_(g_lse[r0:r1].unsqueeze(1))  # g_lse * p
            gz.scatter_add_(1, local_idx[r0:r1], g_ids[r0:r1])
            if temperature != 1.0:
                gz.div_(temperature)
            if grad.dtype != cd:
                grad[r0:r1] = gz
            del gz
        return grad, None, None, None, None, None


def gather_tempered_logits(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    group: Any = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z at ids [T, M], lse [T], entropy [T]) with z = logits / temperature, chunked over rows.

    `ids` [T, M] are full-vocabulary ids, -1 for padding (its gathered value is 0). With `group`,
    `logits` is the vocabulary shard starting at `vocab_start` (see the module docstring).
    """
    return _ChunkedGather.apply(logits, ids, float(temperature), int(chunk_rows), group, int(vocab_start))


def gather_tempered_logits_naive(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for `gather_tempered_logits`: the plain autograd version over the full [T, V] fp32 z."""
    cd = compute_dtype(logits.dtype)
    z = logits.to(cd) / temperature
    lse = torch.logsumexp(z, dim=-1)
    valid = ids >= 0
    z_ids = torch.where(valid, z.gather(1, ids.clamp(min=0)), torch.zeros((), dtype=cd, device=z.device))
    with torch.no_grad():
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return z_ids, lse, entropy
