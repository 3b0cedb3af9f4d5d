"""Roofline, memory fit, price, trainer and weight-sync model: hand-computed cases.

Every expected value below is written out from the model's architecture numbers and the
catalog's figures (not from the code under test), so a wrong byte or FLOP count fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.steptime.roofline import (
    Efficiency,
    FitError,
    expert_coverage,
    kv_bytes_per_token,
    replica_model,
    trainer_step_s,
    weight_sync_s,
)

CAT = load_catalog("modal")
QWEN = load_model_spec("qwen3.6-35b-a3b")
TINY = load_model_spec("tiny")
NO_OVERHEAD = Efficiency(decode_overhead_s=0.0, prefill_overhead_s=0.0)


# ---- the seed model's numbers, by hand (48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts
# with 8 active of width 896, vocab 151936, rope, untied embeddings)
Q_ATTN_PER_LAYER = 2048 * 128 * (32 + 32 + 4 + 4)          # q, o, k, v
Q_EXPERT = 3 * 2048 * 896                                   # gate, up, down
Q_ROUTER_PER_LAYER = 2048 * 128
Q_LM_HEAD = 151936 * 2048
Q_KV_ELEMS_PER_TOKEN = 2 * 48 * 4 * 128
Q_ACTIVE = 48 * (Q_ATTN_PER_LAYER + 8 * Q_EXPERT + Q_ROUTER_PER_LAYER) + Q_LM_HEAD


def test_decode_batch1_is_bandwidth_bound_and_equals_bytes_over_effective_bandwidth() -> None:
    # tiny (dense): 4 layers, hidden 256, 4 q / 2 kv heads of 64, SwiGLU 688, vocab 272; H100 BF16, BF16 KV
    r = replica_model(TINY, "H100", "bf16", "bf16", catalog=CAT, efficiency=NO_OVERHEAD)
    ctx = 100
    linear = 4 * (256 * 64 * (4 + 4 + 2 + 2) + 3 * 256 * 688)
    lm_head = 272 * 256
    emb_row = 256
    kv = (ctx + 1) * 2 * 4 * 2 * 64
    bytes_ = 2 * (linear + lm_head + emb_row + kv)
    assert bytes_ == 6_146_560
    eff_bw = 3.35e12 * 0.9
    flops = 2 * (linear + lm_head) + 4 * 4 * 4 * 64 * (ctx + 1)
    assert bytes_ / eff_bw > flops / (989e12 * 0.8)            # bandwidth-bound
    assert r.decode_step_s(1, ctx) == pytest.approx(bytes_ / eff_bw, rel=1e-12)
    # the catalog's per-step overhead adds on top
    r2 = replica_model(TINY, "H100", "bf16", "bf16", catalog=CAT)
    assert r2.decode_step_s(1, ctx) == pytest.approx(bytes_ / eff_bw + 0.004, rel=1e-12)
    assert r2.tokens_per_s(1, ctx) == pytest.approx(1 / (bytes_ / eff_bw + 0.004), rel=1e-12)


def test_moe_decode_bytes_count_only_the_experts_touched() -> None:
    r = replica_model(QWEN, "B200", "bf16", "bf16", catalog=CAT, efficiency=NO_OVERHEAD)
    static = 2 * (48 * (Q_ATTN_PER_LAYER + Q_ROUTER_PER_LAYER) + Q_LM_HEAD)
    for batch, experts in ((1, 8.0), (2, 15.5)):                # 128 * (1 - (120/128)^2) = 15.5
        expected = static + 2 * 48 * experts * Q_EXPERT + 2 * batch * 2048 + batch * 1 * Q_KV_ELEMS_PER_TOKEN * 2
        assert r.decode_bytes(batch, 0) == pytest.approx(expected, rel=1e-12)
    assert r.decode_step_s(1, 0) == pytest.approx(r.decode_bytes(1, 0) / (8.0e12 * 0.9), rel=1e-12)


def test_expert_coverage_formula() -> None:
    assert expert_coverage(128, 8, 0) == 0.0
    assert expert_coverage(128, 8, 1) == pytest.approx(8.0)
    assert expert_coverage(128, 8, 2) == pytest.approx(15.5)
    assert expert_coverage(4, 2, 3) == pytest.approx(4 * (1 - 0.5 ** 3))
    big = expert_coverage(128, 8, np.array([1, 10, 100, 10_000]))
    assert np.all(np.diff(big) > 0) and big[-1] == pytest.approx(128.0)


def test_large_batch_decode_is_compute_bound_and_equals_flops_over_effective_peak() -> None:
    r = replica_model(TINY, "CPU-2core", "fp32", "fp32", catalog=CAT, efficiency=NO_OVERHEAD)
    batch, ctx = 256, 10
    flops = batch * (2 * 2_969_600 + 4 * 4 * 4 * 64 * (ctx + 1))
    assert 2_969_600 == 4 * (256 * 64 * 12 + 3 * 256 * 688) + 272 * 256
    assert r.decode_flops(batch, ctx) == pytest.approx(flops, rel=1e-12)
    compute_s = flops / (0.2e12 * 0.8)
    assert compute_s > r.decode_bytes(batch, ctx) / (0.02e12 * 0.9)
    assert r.decode_step_s(batch, ctx) == pytest.approx(compute_s, rel=1e-12)


def test_prefill_is_compute_bound_with_causal_attention() -> None:
    r = replica_model(QWEN, "B200", "bf16", "bf16", catalog=CAT)
    n, before = 8192, 1000
    keys = n * before + n * (n + 1) / 2
    flops = 2 * Q_ACTIVE * n + 4 * 48 * 32 * 128 * keys
    assert r.prefill_s(n, before) == pytest.approx(flops / (2250e12 * 0.8) + 0.010, rel=1e-12)
    assert r.prefill_s(0, 5) == 0.0


def test_kv_capacity_by_hand_and_tp_fit() -> None:
    r = replica_model(QWEN, "H100", "fp8", "fp8_e4m3", catalog=CAT)
    assert r.tp == 1
    linear = 48 * (Q_ATTN_PER_LAYER + 128 * Q_EXPERT)
    keep = 2 * 151936 * 2048 + 48 * Q_ROUTER_PER_LAYER
    weights = linear * (8 + 0.002) / 8 + keep * 2
    usable = 80e9 * 0.90 - 2e9
    assert r.weight_bytes == pytest.approx(weights, rel=1e-12)
    assert r.kv_capacity_tokens == math.floor((usable - weights) / Q_KV_ELEMS_PER_TOKEN)
    # BF16 weights (~70.7 GB) do not fit next to 256K tokens of KV on one 80 GB GPU: TP 2
    bf16 = replica_model(QWEN, "H100", "bf16", "fp8_e4m3", catalog=CAT)
    assert 2 * (linear + keep) > usable and bf16.tp == 2
    assert bf16.price_usd_per_hour == pytest.approx(2 * 3.95)
    assert bf16.kv_capacity_tokens == math.floor((2 * usable - 2 * (linear + keep)) / Q_KV_ELEMS_PER_TOKEN)


def test_kv_heads_replicate_beyond_their_count() -> None:
    kv = CAT.kv_dtype("bf16")
    assert kv_bytes_per_token(QWEN, kv, 1) == Q_KV_ELEMS_PER_TOKEN * 2
    assert kv_bytes_per_token(QWEN, kv, 4) == Q_KV_ELEMS_PER_TOKEN * 2
    assert kv_bytes_per_token(QWEN, kv, 8) == 2 * Q_KV_ELEMS_PER_TOKEN * 2


def test_no_fit_error_gives_the_numbers() -> None:
    with pytest.raises(FitError) as e:
        replica_model(QWEN, "H100", "bf16", catalog=CAT, tp=1)
    msg = str(e.value)
    assert "70.7 GB" in msg and "70.0 GB usable per GPU" in msg and "tp" in msg
    with pytest.raises(FitError) as e:
        replica_model(QWEN, "CPU-2core", "fp32", "fp32", catalog=CAT)
    assert "CPU-2core" in str(e.value)
    with pytest.raises(FitError):
        replica_model(QWEN, "H100", "fp8", catalog=CAT, kv_budget_tokens=10**9)
    with pytest.raises(SpecError) as e:
        replica_model(QWEN, "H100", "fp8", catalog=CAT, tp=3)
    assert "'tp' = 3" in str(e.value)


def test_emulation_is_refused_unless_asked_and_then_slower() -> None:
    for acc, prec in (("H100", "nvfp4"), ("H200", "mxfp4"), ("A100-80GB", "fp8")):
        with pytest.raises(SpecError) as e:
            replica_model(QWEN, acc, prec, catalog=CAT)
        assert e.value.field == "emulated"
    with pytest.raises(SpecError) as e:
        replica_model(QWEN, "H100", "fp32", catalog=CAT, emulated=True)
    assert "bf16" in str(e.value)                              # lists what H100 can run
    emu = replica_model(QWEN, "H100", "nvfp4", catalog=CAT, emulated=True)
    plain = replica_model(QWEN, "H100", "nvfp4", catalog=CAT, emulated=True,
                          efficiency=Efficiency(emulation_slowdown=1.0))
    assert emu.emulated and emu.slowdown == 2.0
    assert emu.peak_flops_per_s == 989e12                      # runs on BF16 tensor cores
    b = np.array([1, 16, 64])
    assert np.allclose(emu.decode_step_s(b, 4096), 2.0 * plain.decode_step_s(b, 4096), rtol=1e-12)
    native = replica_model(QWEN, "B200", "nvfp4", catalog=CAT, emulated=True)  # native: flag only permits
    assert not native.emulated and native.slowdown == 1.0


def test_vectorized_matches_scalar_and_price_per_token() -> None:
    r = replica_model(QWEN, "H200", "fp8", catalog=CAT)
    batches = np.array([1, 4, 32, 128])
    ctxs = np.array([1000, 8000, 30000, 60000])
    vec = r.tokens_per_s(batches, ctxs)
    for i in range(4):
        assert vec[i] == pytest.approx(r.tokens_per_s(int(batches[i]), int(ctxs[i])), rel=1e-12)
    assert r.usd_per_mtoken(32, 8000) == pytest.approx(4.54 / 3600 / r.tokens_per_s(32, 8000) * 1e6, rel=1e-12)
    grid = r.tokens_per_s(batches[:, None], ctxs[None, :])
    assert grid.shape == (4, 4)
    assert r.max_batch(8192) == min(256, r.kv_capacity_tokens // 8192)
    best = r.best_operating_point(8192)
    assert 1 <= best["batch"] <= r.max_batch(8192)
    costs = r.usd_per_mtoken(np.arange(1, r.max_batch(8192) + 1), 8192)
    assert best["usd_per_mtoken"] == pytest.approx(costs.min())


def test_tp_adds_all_reduce_time_over_the_link() -> None:
    r = replica_model(QWEN, "H100", "bf16", "fp8_e4m3", catalog=CAT, efficiency=NO_OVERHEAD)
    assert r.tp == 2
    mem = r.decode_bytes(1, 0) / (2 * 3.35e12 * 0.9)
    comm = 2 * 48 * (2 * 1 / 2 * 1 * 2048 * 2 / 900e9 + 8e-6)
    assert r.decode_step_s(1, 0) == pytest.approx(mem + comm, rel=1e-12)


def test_cold_start_includes_loading_the_weight_shard() -> None:
    r = replica_model(QWEN, "H100", "bf16", catalog=CAT)
    assert r.cold_start_s == pytest.approx(20.0 + r.weight_bytes / 2 / 3e9)


def test_trainer_step_by_hand() -> None:
    b200 = CAT.accelerator("B200")
    t = trainer_step_s(QWEN, b200, 8, 1_000_000, mfu=0.5, overhead_s=1.0)
    assert t == pytest.approx(6 * Q_ACTIVE * 1e6 / (8 * 2250e12 * 0.5) + 1.0, rel=1e-12)
    default = trainer_step_s(QWEN, b200, 8, 1_000_000)
    assert default == pytest.approx(6 * Q_ACTIVE * 1e6 / (8 * 2250e12 * 0.25) + 2.0, rel=1e-12)
    calibrated = trainer_step_s(QWEN, b200, 8, 1_000_000, efficiency=Efficiency(trainer_mfu=0.5, trainer_overhead_s=1))
    assert calibrated == pytest.approx(t)
    with pytest.raises(SpecError):
        trainer_step_s(QWEN, b200, 0, 1000)


def test_weight_sync_is_transfer_plus_requantization() -> None:
    dst = replica_model(QWEN, "H100", "fp8", catalog=CAT)
    shard = QWEN.total_params * 2                               # BF16 from the trainer, tp = 1
    expected = shard / 12.5e9 + 2 * shard / (3.35e12 * 0.9)    # fp8: 2 passes
    assert weight_sync_s(dst, CAT.accelerator("B200")) == pytest.approx(expected, rel=1e-12)
    bf16 = replica_model(QWEN, "H100", "bf16", catalog=CAT)
    assert weight_sync_s(bf16, network_gb_s=50) == pytest.approx(shard / 2 / 50e9, rel=1e-12)


def test_efficiency_overrides_and_validation() -> None:
    base = replica_model(QWEN, "B200", "bf16", catalog=CAT, efficiency=NO_OVERHEAD)
    half = replica_model(QWEN, "B200", "bf16", catalog=CAT,
                         efficiency=Efficiency(eff_bw=0.45, decode_overhead_s=0.0))
    assert half.decode_step_s(1, 0) == pytest.approx(2 * base.decode_step_s(1, 0), rel=1e-12)
    for bad in (dict(eff_bw=0.0), dict(eff_flops=-1), dict(decode_overhead_s=-0.1), dict(emulation_slowdown=0.5),
                dict(trainer_mfu=1.5), dict(eff_bw="fast")):
        with pytest.raises(SpecError) as e:
            Efficiency(**bad)
        assert e.value.field == next(iter(bad))
