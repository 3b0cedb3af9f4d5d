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

`fused_gather_tempered_logits(hidden, weight, ...)` is the same with the output layer fused in:
logits = hidden @ weight.T exist one chunk of rows at a time (in the inputs' dtype, as the matrix
product rounds them, then fp32), in the forward and again in the backward, which turns each chunk's
logits gradient into its rows of d hidden = g @ weight and its term of d weight += g.T @ hidden
(summed in the compute dtype over the chunks, rounded to the weight's dtype once). Neither [T, V]
logits nor their gradient exist; the working memory is at most two fp32 chunk x V buffers and one
in the inputs' dtype, plus the fp32 V x H weight-gradient sum when the weight is not fp32.

Vocabulary parallelism: when `group` is a torch.distributed process group, `logits` is this rank's
shard of the vocabulary, columns [vocab_start, vocab_start + V_local). The forward all-reduces
the per-row max / rescaled sums and the gathered logits (each id lives on exactly one rank, the
others contribute 0), so every rank returns the same full-vocabulary values. The backward does no
communication: the loss built on the replicated outputs is identical on every rank, so each rank's
gradient for its own columns is exactly its local term above; nothing is summed over ranks and the
gradient is not multiplied by the tensor-parallel size. The fused kernel's hidden states feed every
shard, so their gradient is the sum over ranks: the one all-reduce of its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_CHUNK_ROWS = 512   # rows per chunk: 512 x 151,936 x 4 B = 311 MB per fp32 buffer
_WGRAD_BLOCK_ROWS = 8192   # vocabulary rows per low-precision weight-gradient product (8192 x H temporary)


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
        local_idx, here = _local_ids(ids, vocab_start, vocab_local)
        with torch.no_grad():
            z_ids, lse, entropy = _forward_rows(
                lambda r0, r1: logits[r0:r1], False, rows, compute_dtype(logits.dtype), local_idx, here,
                temperature, chunk_rows, group, logits.device,
            )
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
        g_ids, g_lse = _row_grads(g_ids, g_lse, here, cd)
        grad = torch.empty_like(logits)
        for r0 in range(0, logits.shape[0], chunk_rows):
            r1 = min(r0 + chunk_rows, logits.shape[0])
            # work in the gradient buffer itself when it has the compute dtype, else in one chunk x V buffer
            if grad.dtype == cd:
                gz = grad[r0:r1]
            else:
                gz = torch.empty((r1 - r0, grad.shape[1]), dtype=cd, device=grad.device)
            gz.copy_(logits[r0:r1])
            _logits_grad_(gz, lse[r0:r1], g_lse[r0:r1], local_idx[r0:r1], g_ids[r0:r1], temperature)
            if grad.dtype != cd:
                grad[r0:r1] = gz
            del gz
        return grad, None, None, None, None, None


class _FusedGather(torch.autograd.Function):
    """`_ChunkedGather` of logits = hidden @ weight.T, computed chunk by chunk and never kept."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        ids: torch.Tensor,
        temperature: float,
        chunk_rows: int,
        group: Any,
        vocab_start: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, vocab_local = hidden.shape[0], weight.shape[0]
        local_idx, here = _local_ids(ids, vocab_start, vocab_local)
        with torch.no_grad():
            # the chunk's logits in the input dtype (as `hidden @ weight.T` rounds them), then fp32
            z_ids, lse, entropy = _forward_rows(
                lambda r0, r1: hidden[r0:r1] @ weight.T, True, rows, compute_dtype(hidden.dtype), local_idx, here,
                temperature, chunk_rows, group, hidden.device,
            )
        ctx.save_for_backward(hidden, weight, local_idx, here, lse)
        ctx.temperature, ctx.chunk_rows, ctx.group = temperature, chunk_rows, group
        ctx.mark_non_differentiable(entropy)
        return z_ids, lse, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_ids: torch.Tensor, g_lse: torch.Tensor, _g_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local_idx, here, lse = ctx.saved_tensors
        temperature, chunk_rows, group = ctx.temperature, ctx.chunk_rows, ctx.group
        cd = lse.dtype
        g_ids, g_lse = _row_grads(g_ids, g_lse, here, cd)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # the weight gradient is accumulated over chunks in the compute dtype and rounded once at the end
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None
        for r0 in range(0, hidden.shape[0], chunk_rows):
            r1 = min(r0 + chunk_rows, hidden.shape[0])
            h = hidden[r0:r1]
            gz = h @ weight.T                                           # recomputed chunk logits
            if gz.dtype != cd:
                gz = gz.to(cd)
            _logits_grad_(gz, lse[r0:r1], g_lse[r0:r1], local_idx[r0:r1], g_ids[r0:r1], temperature)
            g = gz if gz.dtype == hidden.dtype else gz.to(hidden.dtype)   # d loss / d logits, as autograd has it
            del gz
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[r0:r1])
            if grad_w is not None:
                if g.dtype == cd:
                    grad_w.addmm_(g.T, h)
                else:  # the low-precision product in blocks of vocabulary rows: no V x H temporary
                    for v0 in range(0, grad_w.shape[0], _WGRAD_BLOCK_ROWS):
                        v1 = min(v0 + _WGRAD_BLOCK_ROWS, grad_w.shape[0])
                        grad_w[v0:v1] += g[:, v0:v1].T @ h
            del g
        if grad_h is not None and group is not None:
            # hidden is replicated over the vocabulary shards: its gradient is the sum of every shard's part
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=group)
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _local_ids(ids: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each id in this shard (0 where it is not here) and whether it is here (-1 pads never are)."""
    local = ids - vocab_start
    here = (ids >= 0) & (local >= 0) & (local < vocab_local)
    return torch.where(here, local, torch.zeros_like(local)), here


def _forward_rows(
    chunk: Callable[[int, int], torch.Tensor], fresh: bool, rows: int, cd: torch.dtype, local_idx: torch.Tensor,
    here: torch.Tensor, temperature: float, chunk_rows: int, group: Any, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of both kernels: (z at ids, lse, entropy), walking `chunk(r0, r1)` (the logits of rows
    [r0, r1), in any dtype; `fresh`: a new tensor this function may overwrite when it has the dtype `cd`)."""
    z_ids = torch.zeros(local_idx.shape, dtype=cd, device=device)
    row_max = torch.empty(rows, dtype=cd, device=device)
    row_sum = torch.empty(rows, dtype=cd, device=device)
    row_pz = torch.empty(rows, dtype=cd, device=device)
    for r0 in range(0, rows, chunk_rows):
        r1 = min(r0 + chunk_rows, rows)
        src = chunk(r0, r1)
        z = src if fresh and src.dtype == cd else src.to(cd, copy=True)   # chunk x V buffer 1
        del src
        if temperature != 1.0:
            z.div_(temperature)
        mx = z.amax(dim=-1)
        e = torch.sub(z, mx.unsqueeze(1)).exp_()                           # chunk x V buffer 2
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
    return z_ids, lse, entropy


def _row_grads(
    g_ids: torch.Tensor, g_lse: torch.Tensor, here: torch.Tensor, cd: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The incoming gradients in the compute dtype; ids that live on another shard contribute nothing here."""
    g_ids = torch.where(here, g_ids.to(cd), torch.zeros((), dtype=cd, device=g_ids.device))
    return g_ids, g_lse.to(cd)


def _logits_grad_(
    gz: torch.Tensor, lse: torch.Tensor, g_lse: torch.Tensor, local_idx: torch.Tensor, g_ids: torch.Tensor,
    temperature: float,
) -> None:
    """In place: a chunk's raw logits -> d loss / d logits = (g_lse p + scatter of g_ids) / temperature."""
    if temperature != 1.0:
        gz.div_(temperature)
    gz.sub_(lse.unsqueeze(1)).exp_().mul_(g_lse.unsqueeze(1))   # g_lse * p
    gz.scatter_add_(1, local_idx, g_ids)
    if temperature != 1.0:
        gz.div_(temperature)


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


def fused_gather_tempered_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    group: Any = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gather_tempered_logits(hidden @ weight.T, ...)` without the [T, V] logits or their gradient.

    `hidden` [T, H] and `weight` [V, H] (the output layer; with `group`, this rank's vocabulary shard
    of V_local rows starting at `vocab_start`), same float dtype. Chunk by chunk of rows the logits
    are computed in that dtype, reduced as in `gather_tempered_logits`, dropped, and recomputed in
    the backward pass, which returns the gradients of `hidden` (all-reduced over `group`: every
    shard contributes) and of `weight` (accumulated over the chunks in the compute dtype).
    """
    return _FusedGather.apply(hidden, weight, ids, float(temperature), int(chunk_rows), group, int(vocab_start))


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
