"""The vocabulary-parallel loss on 2 gloo processes (CPU, 127.0.0.1) equals the single-process loss:
same loss and metrics on both ranks, and each rank's gradient is exactly its slice of the
single-process gradient (not multiplied by the tensor-parallel size). Shards are uneven on purpose.
The fused variant (output-layer weight sharded along the vocabulary) likewise: each rank's weight
gradient is its rows of the single-process one, and both ranks get the full hidden-state gradient.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mixfleet.runner.corrections import CorrectionConfig, policy_loss, policy_loss_from_hidden
from mixfleet.runner.corrections.vocab_parallel import (
    vocab_parallel_policy_loss,
    vocab_parallel_policy_loss_from_hidden,
)
from test_corrections_chunked import random_batch, without_kept

T, VOCAB, SPLIT, HIDDEN = 40, 37, 20, 6  # rank 0 holds ids [0, 20), rank 1 ids [20, 37)
CASES = {
    "sc_mis_topk": (CorrectionConfig(method="sc_mis", temperature=0.8, chunk_size=7), False),
    "sc_tis_replay": (CorrectionConfig(method="sc_tis", temperature=1.3, chunk_size=16, top_p_replay=True), True),
    "grpo": (CorrectionConfig(method="grpo", chunk_size=64), False),
}


def inputs(replay: bool):
    logits = torch.randn(T, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    batch = random_batch(T, VOCAB, k=5, kept=6, seed=4)
    return logits, (batch if replay else without_kept(batch))


def hidden_inputs():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(T, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64))


def worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results = {}
        for name, (cfg, replay) in CASES.items():
            logits, batch = inputs(replay)
            lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, VOCAB)
            shard = logits[:, lo:hi].clone().requires_grad_(True)
            loss, metrics = vocab_parallel_policy_loss(shard, batch, cfg, group=None, vocab_start=lo)
            loss.backward()
            results[name] = (loss.detach(), shard.grad, metrics)
            h, w = hidden_inputs()
            h = h.requires_grad_(True)
            w_shard = w[lo:hi].clone().requires_grad_(True)
            loss, metrics = vocab_parallel_policy_loss_from_hidden(h, w_shard, batch, cfg, group=None, vocab_start=lo)
            loss.backward()
            results["fused_" + name] = (loss.detach(), (h.grad, w_shard.grad), metrics)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_rank_vocab_parallel_matches_single_process(tmp_path: Path) -> None:
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, (cfg, replay) in CASES.items():
        logits, batch = inputs(replay)
        x = logits.clone().requires_grad_(True)
        loss, metrics = policy_loss(x, batch, cfg)
        loss.backward()
        assert x.grad.abs().max() > 1e-3
        for rank, (lo, hi) in enumerate([(0, SPLIT), (SPLIT, VOCAB)]):
            r_loss, r_grad, r_metrics = ranks[rank][name]
            torch.testing.assert_close(r_loss, loss.detach(), rtol=0, atol=1e-13)
            torch.testing.assert_close(r_grad, x.grad[:, lo:hi], rtol=0, atol=1e-13)
            assert r_metrics.keys() == metrics.keys()
            for key in metrics:
                assert abs(r_metrics[key] - metrics[key]) <= 1e-11 * max(1.0, abs(metrics[key])), (name, key)
        h, w = (x.clone().requires_grad_(True) for x in hidden_inputs())
        loss, metrics = policy_loss_from_hidden(h, w, batch, cfg)
        loss.backward()
        assert h.grad.abs().max() > 1e-3 and w.grad.abs().max() > 1e-3
        for rank, (lo, hi) in enumerate([(0, SPLIT), (SPLIT, VOCAB)]):
            r_loss, (r_grad_h, r_grad_w), r_metrics = ranks[rank]["fused_" + name]
            torch.testing.assert_close(r_loss, loss.detach(), rtol=0, atol=1e-12)
            torch.testing.assert_close(r_grad_h, h.grad, rtol=0, atol=1e-12)
            torch.testing.assert_close(r_grad_w, w.grad[lo:hi], rtol=0, atol=1e-12)
            assert r_metrics.keys() == metrics.keys()
            for key in metrics:
                assert abs(r_metrics[key] - metrics[key]) <= 1e-11 * max(1.0, abs(metrics[key])), ("fused", name, key)
