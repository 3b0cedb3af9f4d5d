"""The fused output-layer loss `policy_loss_from_hidden(hidden, weight, ...)` equals the naive
`policy_loss(hidden @ weight.T, ...)`: loss, every metric, and the gradients to hidden and weight, for
every method with and without top-p replay (float64: to 1e-12; bf16 and fp32: to their rounding), and
it never creates a [T, V] tensor of any dtype (the naive one does)."""

from __future__ import annotations

import pytest
import torch
from mixfleet.costmodel.errors import SpecError
from mixfleet.runner.corrections import METHODS, CorrectionBatch, CorrectionConfig, chunked, policy_loss_from_hidden
from test_corrections_chunked import random_batch, without_kept
from torch.utils._python_dispatch import TorchDispatchMode

F64 = torch.float64


def output_layer(t: int, hidden: int, vocab: int, seed: int, dtype: torch.dtype = F64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hidden, generator=g, dtype=F64)
    w = torch.randn(vocab, hidden, generator=g, dtype=F64) * (3.0 / hidden**0.5)   # logits of scale ~3
    return h.to(dtype), w.to(dtype)


def run(h: torch.Tensor, w: torch.Tensor, batch: CorrectionBatch, cfg: CorrectionConfig):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, metrics = policy_loss_from_hidden(h, w, batch, cfg)
    g_h, g_w = torch.autograd.grad(loss, (h, w))
    return loss, g_h, g_w, metrics


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_fused_matches_naive_float64(method: str, replay: bool) -> None:
    t, hid, vocab = 45, 12, 37
    h, w = output_layer(t, hid, vocab, seed=1)
    batch = random_batch(t, vocab, k=5, kept=6, seed=2)
    if not replay:
        batch = without_kept(batch)
    base = dict(method=method, temperature=0.8, top_p_replay=replay)
    naive = run(h, w, batch, CorrectionConfig(**base, implementation="naive"))
    fused = run(h, w, batch, CorrectionConfig(**base, chunk_size=8))
    torch.testing.assert_close(fused[0], naive[0], rtol=0, atol=1e-12)
    for i in (1, 2):
        assert naive[i].abs().max() > 1e-3
        torch.testing.assert_close(fused[i], naive[i], rtol=0, atol=1e-12)
    assert fused[3].keys() == naive[3].keys()
    for key in naive[3]:
        assert fused[3][key] == pytest.approx(naive[3][key], rel=1e-11, abs=1e-11), key
    if replay:
        assert naive[3]["fallback_rows"] > 0 and naive[3]["kept_size"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("replay", [False, True])
def test_fused_matches_naive_low_precision(dtype: torch.dtype, replay: bool, monkeypatch) -> None:
    """bf16 / fp32 inputs: both compute the logits in the input dtype, the loss in fp32; gradients come
    back in the input dtype and agree to its rounding (the fused weight gradient is summed in fp32, the
    bf16 products in blocks of vocabulary rows: 3 blocks here)."""
    monkeypatch.setattr(chunked, "_WGRAD_BLOCK_ROWS", 128)
    t, hid, vocab = 96, 32, 300
    h, w = output_layer(t, hid, vocab, seed=4, dtype=dtype)
    batch = random_batch(t, vocab, k=8, kept=5, seed=5, dtype=torch.float32)
    if not replay:
        batch = without_kept(batch)
    base = dict(method="sc_mis", temperature=0.7, top_p_replay=replay)
    naive = run(h, w, batch, CorrectionConfig(**base, implementation="naive"))
    fused = run(h, w, batch, CorrectionConfig(**base, chunk_size=16))
    assert fused[0].dtype == torch.float32 and fused[1].dtype == dtype and fused[2].dtype == dtype
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], naive[0], rtol=1e-5, atol=1e-6)
    for i in (1, 2):
        scale = naive[i].float().abs().max()
        assert scale > 1e-3
        err = (fused[i].float() - naive[i].float()).abs().max() / scale
        assert err <= (4e-3 if bf16 else 1e-6), (i, float(err))   # within one bf16 ulp (2^-8) of the top value
    for key in naive[3]:
        assert fused[3][key] == pytest.approx(naive[3][key], rel=1e-4, abs=1e-5), key


def test_fused_without_weight_gradient() -> None:
    """A frozen output layer: only the hidden states get a gradient (and it is the same one)."""
    t, hid, vocab = 40, 8, 50
    h, w = output_layer(t, hid, vocab, seed=6)
    batch = without_kept(random_batch(t, vocab, k=4, kept=3, seed=7))
    cfg = CorrectionConfig(method="sc_tis", chunk_size=16)
    hx = h.clone().requires_grad_(True)
    loss, _ = policy_loss_from_hidden(hx, w, batch, cfg)
    (g_h,) = torch.autograd.grad(loss, hx)
    torch.testing.assert_close(g_h, run(h, w, batch, cfg)[1], rtol=0, atol=1e-14)


class LargestTensor(TorchDispatchMode):
    """Records the largest floating-point tensor (any dtype) any aten op returns, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and o.dtype.is_floating_point:
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("t", [256, 1024])
def test_fused_never_builds_t_by_v(t: int) -> None:
    """No tensor of any float dtype larger than chunk x V (or an input's size) exists in the fused loss,
    whatever T; the naive loss builds [T, V] ones."""
    hid, vocab, chunk = 8, 512, 32
    h, w = output_layer(t, hid, vocab, seed=0, dtype=torch.bfloat16)
    batch = without_kept(random_batch(t, vocab, k=8, kept=4, seed=1, dtype=torch.float32))
    sizes = {}
    for impl in ("naive", "chunked"):
        hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with LargestTensor() as mode:
            cfg = CorrectionConfig(method="sc_mis", chunk_size=chunk, implementation=impl)
            loss, _ = policy_loss_from_hidden(hx, wx, batch, cfg)
            loss.backward()
        sizes[impl] = mode.largest
        assert hx.grad.dtype == torch.bfloat16 and wx.grad.dtype == torch.bfloat16
    assert sizes["naive"] >= t * vocab
    # beside chunk x V: the weight, the hidden states and the [T, 1 + K] gathered logits
    assert sizes["chunked"] <= max(chunk * vocab, vocab * hid, t * hid, t * (1 + 8))


def test_fused_refusals() -> None:
    t, hid, vocab = 10, 4, 20
    h, w = output_layer(t, hid, vocab, seed=0)
    batch = without_kept(random_batch(t, vocab, k=3, kept=2, seed=0))
    cfg = CorrectionConfig(method="sc_mis")
    with pytest.raises(SpecError, match="hidden.*shape \\(10, H\\)"):
        policy_loss_from_hidden(h[:9], w, batch, cfg)
    with pytest.raises(SpecError, match="weight.*shape \\(V, 4\\)"):
        policy_loss_from_hidden(h, w[:, :3], batch, cfg)
    with pytest.raises(SpecError, match="weight.*dtype of hidden"):
        policy_loss_from_hidden(h, w.float(), batch, cfg)
    with pytest.raises(SpecError, match="labels.*vocabulary size 15"):
        policy_loss_from_hidden(h, w[:15], CorrectionBatch(**{**batch.__dict__, "labels": batch.labels * 0 + 17,
                                                              "topk_ids": batch.topk_ids % 15}), cfg)
