"""The measured backend (aiconfigurator-core's profiled tables behind costmodel/steptime/measured.py) and replica
layouts.

Kept to a few seconds: one model is compiled (Qwen3-30B-A3B BF16 on H200, SGLang), the rest are the static
support checks and the roofline's layout arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.steptime.measured import Layout, NotCovered, coverage, installed_version
from mixfleet.costmodel.steptime.roofline import FitError, replica_model, weight_bytes

pytestmark = pytest.mark.skipif(installed_version() is None, reason="aiconfigurator-core not installed")


def test_layout_labels_round_trip_and_bad_labels_are_refused() -> None:
    for lay in (Layout(tp=4), Layout(tp=4, ep=4), Layout(tp=1, dp_attention=8, ep=8),
                Layout(tp=2, dp_attention=2, ep=4)):
        assert Layout.parse(lay.label) == lay
    assert Layout.parse("DEP4").gpus == 4 and Layout.parse("dep4").moe_tp == 1
    with pytest.raises(SpecError, match="DEP<n>"):
        Layout.parse("PP2")
    with pytest.raises(SpecError, match="divisor"):
        Layout(tp=2, dp_attention=1, ep=4)


def test_static_coverage_names_what_is_missing() -> None:
    cat = load_catalog()
    seed = load_model_spec("qwen3.6-35b-a3b")
    qwen = load_model_spec("qwen3-30b-a3b")
    one = Layout(tp=1)
    with pytest.raises(NotCovered, match="hf_id"):
        coverage(seed, cat.accelerator("H200"), cat.precision("fp8"), cat.kv_dtype("fp8_e4m3"), layout=one)
    with pytest.raises(NotCovered, match="accelerator"):
        coverage(qwen, cat.accelerator("CPU-2core"), cat.precision("bf16"), cat.kv_dtype("bf16"), layout=one)
    with pytest.raises(NotCovered, match="emulated"):
        coverage(qwen, cat.accelerator("H100"), cat.precision("nvfp4"), cat.kv_dtype("bf16"), layout=one,
                 emulated=True)
    with pytest.raises(NotCovered, match="kv_dtype"):
        coverage(qwen, cat.accelerator("H100"), cat.precision("bf16"), cat.kv_dtype("fp32"), layout=one)
    with pytest.raises(SpecError, match="engine"):
        coverage(qwen, cat.accelerator("H100"), cat.precision("bf16"), cat.kv_dtype("bf16"), layout=one,
                 engine="tgi")


def test_measured_backend_prices_a_covered_replica_from_the_database() -> None:
    from aiconfigurator_core.sdk.engine import EngineHandle

    rm = replica_model("qwen3-30b-a3b", "H200", "bf16", "bf16", backend="auto", kv_budget_tokens=8192)
    assert rm.backend == "aiconfigurator" and "h200_sxm" in rm.backend_source and "sglang" in rm.backend_source
    # at grid points the table is aiconfigurator's own number, read independently here
    h = EngineHandle.compile("Qwen/Qwen3-30B-A3B", "h200_sxm", "sglang", tp_size=1, moe_tp_size=1, moe_ep_size=1,
                             gemm_quant_mode="bfloat16", moe_quant_mode="bfloat16", kvcache_quant_mode="bfloat16",
                             fmha_quant_mode="bfloat16")
    for b, c in ((1, 1024), (64, 4096), (256, 1024)):
        assert rm.decode_step_s(b, c) == pytest.approx(h.predict_decode_latency(b, c, 2) / 1e3, rel=1e-9)
    assert rm.prefill_s(1024, 0) == pytest.approx(h.predict_prefill_latency(1, 1024, 0) / 1e3, rel=1e-9)
    # between grid points: interpolated, never cheaper per step with a larger batch; arrays broadcast
    steps = np.asarray(rm.decode_step_s(np.arange(1, 300), 3000.0))
    assert np.all(np.diff(steps) >= -1e-12) and steps.shape == (299,)
    assert rm.prefill_s(0, 0) == 0.0
    # the roofline default is untouched and says so
    roof = replica_model("qwen3-30b-a3b", "H200", "bf16", "bf16", kv_budget_tokens=8192)
    assert roof.backend == "roofline" and roof.measured is None and roof.key[-1] is False


def test_asking_for_the_measured_backend_where_it_does_not_reach_is_refused_with_the_reason() -> None:
    with pytest.raises(NotCovered, match="hf_id"):
        replica_model("qwen3.6-35b-a3b", "H200", "fp8", backend="aiconfigurator")
    rm = replica_model("qwen3.6-35b-a3b", "H200", "fp8", backend="auto")
    assert rm.backend == "roofline" and "not covered" in rm.backend_source
    with pytest.raises(SpecError, match="backend"):
        replica_model("qwen3.6-35b-a3b", "H200", "fp8", backend="magic")


def test_layouts_expert_parallel_copies_attention_per_dp_group_and_cheapest_beats_smallest() -> None:
    cat = load_catalog()
    m = load_model_spec("qwen3-235b-a22b")
    fp8 = cat.precision("fp8")
    assert weight_bytes(m, fp8, 4) > weight_bytes(m, fp8, 1)
    tp4 = replica_model(m, "H200", "fp8", tp=4, kv_budget_tokens=40960)
    same = replica_model(m, "H200", "fp8", layout=Layout(tp=4), kv_budget_tokens=40960)
    assert same.decode_step_s(64, 4096) == tp4.decode_step_s(64, 4096) and same.key == tp4.key
    dep = replica_model(m, "H200", "fp8", layout=Layout.parse("DEP4"), kv_budget_tokens=40960)
    assert dep.n_gpus == 4 and dep.price_usd_per_hour == tp4.price_usd_per_hour
    assert dep.kv_capacity_tokens < tp4.kv_capacity_tokens  # four copies of the attention weights
    smallest = replica_model(m, "H200", "fp8", kv_budget_tokens=40960)
    cheapest = replica_model(m, "H200", "fp8", layout="cheapest", mean_context=4096, kv_budget_tokens=40960)
    assert smallest.layout.label == "TP2"
    cost = lambda r: r.best_operating_point(4096, 256 * r.dp_attention)["usd_per_mtoken"]  # noqa: E731
    assert cost(cheapest) < cost(smallest)
    with pytest.raises(FitError):
        replica_model(m, "H200", "fp8", layout=Layout(tp=1), kv_budget_tokens=40960)
    with pytest.raises(SpecError, match="dense"):
        replica_model("llama-3.1-8b", "H200", "fp8", layout=Layout.parse("DEP2"))


def test_a_short_context_limit_still_gives_a_finite_prefill_table() -> None:
    # main: a KV budget of <= 1024 tokens left the prefill table one cached-context column, and every prefill
    # interpolated to NaN (a measured dry run of a tiny-cpu-workload plan prefilled in no time)
    rm = replica_model("qwen3-30b-a3b", "H100", "fp8", "fp8_e4m3", kv_budget_tokens=1024, backend="aiconfigurator")
    p = np.asarray(rm.prefill_s(np.array([1.0, 100.0, 1000.0]), np.array([0.0, 0.0, 24.0])))
    assert np.isfinite(p).all() and (p > 0).all() and p[0] < p[1] < p[2]


def test_the_decode_table_reaches_an_attention_dp_replicas_own_cap() -> None:
    # main: the table's replica batches stopped at 2048 whatever the cap, so a DEP2 replica at the offline
    # comparison's 2048 per rank (4096 in all) was extrapolated linearly from 768 and 1024 per rank
    from aiconfigurator_core.sdk.engine import EngineHandle

    rm = replica_model("qwen3-30b-a3b", "H200", "bf16", "bf16", layout=Layout.parse("DEP2"), kv_budget_tokens=2048,
                       backend="aiconfigurator", max_batch=2048)
    assert rm.measured is not None and rm.measured.batches[-1] == 4096
    h = EngineHandle.compile("Qwen/Qwen3-30B-A3B", "h200_sxm", "sglang", tp_size=1, attention_dp_size=2,
                             moe_tp_size=1, moe_ep_size=2, gemm_quant_mode="bfloat16", moe_quant_mode="bfloat16",
                             kvcache_quant_mode="bfloat16", fmha_quant_mode="bfloat16")
    for per_rank in (1536, 2048):     # replica batches 3072 and 4096: aiconfigurator's own per-rank latency
        assert rm.decode_step_s(2 * per_rank, 1024) == pytest.approx(
            h.predict_decode_latency(per_rank, 1024, 2) / 1e3, rel=1e-9)
    # the grid: up to any cap, the cap itself on it
    from mixfleet.costmodel.steptime.measured import decode_batches

    assert decode_batches(16384)[-1] == 16384 and decode_batches(300)[-2:].tolist() == [256.0, 300.0]
    assert decode_batches(1).tolist() == [1.0, 2.0]
