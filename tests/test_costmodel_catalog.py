"""Catalog loading and validation: names, price tables, native / emulated support, bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.steptime.report import catalog_report
from mixfleet.costmodel.steptime.roofline import replica_model, weight_bytes

ACC_TEXT = data_path("accelerators.toml").read_text()
PREC_TEXT = data_path("precisions.toml").read_text()
GPUS = ["B200", "B300", "H200", "H100", "A100-80GB", "RTX-PRO-6000"]


def test_shipped_catalog_names_and_price_tables() -> None:
    cat = load_catalog()
    assert cat.price_table == "modal"
    assert cat.gpus() == GPUS and "CPU-2core" in cat.accelerators
    assert set(cat.price_tables()) == {"modal", "runpod"}
    assert set(cat.precisions) >= {"bf16", "fp8", "nvfp4", "mxfp4", "fp32"}
    assert set(cat.kv_dtypes) >= {"bf16", "fp8_e4m3"}
    runpod = load_catalog("runpod")
    assert runpod.price_table == "runpod"
    assert runpod.accelerator("H100").price_usd_per_gpu_hour != cat.accelerator("H100").price_usd_per_gpu_hour
    assert cat.accelerator("B300").price_estimate and not cat.accelerator("B200").price_estimate
    for a in cat.accelerators.values():
        assert a.source and a.date and a.price_usd_per_gpu_hour > 0


def test_lookups_list_known_names_and_ignore_case_and_spacing() -> None:
    cat = load_catalog()
    assert cat.accelerator("rtx pro 6000").name == "RTX-PRO-6000"
    assert cat.accelerator("a100_80gb").name == "A100-80GB"
    with pytest.raises(SpecError) as e:
        cat.accelerator("TPUv9")
    assert all(g in str(e.value) for g in GPUS)
    with pytest.raises(SpecError) as e:
        cat.precision("int3")
    assert "'nvfp4'" in str(e.value) and "'mxfp4'" in str(e.value)
    with pytest.raises(SpecError) as e:
        cat.kv_dtype("fp4")
    assert "'fp8_e4m3'" in str(e.value)
    with pytest.raises(SpecError) as e:
        load_catalog("aws")
    assert "'modal'" in str(e.value) and "'runpod'" in str(e.value)


def test_native_support_follows_architecture() -> None:
    cat = load_catalog()
    assert cat.native_accelerators("fp8") == ["B200", "B300", "H200", "H100", "RTX-PRO-6000"]
    assert cat.native_accelerators("nvfp4") == ["B200", "B300", "RTX-PRO-6000"]
    assert cat.native_accelerators("mxfp4") == ["B200", "B300", "RTX-PRO-6000"]
    assert cat.support("A100-80GB", "fp8") == "emulated"
    assert cat.support("H100", "nvfp4") == "emulated"
    assert cat.support("H100", "fp32") == "unsupported"
    assert cat.support("CPU-2core", "bf16") == "emulated" and cat.support("CPU-2core", "fp32") == "native"


def test_bytes_per_weight_include_scales() -> None:
    cat = load_catalog()
    assert cat.precision("bf16").bytes_per_weight == 2.0
    assert cat.precision("fp8").bytes_per_weight == pytest.approx(1 + 4 / (128 * 128), rel=1e-3)
    assert cat.precision("nvfp4").bytes_per_weight == pytest.approx((4 + 8 / 16) / 8)
    assert cat.precision("mxfp4").bytes_per_weight == pytest.approx((4 + 8 / 32) / 8)
    assert cat.kv_dtype("fp8_e4m3").bytes_per_element == 1.0 and cat.kv_dtype("bf16").bytes_per_element == 2.0


def _write(tmp_path: Path, acc: str = ACC_TEXT, prec: str = PREC_TEXT) -> dict[str, Path]:
    (tmp_path / "a.toml").write_text(acc)
    (tmp_path / "p.toml").write_text(prec)
    return {"accelerators_path": tmp_path / "a.toml", "precisions_path": tmp_path / "p.toml"}


@pytest.mark.parametrize("old,new,field,allowed", [
    ("memory_gb = 80.0             # HBM3", 'memory_gb = "lots"', "memory_gb", "a number"),
    ("bandwidth_tb_s = 3.35", "bandwidth_tb_s = -3.35", "bandwidth_tb_s", "> 0"),
    ('arch = "hopper"', 'arch = "volta"', "arch", "'blackwell'"),
    ("cold_start_s = 20.0\nsource = \"nv-h100 (H100", "cold_starts = 20.0\nsource = \"nv-h100 (H100", "cold_starts",
     "cold_start_s"),
    ("H100 = 3.95\n", "", "H100", "a price for every accelerator"),
    ('estimates = ["B300", "CPU-2core"]', 'estimates = ["B301"]', "estimates", "'B300'"),
    ("tflops_fp8 = 1979.0\ntflops_fp4 = 0.0\nlink = \"NVLink 4\"\nlink_gb_s = 900.0\ncold_start_s = 20.0\n"
     "source = \"nv-h100 (H100", "tflops_fp8 = 0.0\ntflops_fp4 = 0.0\nlink = \"NVLink 4\"\nlink_gb_s = 900.0\n"
     "cold_start_s = 20.0\nsource = \"nv-h100 (H100", "tflops_fp8", "native on arch 'hopper'"),
    ("eff_bw = 0.9 ", "eff_bw = 1.9 ", "eff_bw", "(0.0, 1.0]"),
])
def test_bad_accelerator_file_names_field_value_and_allowed(tmp_path: Path, old: str, new: str, field: str,
                                                           allowed: str) -> None:
    assert old in ACC_TEXT
    with pytest.raises(SpecError) as e:
        load_catalog(**_write(tmp_path, acc=ACC_TEXT.replace(old, new, 1)))
    assert e.value.field == field
    assert allowed in str(e.value)


@pytest.mark.parametrize("old,new,field,allowed", [
    ('native_arch = ["hopper", "blackwell"]', 'native_arch = ["hopper", "blackwell", "turing"]', "native_arch",
     "'ampere'"),
    ("weight_bits = 4\nscale_bits_per_weight = 0.5", "weight_bits = 4.5\nscale_bits_per_weight = 0.5",
     "weight_bits", "an integer"),
    ('compute = "fp4"', 'compute = "int4"', "compute", "'fp8'"),
    ("bytes_per_element = 1.0", "bytes_per_element = 0", "bytes_per_element", "(0.0, 8.0]"),
    ('emulable_arch = ["ampere", "cpu"]', 'emulable_arch = ["ampere", "cpu", "hopper"]', "emulable_arch",
     "not already in native_arch"),
])
def test_bad_precision_file_names_field_value_and_allowed(tmp_path: Path, old: str, new: str, field: str,
                                                         allowed: str) -> None:
    assert old in PREC_TEXT
    with pytest.raises(SpecError) as e:
        load_catalog(**_write(tmp_path, prec=PREC_TEXT.replace(old, new, 1)))
    assert e.value.field == field
    assert allowed in str(e.value)


def test_not_toml_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as e:
        load_catalog(**_write(tmp_path, acc="this is [not toml"))
    assert "valid TOML" in str(e.value)


def test_catalog_ranking_and_tp_needs_for_the_seed_model() -> None:
    cat = load_catalog()
    m = load_model_spec("qwen3.6-35b-a3b")
    rep = catalog_report(m, catalog=cat)
    assert [r["accelerator"] for r in rep["ranking"]] != [] and len(rep["ranking"]) == 6
    costs = [r["usd_per_mtoken"] for r in rep["ranking"]]
    assert costs == sorted(costs)
    for rk in rep["ranking"]:   # each accelerator's best native pair, recomputed from the rows
        rows = [r for r in rep["rows"] if r["accelerator"] == rk["accelerator"] and r["support"] == "native"
                and r["best"]]
        assert rk["usd_per_mtoken"] == min(r["best"]["usd_per_mtoken"] for r in rows)
    # the pairs whose weights alone exceed one GPU's usable memory are exactly those reported as needing TP > 1
    need = {(x["accelerator"], x["precision"]) for x in rep["needs_tp"]}
    for r in rep["rows"]:
        if r["support"] == "unsupported":
            continue
        acc = cat.accelerator(r["accelerator"])
        usable = acc.memory_gb * 1e9 * acc.mem_util - acc.reserve_gb * 1e9
        kv_full = m.max_context * m.kv_elements_per_token * 1.0   # fp8 KV: 1 byte per element
        too_big = weight_bytes(m, cat.precision(r["precision"])) + kv_full > usable
        assert ((r["accelerator"], r["precision"]) in need) == too_big
        assert r["fits_one_gpu"] == (not too_big)
    assert ("H100", "bf16") in need and ("A100-80GB", "bf16") in need
    assert replica_model(m, "H100", "bf16", catalog=cat).tp == 2
