"""Check 5: the chunked loss equals the naive one (values, gradients, metrics) and its working memory
does not grow with T x V; plus the config / batch refusals and the GRPO advantages."""

from __future__ import annotations

import pytest
import torch
from mixfleet.costmodel.errors import SpecError
from mixfleet.runner.corrections import (
    METHODS,
    CorrectionBatch,
    CorrectionConfig,
    grpo_advantages,
    policy_loss,
)
from torch.utils._python_dispatch import TorchDispatchMode

F64 = torch.float64


def random_batch(t: int, vocab: int, k: int, kept: int, seed: int, dtype: torch.dtype = F64) -> CorrectionBatch:
    """Unrelated sampler records: top-K heads, kept sets with padding, fallback rows, masked rows, groups."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(t, vocab, generator=g, dtype=F64) * 2, dim=1)
    labels = torch.multinomial(q, 1, generator=g).squeeze(1)
    top_lp, top_ids = torch.log(q).topk(k, dim=1)
    kept_ids = torch.argsort(q, dim=1, descending=True)[:, :kept].clone()
    kept_ids[:, -1] = labels
    kept_ids[kept_ids[:, -1] == kept_ids[:, 0], -1] = -1
    kept_ids[::7] = -1                       # empty kept sets: fallback rows
    kept_ids[3::11, -1] = -1                 # label not kept: fallback rows
    neg_inf = torch.full((), -torch.inf, dtype=F64)
    zk = torch.where(kept_ids >= 0, torch.log(q).gather(1, kept_ids.clamp(min=0)), neg_inf)
    kept_lp = zk - torch.logsumexp(zk.clamp(min=-1e30), dim=1, keepdim=True)
    kept_lp = torch.where(kept_ids >= 0, kept_lp, neg_inf)
    return CorrectionBatch(
        labels=labels, advantages=torch.randn(t, generator=g, dtype=F64).to(dtype),
        loss_mask=torch.rand(t, generator=g) > 0.2, sampler_logprobs=torch.log(q).gather(1, labels[:, None]).squeeze(1),
        topk_ids=top_ids, topk_logprobs=top_lp, kept_ids=kept_ids, kept_logprobs=kept_lp,
        group_ids=torch.randint(0, 3, (t,), generator=g),
    )


def run(logits: torch.Tensor, batch: CorrectionBatch, cfg: CorrectionConfig):
    x = logits.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, batch, cfg)
    (grad,) = torch.autograd.grad(loss, x)
    return loss, grad, metrics


def without_kept(batch: CorrectionBatch) -> CorrectionBatch:
    return CorrectionBatch(**{**batch.__dict__, "kept_ids": None, "kept_logprobs": None})


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_chunked_matches_naive_float64(method: str, replay: bool) -> None:
    t, vocab = 45, 37
    logits = torch.randn(t, vocab, generator=torch.Generator().manual_seed(1), dtype=F64) * 3
    batch = random_batch(t, vocab, k=5, kept=6, seed=2)
    if not replay:
        batch = without_kept(batch)
    naive = run(logits, batch, CorrectionConfig(method=method, temperature=0.8, implementation="naive",
                                                top_p_replay=replay))
    chunked = run(logits, batch, CorrectionConfig(method=method, temperature=0.8, chunk_size=8,
                                                  top_p_replay=replay))
    torch.testing.assert_close(chunked[0], naive[0], rtol=0, atol=1e-13)
    torch.testing.assert_close(chunked[1], naive[1], rtol=0, atol=1e-13)
    assert naive[1].abs().max() > 1e-3
    assert chunked[2].keys() == naive[2].keys()
    for key in naive[2]:
        assert chunked[2][key] == pytest.approx(naive[2][key], rel=1e-12, abs=1e-12), key
    if replay:
        assert naive[2]["fallback_rows"] > 0 and naive[2]["kept_size"] > 0


def test_chunked_matches_naive_bf16_logits() -> None:
    """bf16 logits from the trainer: both compute in fp32 per chunk; the gradient comes back in bf16."""
    t, vocab = 64, 300
    logits = (torch.randn(t, vocab, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    batch = without_kept(random_batch(t, vocab, k=8, kept=4, seed=5))
    naive = run(logits, batch, CorrectionConfig(method="sc_mis", implementation="naive"))
    chunked = run(logits, batch, CorrectionConfig(method="sc_mis", chunk_size=16))
    assert chunked[1].dtype == torch.bfloat16 and chunked[0].dtype == torch.float32
    torch.testing.assert_close(chunked[0], naive[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked[1].float(), naive[1].float(), rtol=1e-2, atol=1e-5)


class LargestFloatTensor(TorchDispatchMode):
    """Records the largest float32/float64 tensor any aten op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and o.dtype in (torch.float32, torch.float64):
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("t", [256, 1024])
def test_chunked_working_memory_is_bounded(t: int) -> None:
    """With bf16 logits, no fp32 tensor larger than chunk x V is ever created by the chunked loss (the
    naive loss creates [T, V] ones), whatever T."""
    vocab, chunk = 512, 32
    logits = torch.randn(t, vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    batch = without_kept(random_batch(t, vocab, k=8, kept=4, seed=1, dtype=torch.float32))
    sizes = {}
    for impl in ("naive", "chunked"):
        x = logits.clone().requires_grad_(True)
        with LargestFloatTensor() as mode:
            loss, _ = policy_loss(x, batch, CorrectionConfig(method="sc_mis", chunk_size=chunk, implementation=impl))
            loss.backward()
        sizes[impl] = mode.largest
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert sizes["naive"] >= t * vocab
    assert sizes["chunked"] <= chunk * vocab


def test_config_refusals() -> None:
    with pytest.raises(SpecError, match="ppo_clip_eps.*REINFORCE"):
        CorrectionConfig(method="sc_mis", ppo_clip_eps=0.2)
    with pytest.raises(SpecError, match="weight_level.*per-token weights"):
        CorrectionConfig(method="sc", weight_level="sequence")
    with pytest.raises(SpecError, match="weight_level.*no weights"):
        CorrectionConfig(method="grpo", weight_level="sequence")
    with pytest.raises(SpecError, match="method.*'sc_mis'"):
        CorrectionConfig(method="scmis")
    with pytest.raises(SpecError, match="band"):
        CorrectionConfig(band=(1.2, 2.0))
    with pytest.raises(SpecError, match="tis_cap"):
        CorrectionConfig(tis_cap=0.5)
    with pytest.raises(SpecError, match="temperature"):
        CorrectionConfig(temperature=0.0)
    with pytest.raises(SpecError, match="chunk_size"):
        CorrectionConfig(chunk_size=0)
    with pytest.raises(SpecError, match="nonsense"):
        CorrectionConfig.from_mapping({"method": "mis", "nonsense": 1})
    cfg = CorrectionConfig.from_mapping({"method": "mis", "band": [0.25, 4.0], "ppo_clip_eps": 0.2})
    assert cfg.band == (0.25, 4.0) and cfg.weight_kind == "mis" and not cfg.centered
    with pytest.raises(Exception, match="frozen|cannot assign"):
        cfg.method = "sc"  # type: ignore[misc]


def test_batch_refusals() -> None:
    batch = random_batch(10, 20, k=3, kept=4, seed=0)
    logits = torch.zeros(10, 20, dtype=F64)
    with pytest.raises(SpecError, match="topk_ids"):
        no_head = CorrectionBatch(**{**batch.__dict__, "topk_ids": None, "topk_logprobs": None})
        policy_loss(logits, without_kept(no_head), CorrectionConfig(method="sc"))
    with pytest.raises(SpecError, match="top_p_replay"):
        policy_loss(logits, batch, CorrectionConfig(method="sc"))
    with pytest.raises(SpecError, match="kept_ids"):
        policy_loss(logits, without_kept(batch), CorrectionConfig(method="sc", top_p_replay=True))
    with pytest.raises(SpecError, match="labels.*vocabulary size 20"):
        bad = CorrectionBatch(**{**without_kept(batch).__dict__, "labels": batch.labels + 20,
                                 "loss_mask": torch.ones(10, dtype=torch.bool)})
        policy_loss(logits, bad, CorrectionConfig(method="grpo"))
    with pytest.raises(SpecError, match="logits"):
        policy_loss(torch.zeros(9, 20), batch, CorrectionConfig(method="grpo"))
    with pytest.raises(SpecError, match="advantages"):
        CorrectionBatch(**{**batch.__dict__, "advantages": torch.zeros(11)})
    with pytest.raises(SpecError, match="topk_logprobs"):
        CorrectionBatch(**{**batch.__dict__, "topk_logprobs": None})
    with pytest.raises(SpecError, match="kept_ids.*at most 512"):
        CorrectionBatch(**{**batch.__dict__, "kept_ids": torch.zeros(10, 513, dtype=torch.int64),
                           "kept_logprobs": torch.zeros(10, 513)})
    with pytest.raises(SpecError, match="sequence_ids"):
        policy_loss(logits, without_kept(batch), CorrectionConfig(method="mis", weight_level="sequence"))


def test_grpo_advantages() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 2.0, 0.0, 1.0], dtype=F64)
    prompts = torch.tensor([7, 7, 3, 3, 9, 4, 4, 4])
    adv = grpo_advantages(rewards, prompts)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0], dtype=F64))
    eps = 1e-6
    norm = grpo_advantages(rewards, prompts, normalize_std=True, eps=eps)
    std7, std4 = 2**-0.5, 1.0  # unbiased std of [1, 0] and of [2, 0, 1]
    expected = torch.tensor([0.5 / (std7 + eps), -0.5 / (std7 + eps), 0.0, 0.0, 0.0, 1 / (std4 + eps),
                             -1 / (std4 + eps), 0.0], dtype=F64)
    torch.testing.assert_close(norm, expected, rtol=0, atol=1e-15)
    with pytest.raises(SpecError, match="prompt_ids"):
        grpo_advantages(rewards, prompts[:3])
